"""The decode step: one fixed-shape forward over the first `rows` slots of the KV pool (blend.pool).

Row b of the step is slot b. The batch is padded to a bucket size (BUCKETS); a padding row (a free slot,
or one not decoding this step) feeds token 0 at the pool's scratch column, so its K/V land where no
request looks, and its sampled token is dropped. Through the model's own decoder layers:
embeddings, projections, MLPs and the LM head are [rows, 1] batched matmuls; `PoolView.update()` writes
each row's new K/V at its position in its slot (one index_put per layer) and returns the rows' K/V as
views of the pool; attention runs over all rows in one kernel call, each row's keys past its own
length masked (blend.attention dispatches `PooledKV` here); the next tokens are sampled on the device
(blend.decode.sample_rows), so only [rows] token ids reach the host. On the CPU with its kernels,
Llama-shaped layers run as a blend.kernel_step.KernelStep instead: the same float operations, so the same
bits, without the HF modules' per-op cost (a SmolLM2 step of one row 52 → 44 ms, of four 80 → 72 ms).

The shapes depend only on (rows, key columns): CUDA graphs replay it (blend.graphs), one graph per
(batch bucket, key-column bucket, sampling or not). Key columns: the longest row's length rounded up
(`DecodeStepper.key_columns`), so a step reads few masked keys.

Measured on the CPU (SmolLM2 shape, 2.5k-token rows, 2 busy cores, one layer's attention): one masked
sdpa call over all rows, the query heads of a KV head folded into the query length, cost 14 ms for 8
rows vs 58 ms as 8 ragged per-row calls (8.7 vs 33 ms at 4 rows; equal at 1 row); FlexAttention needs
torch.compile, which this step does not use on the CPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from blend.cpu_kernels import decode_attention
from blend.decode import sample_rows
from blend.kernel_step import KernelStep
from blend.pool import KVPool

log = logging.getLogger("ragblend.blend")
KEY_BLOCK = 256  # key columns are a multiple of this (CPU) or a power of two at least this (CUDA)


def buckets(slots: int) -> list[int]:
    """Batch sizes a step is padded to: powers of two up to the pool's slot count (and it)."""
    sizes, n = [], 1
    while n < slots:
        sizes.append(n)
        n *= 2
    return sizes + [slots]


def bucket(rows: int, slots: int) -> int:
    return next(n for n in buckets(slots) if n >= rows)


@dataclass
class PooledKV:
    """One layer's K or V for the step's rows: a view [rows, H, columns, D] of the pool, with the mask
    `visible` [rows, 1, 1, columns] (True where a key is at or before the row's position) for sdpa, or
    each row's key count `lengths` [rows] (0 for a padding row) for the CPU kernel (blend.cpu_kernels)."""

    rows: torch.Tensor
    visible: torch.Tensor | None
    lengths: torch.Tensor | None = None


class PoolView:
    """The KV pool as the HF decoder layers' `cache` for one step."""

    def __init__(self, pool: KVPool, positions: torch.Tensor, key_columns: int, visible: torch.Tensor | None,
                 lengths: torch.Tensor | None):
        self.pool, self.positions, self.key_columns = pool, positions, key_columns
        self.visible, self.lengths = visible, lengths
        self.rows = torch.arange(positions.shape[0], device=positions.device)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states/value_states: [rows, H, 1, D], row b the new token of slot b at positions[b]
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]        # [slots, H, columns, D]
        keys[self.rows, :, self.positions] = key_states[:, :, 0]
        values[self.rows, :, self.positions] = value_states[:, :, 0]
        n, t = self.rows.shape[0], self.key_columns
        return (PooledKV(keys[:n, :, :t], self.visible, self.lengths),
                PooledKV(values[:n, :, :t], self.visible, self.lengths))


