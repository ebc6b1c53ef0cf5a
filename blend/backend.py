"""The device seam: what the blend path does differently on each device, chosen once per Blender.

Everything device-specific in a blended prefill sits behind one small interface (nanochat's
flash_attention.py and HF's AttentionInterface are the models: pick the implementation once, call
one signature everywhere):

    prepare(model, head_dim)              adapt the model's modules (CPU: SkinnyLinear, the C kernels)
    plan(positions, num_keys)            which keys each query sees, built once per set of queries;
                                          plan.attend(query, key, value, scale) -> [B, Tq, Hq, D] is
                                          their causal attention (blend.attention calls it per layer)
    stager(device)                        where the layer loader queues a layer's copies and shift,
                                          and how the prefill waits for it (CUDA: a side stream + events)
    empty(shape, dtype, device)           a prompt's K/V buffer (host: recycled, blend.buffers; a GPU's
                                          caching allocator already reuses its memory)

Shifting keys is the same few torch ops on every device (blend.rope.RopeShifter.place: every chunk of
a layer in one batched rotation), so it needs no backend of its own.

CpuBackend: the C kernels of blend.cpu_kernels for a float32 model (a prefill's attention, a decode
step's attention and linears); else blend.attention's planned pieces (the CPU flash kernel on visible key
windows, merged by log-sum-exp) and SkinnyLinear's MKL form. CudaBackend: FlexAttention, compiled, with a
block mask built on the device from the query positions (no host synchronisation), and sdpa's flash kernel
for a causal square; its logic runs eagerly on the CPU too (`compile=False`), which is how the tests check it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.nn import functional as F

from blend import cpu_kernels
from blend.attention import AttentionPlan
from blend.buffers import BufferRecycler
from blend.skinny import use_skinny_linears

FLEX_BLOCK = 128  # FlexAttention's default block: the block mask says which key blocks each query block sees


class Backend:
    """The CPU's pieces; CudaBackend overrides what a GPU does differently."""
    name = "cpu"
    pin_host_memory = False   # pinned host pages only help copies to a GPU
    kernels = False           # decode steps' linears and attention through blend.cpu_kernels, prefills' linears
                              # through oneDNN (set by prepare)
    prefill_kernel = False    # and a prefill's attention through blend.cpu_kernels, where the head size suits it

    def __init__(self, cpu_kernel: str = "auto"):
        self.cpu_kernel = cpu_kernel

    def prepare(self, model: torch.nn.Module, head_dim: int) -> None:
        """The CPU kernels for a float32 model (cpu_kernel auto; built now, else the reason logged), and the
        linears in faster forms (blend.skinny: few rows through a kernel, many through oneDNN)."""
        dtype = next(model.parameters()).dtype
        self.kernels = self.cpu_kernel == "auto" and dtype == torch.float32 and cpu_kernels.load() is not None
        self.prefill_kernel = self.kernels and head_dim % cpu_kernels.PREFILL_DIM_MULTIPLE == 0
        use_skinny_linears(model, kernel=self.kernels)

    def plan(self, positions: torch.Tensor, num_keys: int | None = None) -> AttentionPlan | KernelPlan:
        """A plan for queries at `positions` ([Tq] sorted); `num_keys` (the last position + 1) is a hint
        a GPU backend uses instead of reading the positions back (the CPU reads them anyway)."""
        return KernelPlan(positions) if self.prefill_kernel else AttentionPlan.build(positions)

    def stager(self, device: torch.device) -> Stager:
        return Stager()

    @cached_property
    def _host_buffers(self) -> BufferRecycler:
        return BufferRecycler()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":  # a fresh host buffer this large page-faults on first touch (blend.buffers)
            return self._host_buffers.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=device)


class Stager:
    """Host-synchronous staging: a layer is there once the loader has written it."""

    def scope(self):
        return contextlib.nullcontext()

    def mark(self, layer: int) -> None:
        pass

    def wait(self, layer: int) -> None:
        pass


class StreamStager(Stager):
    """CUDA: the loader queues its copies on a side stream; the compute stream waits on each layer's event,
    so the host never blocks on a copy."""

    def __init__(self, device: torch.device):
        self.device, self.stream, self.ready = device, torch.cuda.Stream(device), []
        self.compute = torch.cuda.current_stream(device)

    def scope(self):
        # The loader's copies go into buffers and use rotations the compute stream made: wait for them first.
        self.stream.wait_stream(self.compute)
        return torch.cuda.stream(self.stream)

    def mark(self, layer: int) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        self.ready.append(event)

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready[layer])


