"""The decode step through the model's own modules: one fixed-shape forward over the first `rows` slots of the KV
pool (blend.pool), the step on CUDA and wherever blend.kernel_step's does not run.

Row b of the step is slot b. The batch is padded to a bucket size (`buckets`) when the step is a CUDA graph; a
padding row (a free slot, or one not decoding this step) feeds token 0 at the pool's scratch column, so its K/V
land where no request looks, and its sampled token is dropped. `LayerStep` runs the model's own forward (its
embeddings, decoder layers, norm and head, whatever they scale or cap) with `PoolView` as its cache: `update()`
writes each row's new K/V at its position in its slot (one index_put per layer) and returns the rows' K/V as
views of the pool (`PooledKV`); attention runs over all rows in one call, each row's keys past its own position
masked (blend.attention dispatches `PooledKV` to `pooled_attention_forward`, for a model the blend gate refused
too: `blend_attention`). The pooled attention is the model's own math: the same scale, its sliding window where
a layer has one, its logit softcapping (as HF's eager attention computes it). The next tokens are sampled on the
device (blend.decode.sample_rows), so only [rows] token ids reach the host.

The shapes depend only on (rows, key columns): CUDA graphs replay it (blend.graphs), one graph per (batch
bucket, key-column bucket, sampling or not). Key columns: the longest row's length rounded up by the backend
(`Backend.key_columns`), so a step reads few masked keys.

Measured on the CPU (SmolLM2 shape, 2.5k-token rows, 2 busy cores, one layer's attention): one masked
sdpa call over all rows, the query heads of a KV head folded into the query length, cost 14 ms for 8
rows vs 58 ms as 8 ragged per-row calls (8.7 vs 33 ms at 4 rows; equal at 1 row).
"""
from __future__ import annotations

import torch

from blend.attention import PooledKV, blend_attention
from blend.pool import KVPool


def buckets(slots: int) -> list[int]:
    """Batch sizes a graphed step is padded to: powers of two up to the pool's slot count (and it)."""
    sizes, n = [], 1
    while n < slots:
        sizes.append(n)
        n *= 2
    return sizes + [slots]


def bucket(rows: int, slots: int) -> int:
    return next(n for n in buckets(slots) if n >= rows)


class PoolView:
    """The KV pool as the model's `cache` for one step."""

    def __init__(self, pool: KVPool, positions: torch.Tensor, key_columns: int):
        self.pool, self.positions, self.key_columns = pool, positions, key_columns
        self.rows = torch.arange(positions.shape[0], device=positions.device)
        self.row_positions = positions.view(-1, 1, 1, 1)                                 # [rows, 1, 1, 1]
        self.columns = torch.arange(key_columns, device=positions.device)               # [columns]
        self.visible = self.columns <= self.row_positions                              # [rows, 1, 1, columns]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states/value_states: [rows, H, 1, D], row b the new token of slot b at positions[b]
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]        # [slots, H, columns, D]
        keys[self.rows, :, self.positions] = key_states[:, :, 0].to(keys.dtype)     # (rounded to the pool's elements)
        values[self.rows, :, self.positions] = value_states[:, :, 0].to(values.dtype)
        n, t = self.rows.shape[0], self.key_columns
        return (PooledKV(keys[:n, :, :t], self.visible, self.row_positions, self.columns),
                PooledKV(values[:n, :, :t], self.visible, self.row_positions, self.columns))


class LayerStep:
    """The decode step's forward through the model's own modules, over any pool shaped for the model."""

    reads_masked_keys = True  # sdpa reads every key column, masked ones included: they must be finite
    pool_dtype = None  # the decode pool's elements: the model's dtype

    def __init__(self, model):
        self.model = model

    def logits(self, pool: KVPool, tokens: torch.Tensor, positions: torch.Tensor, key_columns: int) -> torch.Tensor:
        """tokens, positions [rows] (int64, on the pool's device) → next-token logits [rows, V]."""
        view = PoolView(pool, positions, key_columns)
        with blend_attention(self.model):  # (a 4-D mask passes the model's mask code untouched)
            out = self.model(input_ids=tokens[:, None], position_ids=positions[:, None], cache=view,
                             attention_mask=view.visible, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]                                                     # [rows, V]
