"""BlendCache: an HF DynamicCache holding the whole prompt's K/V in a growable buffer, refreshed in place.

During a blended prefill, `write_positions` names the absolute positions the current layer
computes (a chunk of a layer's tokens: blend.blender runs a layer in chunks); `update()` writes their fresh
K/V over the cached ones and returns the full-length K/V, so every query attends over the whole prompt. At
each layer in `deviation_layers` it first measures how far the fresh K/V are from the cached ones (the HKVD
score), chunk after chunk: `deviation(layer)` gives them for every position the layer wrote, in order.
With `write_positions` unset, `update()` appends, as a DynamicCache does, but into a preallocated
buffer: a token (a precompute's, or a gated model's decode step over a pool slot, blend.pool) writes
one position instead of copying the whole cache (DynamicCache's `torch.cat` is O(length) per token).
The buffer doubles when it is full (never for a pool slot: the pool checks lengths first).
With `stored` set, the spans in `round_trip_now` are replaced by their store codec's round trip right after a
chunk's write (StoredSpans: the prefill then attends to what a repeat of the prompt reads back).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# A store codec's round trip of spans of one layer's K/V, in place: (keys [1, H, N, D], values, [(start, end)]),
# each span then as a read of its entry decodes it
RoundTrip = Callable[[torch.Tensor, torch.Tensor, list[tuple[int, int]]], None]


@dataclass(frozen=True)
class StoredSpans:
    """The prompt's spans the store will keep ([start, end) positions) and the round trip a read of them gives.
    A prefill that attends to their round trip, rather than to its own unrounded K/V, answers as a repeat of the
    prompt that reads them back does (with a lossy codec: int8's round trip moves a logprob by up to ~0.04)."""
    spans: tuple[tuple[int, int], ...]
    round_trip: RoundTrip


class BlendCache(DynamicCache):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int | None = None):
        # keys/values: [L, H, capacity, D] — the first `length` slots (default: all) hold the prompt's
        # positions, filled or to be refreshed; the rest is room for decoding.
        super().__init__()
        length = keys.shape[2] if length is None else length
        self.layers, self._buffers = [], []
        for k, v in zip(keys.unsqueeze(1), values.unsqueeze(1)):  # each [1, H, capacity, D]
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k[:, :, :length], v[:, :, :length]  # views of the buffer
            self.layers.append(layer)
            self._buffers.append((k, v))
        self.write_positions: torch.Tensor | None = None
        self.deviation_layers: frozenset[int] = frozenset()
        self.deviation_on = "value"
        self.deviations: dict[int, list[torch.Tensor]] = {}  # layer -> per chunk [len(write_positions)]
        # Called with layer i before a prefill reads layer i's cached K/V (pipelined loading waits there).
        self.before_read: Callable[[int], None] | None = None
        # The spans the store will keep, and those of them this chunk's update replaces by their round trip once
        # written (blend.blender: the ones whose last position the chunk reaches first)
        self.stored: StoredSpans | None = None
        self.round_trip_now: list[tuple[int, int]] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states/value_states: [1, H, Tq, D] for the tokens at write_positions (or new tokens to append)
        if self.write_positions is None:
            return self.append(layer_idx, key_states, value_states)
        if self.before_read is not None:
            self.before_read(layer_idx)
        layer = self.layers[layer_idx]
        if layer_idx in self.deviation_layers:
            fresh, cached = (value_states, layer.values) if self.deviation_on == "value" else (key_states, layer.keys)
            diff = fresh - cached.index_select(2, self.write_positions)
            self.deviations.setdefault(layer_idx, []).append(diff.pow(2).sum(dim=(0, 1, 3)))  # squared L2 per token
        layer.keys.index_copy_(2, self.write_positions, key_states)
        layer.values.index_copy_(2, self.write_positions, value_states)
        if self.round_trip_now:  # before any query of this chunk reads them
            self.stored.round_trip(layer.keys, layer.values, self.round_trip_now)
        return layer.keys, layer.values

    def deviation(self, layer_idx: int) -> torch.Tensor:
        """[positions written at the layer]: each one's squared L2 deviation, in the order they were written."""
        return torch.cat(self.deviations[layer_idx])

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `keys`/`values` [1, H, T, D] after the layer's last position; the layer's K/V, now T longer."""
        layer = self.layers[layer_idx]
        n, t = layer.keys.shape[2], keys.shape[2]
        buffer_k, buffer_v = self._buffers[layer_idx]
        if n + t > buffer_k.shape[2]:  # full: double (amortized O(1) per token)
            capacity = max(2 * buffer_k.shape[2], n + t, 16)
            buffer_k, buffer_v = (_grown(b, n, capacity) for b in (buffer_k, buffer_v))
            self._buffers[layer_idx] = buffer_k, buffer_v
        buffer_k[:, :, n:n + t] = keys
        buffer_v[:, :, n:n + t] = values
        layer.keys, layer.values = buffer_k[:, :, :n + t], buffer_v[:, :, :n + t]
        return layer.keys, layer.values

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (undo the appends of a step that failed half-way)."""
        for layer, (buffer_k, buffer_v) in zip(self.layers, self._buffers):
            layer.keys, layer.values = buffer_k[:, :, :length], buffer_v[:, :, :length]

    @property
    def capacity(self) -> int:
        return self._buffers[0][0].shape[2] if self._buffers else 0


def _grown(buffer: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    # buffer: [1, H, old capacity, D] -> [1, H, capacity, D] holding the first `used` positions
    grown = buffer.new_empty(buffer.shape[0], buffer.shape[1], capacity, buffer.shape[3])
    grown[:, :, :used] = buffer[:, :, :used]
    return grown
