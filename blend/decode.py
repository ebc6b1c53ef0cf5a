"""Sampling and streaming: next-token choice (on the model's device, a batch at a time), the decode loop, and an
answer's tokens as they arrive (Decoding: a sequence in the pool and where it ends; TokenStream: the ids the client
sees; TextStream: text deltas, detokenised incrementally, with stop strings)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from blend.grammar import Constraint
from blend.pool import KVPool

# Below this, logits / temperature overflows float32 (and sampling is greedy in all but name).
MIN_TEMPERATURE = 1e-4
MAX_TOP_LOGPROBS = 20  # alternatives a token's logprobs may list (OpenAI's bound); the step computes this many


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0          # 0 (or below MIN_TEMPERATURE) = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int | None = None   # None: no logprobs; n: each token's, with its n likeliest alternatives


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (its own distribution: before temperature, top_p and
    a grammar's mask), and the likeliest tokens at that position with theirs, most likely first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """logits [B, V], chosen [B] → (the chosen tokens' logprobs [B], the MAX_TOP_LOGPROBS likeliest tokens [B, K]
    and their logprobs [B, K]), on logits' device. Fixed shapes, so a CUDA graph can hold it."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                                 # [B, V]
    top = logprobs.topk(min(MAX_TOP_LOGPROBS, logprobs.shape[-1]), dim=-1)              # [B, K]
    return logprobs.gather(-1, chosen[:, None])[:, 0], top.indices, top.values


def logprob_rows(chosen: list[int], logprobs: list[float], top_ids: list[list[int]], top_values: list[list[float]],
                 wanted: Sequence[int | None]) -> list[TokenLogprob | None]:
    """token_logprobs' output (as lists) → each row's TokenLogprob with its `wanted` alternatives (None: none)."""
    return [None if n is None else TokenLogprob(token, logprob, tuple(zip(ids[:n], values[:n])))
            for token, logprob, ids, values, n in zip(chosen, logprobs, top_ids, top_values, wanted)]


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                allowed: torch.Tensor | None = None) -> int:
    """logits: [V] → one token id (greedy at temperature 0, else temperature + nucleus sampling), among the
    `allowed` ones ([1, V] bool on the host; None: any)."""
    temperature, top_p = sampling_rows([params], logits.device)
    noise = draw_noise([params], [generator], logits.shape[-1], logits.device)
    allowed = None if allowed is None else allowed.to(logits.device)
    return int(sample_rows(logits[None], temperature, top_p, noise, allowed)[0])


def logprob_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logits: [V] → `token`'s TokenLogprob with its `top` likeliest alternatives."""
    lists = [t.tolist() for t in token_logprobs(logits[None], torch.tensor([token], device=logits.device))]
    return logprob_rows([token], *lists, [top])[0]


def sampling_rows(params: Sequence[SamplingParams | None], device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's temperature (0 = greedy; so is a row without params) and top_p, as [B] float32 tensors."""
    params = [p or SamplingParams() for p in params]
    temperature = [p.temperature if p.temperature >= MIN_TEMPERATURE else 0.0 for p in params]
    return (torch.tensor(temperature, dtype=torch.float32, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device))


def draw_noise(params: Sequence[SamplingParams | None], generators: Sequence[torch.Generator | None], vocab: int,
               device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The exponential noise sample_rows needs: [B, V] float32 on `device`, row b drawn on the host from
    generators[b] (greedy or absent rows: ones); None when no row samples. torch.multinomial draws exactly
    this for one sample (argmax of probs / Exp(1) noise), so a request's seed gives the same tokens on any
    device and in any batch."""
    sampled = [b for b, p in enumerate(params) if p is not None and p.temperature >= MIN_TEMPERATURE]
    if not sampled:
        return None
    noise = torch.ones(len(params), vocab, dtype=torch.float32)
    for b in sampled:
        noise[b].exponential_(1, generator=generators[b])
    return noise.to(device, non_blocking=True)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                noise: torch.Tensor | None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] → token ids [B] (int64, on logits' device): greedy where temperature is 0, else
    temperature + nucleus sampling with `noise` (draw_noise; None: every row greedy), each row among its
    `allowed` tokens ([B, V] bool, blend.grammar.token_masks; None: any). Fixed shapes and no host sync, so a
    CUDA graph can hold it."""
    if allowed is not None:  # a row's grammar: what it forbids can be neither the argmax nor drawn
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy = logits.argmax(-1)                                                     # [B]
    if noise is None:
        return greedy
    scaled = logits.float() / temperature.clamp(min=MIN_TEMPERATURE)[:, None]
    probs = torch.softmax(scaled, dim=-1)                                          # [B, V]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # keep the smallest set reaching top_p (rows with top_p 1 keep every token, whatever the rounding)
    outside = (sorted_probs.cumsum(-1) - sorted_probs > top_p[:, None]) & (top_p[:, None] < 1.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0.0))
    sampled = (probs / noise).argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)


