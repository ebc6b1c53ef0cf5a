"""Prompt-sized host buffers, reused from one prompt to the next (the CPU backend's allocator).

The C allocator hands blocks this large (a 6k-token SmolLM2 prompt's K/V is 2 x 287 MB) straight back to
the OS when they are freed, so every new prompt's buffer page-faults on first touch: about 150 ms at 2
threads, twice the copy and RoPE shift the buffer is allocated for. A recycler keeps a few buffers and
hands out a free one. A buffer is free when nothing but the recycler holds its storage: every view, alias
or cache over it holds a reference, so a buffer still in use is never handed out twice.
A GPU needs none of this: torch's caching allocator already reuses device memory.
"""
from __future__ import annotations

import math
import threading

import torch

KEEP_BUFFERS = 4     # retained buffers (in use or free); beyond that the oldest free one is let go
SIZE_STEPS = 16      # sizes round up to 1/16 of their power of two, so a slightly longer prompt still fits


def _uses(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _rounded(numel: int) -> int:
    step = max(1, (1 << max(numel - 1, 1).bit_length()) // SIZE_STEPS)
    return -(-numel // step) * step


class BufferRecycler:
    def __init__(self, keep: int = KEEP_BUFFERS):
        self.keep = keep
        self._buffers: list[tuple[torch.Tensor, int]] = []   # (flat buffer, its storage's use count when free)
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous host tensor of `shape` (its contents: whatever the last user left)."""
        numel = math.prod(shape)
        with self._lock:
            fits = [i for i, (flat, _) in enumerate(self._buffers)
                    if flat.dtype == dtype and flat.numel() >= numel and self._free(i)]
            if fits:
                # the smallest that fits; of equal ones the last used (its pages may still be in cache)
                entry = self._buffers.pop(min(reversed(fits), key=lambda i: self._buffers[i][0].numel()))
            else:
                self._trim()
                with torch.inference_mode(False):   # a normal tensor: writable in and out of inference mode
                    flat = torch.empty(_rounded(numel), dtype=dtype)
                entry = (flat, _uses(flat))
            self._buffers.append(entry)        # most recently used last
            return entry[0][:numel].view(shape)

    def _free(self, i: int) -> bool:
        flat, uses_when_free = self._buffers[i]
        return _uses(flat) <= uses_when_free

    def _trim(self) -> None:
        """Make room for one more: let go of the oldest free buffer, else of the oldest in use (its user keeps it)."""
        while len(self._buffers) >= self.keep:
            free = [i for i in range(len(self._buffers)) if self._free(i)]
            del self._buffers[free[0] if free else 0]

    @property
    def retained_bytes(self) -> int:
        with self._lock:
            return sum(flat.numel() * flat.element_size() for flat, _ in self._buffers)
