"""The decode KV pool: every decoding request's K/V in one preallocated tensor, at a static address.

    keys, values  [L, slots, H, columns, D]   columns ≥ max_len + 1, a multiple of 64
(a request in a slot is a blend.decode.Decoding: its slot, its length (cache_seqlens), its sampling)

A request's prompt cache is copied into a free slot once, after its prefill (the prefill works on its
own tensors); each decoded token is then one in-place write at the slot's length. Nothing grows, nothing
is reallocated, so a captured CUDA graph can keep reading the same addresses (nanochat's KVCache and
HF's StaticCache are the models). A finished or cancelled request releases its slot for the next.

The last column of every slot is scratch: the padding rows of a fixed-shape decode step (blend.batch)
write their K/V there, so they never touch a real position. Slots are handed out lowest first, so the
rows a step runs stay packed at the front of the pool.

A step reads every row's keys up to its key columns, the masked ones too, and a masked key still costs
0 × its value: those must be finite. Each slot keeps a watermark below which it is (the prompt copied in,
or zeros); a step raises it to the columns it reads (`readable`). So a slot is zeroed only as far as
requests reach, a block at a time, never whole (8k columns of SmolLM2 are 380 MB a slot: zeroing one at
first use took ~0.4 s of a request's first token on the CPU), and memory is touched only as it is used.
"""
from __future__ import annotations

import heapq

import torch

DEFAULT_POOL_TOKENS = 8192  # positions per slot unless configured (and at most the model's context)


class PoolFull(RuntimeError):
    """Every slot of the decode pool is taken."""


class PoolTooShort(ValueError):
    """A request would grow past the pool's max_len."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class KVPool:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str):
        if slots < 1 or max_len < 1:
            raise ValueError(f"a KV pool needs at least one slot and one position, got {slots} slots of {max_len}")
        self.slots, self.max_len = slots, max_len
        self.columns = _round_up(max_len + 1, 64)  # aligned rows for the GPU kernels; the last is scratch
        self.scratch = self.columns - 1
        shape = (num_layers, slots, kv_heads, self.columns, head_dim)
        # Untouched until used (see `readable`): a large pool costs memory only as it fills.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self._free = list(range(slots))  # a heap: the lowest free slot first
        self._finite = [0] * slots  # per slot: columns [0, this) hold finite K/V

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise PoolFull(f"all {self.slots} decode slots are in use")
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not in use")
        heapq.heappush(self._free, slot)

    def load(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy a prompt's cache into `slot`: per layer (keys, values) [1, H, T, D]; returns T."""
        length = layers[0][0].shape[2]
        if length > self.max_len:
            raise PoolTooShort(f"a prompt of {length} tokens does not fit the {self.max_len}-token decode pool")
        for i, (k, v) in enumerate(layers):
            self.keys[i, slot, :, :length].copy_(k[0])
            self.values[i, slot, :, :length].copy_(v[0])
        self._finite[slot] = max(self._finite[slot], length)
        return length

    def readable(self, rows: int, columns: int) -> None:
        """Make slots [0, rows) finite in columns [0, columns), as a step over them reads (masked keys
        included): each slot is zeroed from its watermark on, once; after that this is a few comparisons."""
        for slot in range(rows):
            start = self._finite[slot]
            if start < columns:
                self.keys[:, slot, :, start:columns].zero_()
                self.values[:, slot, :, start:columns].zero_()
                self._finite[slot] = columns

    def row_lengths(self, positions: torch.Tensor) -> torch.Tensor:
        """Each step row's key count once it has written at `positions` [rows]: position + 1, and 0 for a
        padding row (it writes at the scratch column and reads nothing)."""
        return torch.where(positions == self.scratch, 0, positions + 1)                # [rows]

    def slot_kv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one slot's K/V [L, H, max_len, D] (without the scratch column)."""
        return self.keys[:, slot, :, :self.max_len], self.values[:, slot, :, :self.max_len]