@dataclass(eq=False)
class Decoding:
    """One request decoding in a pool slot. `length` is its cache_seqlens: the next token's position; a decode
    step moves it on only once the step's forward has succeeded. `first_token`: the answer's first token,
    chosen from the prefill's logits when the request took its slot (DecodeRuntime.start). `constraint`: the
    grammar its tokens must follow (blend.grammar), moved on by `accept` as the answer takes each token.
    `logprobs`: with sampling.top_logprobs, each token's (the first one's included) as the steps chose them.

    `accept(token)` is the one place the end of a sequence is decided (an eos token, max_new_tokens, a complete
    grammar): it sets `finish_reason`. `last` is the token the next step feeds."""

    pool: KVPool
    slot: int
    length: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    first_token: int = 0
    constraint: Constraint | None = None
    released: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # each token's, in order (sampling.top_logprobs)
    eos_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)  # every token taken, an ending eos included
    finish_reason: str | None = None  # "stop" (eos, grammar complete) | "length"

    @property
    def last(self) -> int:
        return self.tokens[-1]

    def accept(self, token: int) -> None:
        """The answer takes `token`: the sequence ends at an eos, after max_new_tokens, or where its grammar is
        complete (or would be cut by the tokens left: it ends at a whole call rather)."""
        self.tokens.append(token)
        left = self.sampling.max_new_tokens - len(self.tokens)
        if token in self.eos_ids:
            self.finish_reason = "stop"
        elif left <= 0:
            self.finish_reason = "length"
        elif self.constraint is not None:
            self.constraint.advance(token)
            if self.constraint.finished or self.constraint.out_of_room(left):
                self.finish_reason = "stop"

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.release(self.slot)


@dataclass(kw_only=True)
class TokenStream:
    """An answer's tokens as they arrive, on the output side (off the model thread): what the client sees.

    `push(token)` returns what the client sees of that token: here the id itself, eos included (scorers read
    it); TextStream's text deltas. `finish_reason` is "stop" once an eos token was pushed (TextStream: or a
    stop string); later pushes release nothing. `finish()` at the end returns what is left to see."""

    eos_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)   # the answer's tokens (an ending eos not included)
    eos: int | None = None                            # the eos token that ended it
    finish_reason: str | None = None

    @property
    def ids(self) -> list[int]:
        """Every token generated: the answer's, then the eos that ended it."""
        return self.tokens + ([] if self.eos is None else [self.eos])

    def push(self, token: int) -> tuple[Any, ...]:
        if self.finish_reason is not None:  # decoded past its end (a stop string seen late): never shown
            return ()
        if token in self.eos_ids:
            self.eos, self.finish_reason = token, "stop"
        else:
            self.tokens.append(token)
        return self._release(token)

    def _release(self, token: int) -> tuple[Any, ...]:
        return (token,)

    def finish(self) -> tuple[Any, ...]:
        self.finish_reason = self.finish_reason or "length"
        return ()


@dataclass
class TextStream(TokenStream):
    """An answer as text: token ids -> text deltas, ending at eos or a stop string.

    Detokenised incrementally, as vLLM's and HF's TextStreamer do: only the tokens since `_prefix` are decoded
    (the few before `_read` give the new ones their context: a byte-level BPE's split characters, a
    sentencepiece's leading space). Text that could still become a stop string is held back until it cannot; a
    stop string can only end in the new text and begin in what is held back (a longer prefix of one would have
    been held back), so only those are searched. A token costs the same at any answer length."""

    tokenizer: PreTrainedTokenizerBase | None = None
    stop: tuple[str, ...] = ()
    stop_sequence: str | None = None  # the stop string that ended the answer
    _pieces: list[str] = field(default_factory=list)  # the text released, in pieces
    _held: str = ""   # text not yet released: it may begin a stop string
    _prefix: int = 0  # tokens[_prefix:_read] decode to the text's last piece (the new tokens' context)
    _read: int = 0    # tokens before this are in the text

    @property
    def text(self) -> str:
        """The answer's text so far (a stop string and what follows it cut)."""
        return "".join(self._pieces) + self._held

    def _release(self, token: int) -> tuple[str, ...]:
        """The text `token` releases (none while held back); at a stop string, the text before it, and the
        answer has finished."""
        if self.eos is not None:
            return ()
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self.tokens))
        if len(after) <= len(before) or after.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
            return ()
        self._prefix, self._read = self._read, len(self.tokens)
        window = self._held + after[len(before):]
        cut, self.stop_sequence = min(((i, s) for s in self.stop if (i := window.find(s)) >= 0), default=(-1, None))
        if cut >= 0:
            self.finish_reason = "stop"
            return self._out(window[:cut], "")
        held = max((n for s in self.stop for n in range(min(len(s) - 1, len(window)), 0, -1)
                    if window.endswith(s[:n])), default=0)
        return self._out(window[:len(window) - held], window[len(window) - held:])

    def _out(self, delta: str, held: str) -> tuple[str, ...]:
        self._held = held
        if delta:
            self._pieces.append(delta)
        return (delta,) if delta else ()

    def _decode(self, start: int, stop: int) -> str:
        return self.tokenizer.decode(self.tokens[start:stop], skip_special_tokens=True) if stop > start else ""

    def finish(self) -> tuple[str, ...]:
        """The text still held back (at the end of generation): a trailing partial character too."""
        rest = ""
        if self.stop_sequence is None and self._read < len(self.tokens):
            rest = self._decode(self._prefix, len(self.tokens))[len(self._decode(self._prefix, self._read)):]
            self._read = len(self.tokens)
        super().finish()
        return self._out(self._held + rest, "")
