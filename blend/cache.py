"""BlendCache: an HF DynamicCache holding the whole prompt's K/V, refreshed in place.

During a blended prefill, `write_positions` names the absolute positions the current layer
computes; `update()` writes their fresh K/V over the cached ones and returns the full-length
K/V, so every query attends over the whole prompt. At each layer in `deviation_layers` it first
measures how far the fresh K/V are from the cached ones (the HKVD score) into `deviations`.
With `write_positions` unset it is a plain DynamicCache, so decoding appends as usual.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class BlendCache(DynamicCache):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        # keys/values: [L, H, N, D] — one slot per prompt position, filled or to be refreshed.
        super().__init__()
        self.layers = []
        for k, v in zip(keys.unsqueeze(1), values.unsqueeze(1)):  # each [1, H, N, D]
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            self.layers.append(layer)
        self.write_positions: torch.Tensor | None = None
        self.deviation_layers: frozenset[int] = frozenset()
        self.deviation_on = "value"
        self.deviations: dict[int, torch.Tensor] = {}  # layer -> [len(write_positions)]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states/value_states: [1, H, Tq, D] for the tokens at write_positions
        if self.write_positions is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if layer_idx in self.deviation_layers:
            fresh, cached = (value_states, layer.values) if self.deviation_on == "value" else (key_states, layer.keys)
            diff = fresh - cached.index_select(2, self.write_positions)
            self.deviations[layer_idx] = diff.pow(2).sum(dim=(0, 1, 3))  # squared L2 per token
        layer.keys.index_copy_(2, self.write_positions, key_states)
        layer.values.index_copy_(2, self.write_positions, value_states)
        return layer.keys, layer.values