def pooled_attention_forward(module, query: torch.Tensor, key: PooledKV, value: PooledKV, attention_mask,
                             scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [rows, Hq, 1, D] over each row's visible keys → [rows, 1, Hq, D]. The Hq/Hkv query heads that
    share a KV head become that head's query rows, so K/V are read once, never repeated."""
    rows, hq, _, dim = query.shape
    hkv = key.rows.shape[1]
    grouped = query.view(rows, hkv, hq // hkv, dim)                                  # [rows, Hkv, G, D]
    if key.lengths is not None:
        out = decode_attention(grouped, key.rows, value.rows, key.lengths, scaling)
    else:
        out = F.scaled_dot_product_attention(grouped, key.rows, value.rows, attn_mask=key.visible, scale=scaling)
    # (reshape, not view: on CUDA, sdpa's memory-efficient kernel returns a non-contiguous output)
    return out.reshape(rows, 1, hq, dim), None                                      # head h·G + g, as HF's repeat_kv


class DecodeStepper:
    """The step itself, for a model and its pool (shapes fixed by the inputs and `key_columns`).
    `attention_kernel`: its attention through blend.cpu_kernels (a float32 model on the CPU), else sdpa; with
    it, Llama-shaped layers run as a blend.kernel_step.KernelStep (unless `use_kernel_step` is False) once a
    probe shows it gives the HF layers' logits bit for bit (`kernel_step_refusal` says why not, where not)."""

    def __init__(self, model, pool: KVPool, num_layers: int, attention_kernel: bool = False,
                 use_kernel_step: bool = True):
        self.model, self.decoder, self.pool, self.num_layers = model, model.model, pool, num_layers
        self.columns = torch.arange(pool.columns, device=pool.keys.device)
        self.attention_kernel = attention_kernel
        self.kernel_step: KernelStep | None = None
        self.kernel_step_refusal = None if attention_kernel else "the step's attention is not the CPU kernel"
        if attention_kernel and use_kernel_step:
            self.kernel_step_refusal = KernelStep.refusal(model)
            if self.kernel_step_refusal is None:
                step = KernelStep(model, num_layers)
                self.kernel_step_refusal = step.verify(pool, lambda probe: DecodeStepper(
                    model, probe, num_layers, attention_kernel=True, use_kernel_step=False).logits)
                self.kernel_step = step if self.kernel_step_refusal is None else None
            if self.kernel_step_refusal:
                log.info("decode steps run through the HF layers", extra={"reason": self.kernel_step_refusal})

    def key_columns(self, positions: list[int]) -> int:
        """The keys a step reads: the longest row's rounded up to a multiple of KEY_BLOCK on the CPU (less
        masked work), to a power of two on CUDA (few shapes, so few graphs); at most the pool's width. Eager
        and graphed steps read the same, so they give the same tokens."""
        needed = max(positions) + 1
        if self.pool.keys.device.type == "cpu":
            columns = -(-needed // KEY_BLOCK) * KEY_BLOCK
        else:
            columns = max(KEY_BLOCK, 1 << (needed - 1).bit_length())
        return min(self.pool.columns, columns)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, key_columns: int) -> torch.Tensor:
        """tokens, positions [rows] (int64, on the pool's device) → next-token logits [rows, V]."""
        if self.kernel_step is not None:
            return self.kernel_step.logits(self.pool, tokens, positions, key_columns)
        position_ids = positions[:, None]                                              # [rows, 1]
        hidden = self.decoder.embed_tokens(tokens[:, None])                            # [rows, 1, hidden]
        position_embeddings = self.decoder.rotary_emb(hidden, position_ids=position_ids)
        if self.attention_kernel:  # each row's own keys; none for a padding row (at the scratch column)
            visible, lengths = None, self.pool.row_lengths(positions)                   # [rows]
        else:
            visible, lengths = (self.columns[:key_columns][None, :] <= position_ids)[:, None, None, :], None
        cache = PoolView(self.pool, positions, key_columns, visible, lengths)              # visible: [rows, 1, 1, T]
        for layer in self.decoder.layers[: self.num_layers]:
            hidden = layer(hidden, attention_mask=None, position_ids=position_ids, cache=cache,
                           position_embeddings=position_embeddings)
        return self.model.lm_head(self.decoder.norm(hidden[:, -1]))                   # [rows, V]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
                 top_p: torch.Tensor, noise: torch.Tensor | None, key_columns: int) -> torch.Tensor:
        """One step → the rows' next tokens [rows] (int64, on the device)."""
        return sample_rows(self.logits(tokens, positions, key_columns), temperature, top_p, noise)
