"""DecodeRuntime: decoding from a Blender's prefills, built whole: its KV pool, its decode step, its graphs.

    start(prefill, sampling) -> Decoding        the prefill's cache copied into a free pool slot (blend.pool),
                                                its first token chosen from the prefill's logits
    step(sequences, tokens, positions) -> [B]   one token for each row in one forward: row b feeds tokens[b] at
                                                positions[b] into its slot, samples on the device (among the
                                                tokens its grammar allows, if it has one: blend.grammar)
    advance(sequences) -> [B]                   the per-token path: one step over every sequence still decoding
                                                (each feeds its last token), each row's token accepted by its
                                                sequence (Decoding.accept: where it ends); a failed step is retried
                                                row by row, so only the faulty row gets its error
    generate(prefill, sampling, answer) -> ...  one answer alone (advance, a row at a time), in a slot released at
                                                the end

The step is the device's one form, chosen by the backend when the runtime is built (blend.backend.decode_step:
on the CPU the kernel step where its probe passes, else the model's layers; on CUDA the model's layers), over
the first rows of the pool at a fixed shape (blend.batch), replayed as CUDA graphs where the backend captures
them (blend.graphs). Every model the Blender holds decodes through it, one the blend gate refused and rows past
a sliding window included: the pooled attention applies the model's window and softcap (blend.attention).
"""
from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import torch

from blend.batch import bucket
from blend.blender import Blender, Prefill
from blend.decode import (
    Decoding,
    SamplingParams,
    TokenStream,
    draw_noise,
    logprob_of,
    logprob_rows,
    sample_next,
    sample_rows,
    sampling_rows,
    token_logprobs,
)
from blend.grammar import Constraint, token_masks
from blend.pool import DEFAULT_POOL_TOKENS, KVPool, PoolTooShort

log = logging.getLogger("ragblend.blend")


