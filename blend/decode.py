"""Sampling and streaming: next-token choice, and token ids → text deltas with stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

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
    if params.temperature < MIN_TEMPERATURE:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


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
