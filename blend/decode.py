"""Sampling and streaming: next-token choice (on the model's device, a batch at a time), the decode loop, and token
ids → text deltas with stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase


# Below this, logits / temperature overflows float32 (and sampling is greedy in all but name).
MIN_TEMPERATURE = 1e-4


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0          # 0 (or below MIN_TEMPERATURE) = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] → one token id (greedy at temperature 0, else temperature + nucleus sampling)."""
    temperature, top_p = sampling_rows([params], logits.device)
    return int(sample_rows(logits[None], temperature, top_p, draw_noise([params], [generator], logits.shape[-1],
                                                                           logits.device))[0])


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
                noise: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] → token ids [B] (int64, on logits' device): greedy where temperature is 0, else
    temperature + nucleus sampling with `noise` (draw_noise; None: every row greedy). Fixed shapes and
    no host sync, so a CUDA graph can hold it."""
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


@dataclass
class DecodeStep:
    """A directive of the decode loop: the next token of `sequence`, after feeding it `token` at `position`.
    Whoever drives the loop (blend.decode.drive, the app's scheduler) answers with the next token id."""
    sequence: Any  # blend.pool.Sequence (the scheduler treats it as opaque)
    token: int
    position: int


def decode_loop(sequence, first_logits: torch.Tensor) -> Generator[int | DecodeStep, int | None, None]:
    """The one decode loop (the engine's requests and Blender.decode share it): the first token sampled
    from the prefill's logits [V], then one DecodeStep per token, whose answer is the next token. Yields
    each token; ends after `max_new_tokens`. The consumer stops early (eos, a stop string, a cancel) by
    closing it."""
    params = sequence.sampling
    token = sample_next(first_logits, params, sequence.generator)
    for step in range(params.max_new_tokens):
        yield token
        if step + 1 == params.max_new_tokens:
            return
        token = yield DecodeStep(sequence, token, sequence.length)


def drive(loop: Generator[Any, Any, None], decode_step: Callable) -> Iterator[Any]:
    """Run a decode loop alone: answer each DecodeStep with a one-row `decode_step`; yield the rest."""
    reply = None
    while True:
        try:
            item = loop.send(reply)
        except StopIteration:
            return
        reply = None
        if isinstance(item, DecodeStep):
            reply = decode_step([item.sequence], [item.token], [item.position])[0]
        else:
            yield item


@dataclass
class TextStream:
    """Turns generated token ids into text deltas, stopping at a stop string or eos.

    Text that could still become a stop string is held back until it cannot.
    """

    tokenizer: PreTrainedTokenizerBase
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    _emitted: int = 0

    def feed(self, token_ids: Iterable[int]) -> Iterator[str]:
        """All of `token_ids` (an answer's tokens, or `Blender.decode` as it runs) → text deltas, then what is
        held back; `finish_reason` "length" unless eos or a stop string ended it (app.compare's answers)."""
        for token in token_ids:
            if delta := self.push(token):
                yield delta
            if self.finish_reason is not None:
                break
        else:
            self.finish_reason = self.finish_reason or "length"
        if delta := self.flush():
            yield delta

    def push(self, token: int) -> str:
        """One generated token → the text it releases ("" while held back); sets `finish_reason` at
        eos or a stop string, after which nothing more may be pushed."""
        if token in self.eos_ids:
            self.finish_reason = "stop"
            return ""
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self.text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
            return ""
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.finish_reason = "stop"
            return self.flush()
        safe = len(self.text) - self._held_back()
        delta, self._emitted = self.text[self._emitted:safe], max(self._emitted, safe)
        return delta

    def flush(self) -> str:
        """The text still held back (at the end of generation)."""
        delta, self._emitted = self.text[self._emitted:], max(self._emitted, len(self.text))
        return delta

    def _held_back(self) -> int:
        """Length of the longest text tail that is a proper prefix of a stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:n])), default=0)