class DecodeRuntime:
    def __init__(self, blender: Blender, *, slots: int = 8, max_len: int | None = None, cuda_graphs: str = "auto"):
        """`slots` requests at once (the scheduler's slots), `max_len` positions each (prompt + answer; at most the
        model's context; default DEFAULT_POOL_TOKENS); cuda_graphs: auto (on CUDA) | on | off. The kernel step's
        probe, if the backend offers it, runs here."""
        if cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto, on or off, got {cuda_graphs!r}")
        self.model, self.backend, self.device = blender.model, blender.backend, blender.device
        context = getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.max_len = min(max_len or DEFAULT_POOL_TOKENS, context or max_len or DEFAULT_POOL_TOKENS)
        self.form, self.kernel_step_refusal = self.backend.decode_step(self.model)
        if self.kernel_step_refusal:
            log.info("decode steps run through the model's layers", extra={"reason": self.kernel_step_refusal})
        self.pool = KVPool(blender.num_layers, blender.kv_heads, blender.head_dim, slots=slots, max_len=self.max_len,
                           dtype=self.form.pool_dtype or blender.dtype, device=self.device)
        self.graphs = self.backend.step_graphs(cuda_graphs)
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        ids = self.model.generation_config.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        tokenizer_eos = getattr(blender.tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset(i for i in [*ids, tokenizer_eos] if i is not None)

    @property
    def cuda_graphs(self) -> str | None:
        """Why the decode step is not a CUDA graph (None: it is, or will be at its first step)."""
        return self.graphs.disabled

    def start(self, prefill: Prefill, sampling: SamplingParams = SamplingParams(),
              constraint: Constraint | None = None, eos_ids: frozenset[int] | None = None) -> Decoding:
        """A pool slot holding the prefill's cache (one copy; the prefill's own cache is left as it was) and the
        answer's first token (the first `constraint` allows, if it has one), accepted (it may end the answer).
        `eos_ids`: the tokens that end it (default the model's; none: ignore eos). The caller releases it
        (`Decoding.release`) when the request ends."""
        needed = prefill.num_tokens + sampling.max_new_tokens - 1
        if needed > self.pool.max_len:
            raise PoolTooShort(f"a prompt of {prefill.num_tokens} tokens plus {sampling.max_new_tokens} new "
                               f"tokens does not fit the {self.pool.max_len}-token decode pool")
        slot = self.pool.acquire()
        try:
            self.pool.load(slot, [(layer.keys, layer.values) for layer in prefill.cache.layers])
        except BaseException:
            self.pool.release(slot)
            raise
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        try:
            first = sample_next(prefill.logits, sampling, generator, token_masks([constraint], self.vocab))
        except BaseException:
            self.pool.release(slot)
            raise
        logprobs = [] if sampling.top_logprobs is None else [logprob_of(prefill.logits, first, sampling.top_logprobs)]
        sequence = Decoding(self.pool, slot, prefill.num_tokens, sampling, generator, first, constraint,
                            logprobs=logprobs, eos_ids=self.eos_ids if eos_ids is None else eos_ids)
        sequence.accept(first)
        return sequence

    def generate(self, prefill: Prefill, sampling: SamplingParams = SamplingParams(),
                 answer: TokenStream | None = None) -> Iterator[Any]:
        """One answer alone: what `answer` releases for each token (default: the token ids, an ending eos
        included). The slot is released when the answer ends or the iterator is closed."""
        answer = answer if answer is not None else TokenStream(eos_ids=self.eos_ids)
        sequence = self.start(prefill, sampling, eos_ids=answer.eos_ids)
        try:
            yield from answer.push(sequence.last)
            while sequence.finish_reason is None and answer.finish_reason is None:  # (or a stop string)
                [row] = self.advance([sequence])
                if isinstance(row, BaseException):
                    raise row
                yield from answer.push(row)
            yield from answer.finish()
        finally:
            sequence.release()

    def advance(self, sequences: Sequence[Decoding]) -> list[int | BaseException]:
        """One batched step over `sequences` (each feeds its last token at its length), each row's new token then
        accepted by its sequence. A step that raises moved no row on: each row is retried alone, and a row that
        fails alone gets its error (the others their tokens)."""
        try:
            rows: list[int | BaseException] = list(self.step(sequences, [s.last for s in sequences],
                                                              [s.length for s in sequences]))
        except Exception:  # find the row at fault
            rows = [self._alone(s) for s in sequences]
        for sequence, row in zip(sequences, rows):
            if not isinstance(row, BaseException):
                sequence.accept(row)
        return rows

    def _alone(self, sequence: Decoding) -> int | BaseException:
        try:
            return self.step([sequence], [sequence.last], [sequence.length])[0]
        except Exception as exc:  # noqa: BLE001 - this row's error
            return exc

    @torch.inference_mode()
    def step(self, sequences: Sequence[Decoding], tokens: Sequence[int], positions: Sequence[int]) -> list[int]:
        """One token for each of B requests in one forward: row b feeds tokens[b] at positions[b] into
        sequences[b]'s slot. Returns each row's next token, sampled on the device by its own params. A step that
        raises moves no sequence on (blend.driver's retry relies on it)."""
        positions, pool = list(positions), self.pool
        if max(positions) >= pool.max_len:
            raise PoolTooShort(f"position {max(positions)} is past the {pool.max_len}-token decode pool")
        slots = [s.slot for s in sequences]
        # row b is slot b; rows of other slots pad (blend.batch). A graph needs one of a few batch sizes;
        # eagerly, padding to one would only add work.
        rows = bucket(max(slots) + 1, pool.slots) if self.graphs.enabled else max(slots) + 1
        token_row = torch.zeros(rows, dtype=torch.long)
        position_row = torch.full((rows,), pool.scratch, dtype=torch.long)
        token_row[slots], position_row[slots] = torch.tensor(list(tokens)), torch.tensor(positions)
        params: list[SamplingParams | None] = [None] * rows
        generators: list[torch.Generator | None] = [None] * rows
        for s in sequences:
            params[s.slot], generators[s.slot] = s.sampling, s.generator
        temperature, top_p = sampling_rows(params, self.device)
        noise = draw_noise(params, generators, self.vocab, self.device)
        constraints: list[Constraint | None] = [None] * rows
        for s in sequences:
            constraints[s.slot] = s.constraint
        allowed = token_masks(constraints, self.vocab)                                     # [rows, V] | None
        key_columns = self.backend.key_columns(max(positions) + 1, pool.columns)
        if self.form.reads_masked_keys:  # outside any graph: the masked keys a step reads must be finite
            pool.readable(rows, key_columns)
        inputs = {"tokens": token_row.to(self.device), "positions": position_row.to(self.device),
                  "temperature": temperature, "top_p": top_p}
        if noise is not None:
            inputs["noise"] = noise
        if allowed is not None:
            inputs["allowed"] = allowed.to(self.device, non_blocking=True)

        wanted = [s.sampling.top_logprobs for s in sequences]

        def forward(tokens: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    noise: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
            logits = self.form.logits(pool, tokens, positions, key_columns)                    # [rows, V]
            chosen = sample_rows(logits, temperature, top_p, noise, allowed)                   # [rows]
            if all(n is None for n in wanted):
                return (chosen,)
            return chosen, *token_logprobs(logits, chosen)  # + [rows], [rows, K], [rows, K]

        key = (rows, key_columns, noise is not None, allowed is not None, any(n is not None for n in wanted))
        following, *logprobs = [t.tolist() for t in self.graphs.run(key, forward, inputs)]
        for sequence, position in zip(sequences, positions):
            sequence.length = position + 1
        if logprobs:  # each asking row's, kept on its sequence
            rows_of = [[column[slot] for slot in slots] for column in logprobs]
            chosen = [following[slot] for slot in slots]
            for sequence, logprob in zip(sequences, logprob_rows(chosen, *rows_of, wanted)):
                if logprob is not None:
                    sequence.logprobs.append(logprob)
        return [following[slot] for slot in slots]