@dataclass(frozen=True)
class FlexPlan:
    positions: torch.Tensor       # [Tq] absolute query positions (on the device)
    num_keys: int                 # keys the queries see: 0..num_keys-1
    block_mask: object | None     # FlexAttention BlockMask; None for a causal square (queries 0..num_keys-1)
    flex: object                  # flex_attention, compiled or not

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        # query: [B, Hq, Tq, D]; key/value: [B, Hkv, Tk, D] -> [B, Tq, Hq, D]
        gqa = query.shape[1] != key.shape[1]
        key, value = key[:, :, :self.num_keys], value[:, :, :self.num_keys]
        if self.block_mask is None:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            out = self.flex(query, key, value, block_mask=self.block_mask, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()


@dataclass(frozen=True)
class KernelPlan:
    """The CPU kernel's plan is the positions themselves: each query sees the keys at or before its own
    (blend.cpu_kernels.prefill_attention)."""
    positions: torch.Tensor       # [Tq] absolute query positions, strictly increasing

    @property
    def num_keys(self) -> int:
        return int(self.positions[-1]) + 1

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        return cpu_kernels.prefill_attention(query, key, value, self.positions, scale)   # [1, Tq, Hq, D]


class CudaBackend(Backend):
    name = "cuda"
    pin_host_memory = True

    def __init__(self, compile: bool = True):
        self.compile = compile

    def prepare(self, model: torch.nn.Module, head_dim: int) -> None:
        pass  # F.linear is what a GPU wants for any row count

    @cached_property
    def _flex(self):
        from torch.nn.attention.flex_attention import flex_attention
        # Compiled on the GPU (the first call of a shape compiles, seconds; later shapes go dynamic);
        # eager elsewhere, where it computes the same thing slowly (the tests' twin).
        return torch.compile(flex_attention) if self.compile else flex_attention

    def plan(self, positions: torch.Tensor, num_keys: int | None = None) -> FlexPlan:
        tq = positions.numel()
        if tq == 0:
            raise ValueError("an attention plan needs at least one query")
        if num_keys is None:   # a host read; the engine passes it
            num_keys = int(positions[-1]) + 1
        if tq == num_keys:  # sorted queries 0..n-1 over keys 0..n-1: a causal square, sdpa's flash kernel
            return FlexPlan(positions, num_keys, None, self._flex)
        return FlexPlan(positions, num_keys, flex_block_mask(positions, num_keys), self._flex)

    def stager(self, device: torch.device) -> Stager:
        return StreamStager(device) if device.type == "cuda" else Stager()


def flex_block_mask(positions: torch.Tensor, num_keys: int, block: int = FLEX_BLOCK):
    """BlockMask for sorted queries at `positions` seeing keys k <= position, built with tensor ops on the
    positions' device (no host read). Per block of `block` queries (positions p_min..p_max): key blocks
    wholly at or before p_min are fully visible; those up to p_max's block are partly visible (masked)."""
    from torch.nn.attention.flex_attention import BlockMask

    tq = positions.numel()
    q_blocks, k_blocks = -(-tq // block), -(-num_keys // block)
    padded = torch.cat([positions, positions[-1:].expand(q_blocks * block - tq)])  # [q_blocks * block]
    rows = padded.view(q_blocks, block)
    full = torch.div(rows[:, 0] + 1, block, rounding_mode="floor")                  # [q_blocks] fully visible
    last = torch.div(rows[:, -1], block, rounding_mode="floor")                     # last partly visible
    partial = (last - full + 1).clamp(min=0)
    blocks = torch.arange(k_blocks, device=positions.device)
    partial_index = (full[:, None] + blocks[None]).clamp(max=k_blocks - 1)           # [q_blocks, k_blocks]
    full_index = blocks[None].expand(q_blocks, k_blocks)

    def causal_by_position(b, h, q, k):
        return k <= padded[q]

    as_mask = lambda t: t.to(torch.int32)[None, None].contiguous()  # noqa: E731 - [1, 1, ...]
    return BlockMask.from_kv_blocks(as_mask(partial), as_mask(partial_index), as_mask(full), as_mask(full_index),
                                    BLOCK_SIZE=block, mask_mod=causal_by_position, seq_lengths=(tq, num_keys),
                                    compute_q_blocks=False)


def backend_for(device: torch.device, cpu_kernel: str = "auto") -> Backend:
    """The backend for a model on `device`: chosen once, when the Blender is built. cpu_kernel: auto | off (the
    CPU kernels of blend.cpu_kernels, and oneDNN for a prefill's linears)."""
    if cpu_kernel not in ("auto", "off"):
        raise ValueError(f"cpu_kernel must be auto or off, got {cpu_kernel!r}")
    return CudaBackend() if device.type == "cuda" else Backend(cpu_kernel)
