"""The device seam: everything the blend path does differently on each device, decided once, here.

Everything device-specific sits behind one small interface (nanochat's flash_attention.py and HF's
AttentionInterface are the models: pick the implementation once, call one signature everywhere); no other
module of blend, store, retrieval, common or app asks what device it runs on (blend/model.py resolves the
device the model loads on; tests/test_device_seam.py checks the rule):

    prepare(model, head_dim)              adapt the model's modules (CPU: SkinnyLinear, the C kernels)
    plan(positions, num_keys)            which keys each query sees, built once per set of queries;
                                          plan.attend(query, key, value, scale) -> [B, Tq, Hq, D] is
                                          their causal attention (blend.attention calls it per layer)
    stager()                              where the layer loader queues a layer's copies and shift,
                                          and how the prefill waits for it (CUDA: a side stream + events)
    empty(shape, dtype)                   a prompt's K/V buffer (host: recycled, blend.buffers; a GPU's
                                          caching allocator already reuses its memory)
    synchronize()                         wait for the device's queued work (a prefill phase's timing)
    decode_step(model)                    the one decode step form (CPU: blend.kernel_step.KernelStep where its
                                          probe passes, else blend.batch.LayerStep; CUDA: LayerStep)
    key_columns(needed, limit)            the key columns a decode step reads (rounded: few masked keys on the
                                          CPU, few shapes, so few graphs, on CUDA)
    step_graphs(setting)                  whether the decode step is captured as CUDA graphs (blend.graphs)
    placement                             where the KV lives, handed to the store (common.placement)

Shifting keys is the same few torch ops on every device (blend.rope.RopeShifter.place: every chunk of
a layer in one batched rotation), so it needs no backend of its own.

Backend (the CPU's): the C kernels of blend.cpu_kernels for a float32 model (a prefill's attention, a decode
step's attention and linears); else blend.attention's planned pieces (the CPU flash kernel on visible key
windows, merged by log-sum-exp) and SkinnyLinear's MKL form. CudaBackend: FlexAttention, compiled, with a
block mask built on the device from the query positions (no host synchronisation), and sdpa's flash kernel
for a causal square. Its plans run eagerly where the positions are on the host, which is how the tests check
them on the CPU.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from blend import cpu_kernels
from blend.attention import AttentionPlan
from blend.batch import LayerStep
from blend.buffers import BufferRecycler
from blend.graphs import StepGraphs
from blend.kernel_step import KernelStep
from blend.skinny import use_skinny_linears
from common.placement import Placement

if TYPE_CHECKING:
    from blend.pipeline import LayerSource

log = logging.getLogger("ragblend.blend")
FLEX_BLOCK = 128  # FlexAttention's default block: the block mask says which key blocks each query block sees
KEY_BLOCK = 256   # a decode step's key columns: a multiple of this (CPU) or a power of two at least this (CUDA)
DecodeForm = KernelStep | LayerStep


class Backend:
    """The CPU's pieces; CudaBackend overrides what a GPU does differently."""
    name = "cpu"
    kernels = False           # decode steps' linears and attention through blend.cpu_kernels (set by prepare)
    prefill_kernel = False    # and a prefill's attention through blend.cpu_kernels, where the head size suits it

    def __init__(self, device: torch.device, cpu_kernel: str = "auto"):
        self.device, self.cpu_kernel = device, cpu_kernel

    @property
    def placement(self) -> Placement:
        """The model's KV in host memory: plain host tensors, nothing pinned (that only helps copies to a GPU)."""
        return Placement(self.device)

    def prepare(self, model: nn.Module, head_dim: int) -> None:
        """The CPU kernels for a float32 model (cpu_kernel auto; built now, else the reason logged), and the
        linears in their faster form (blend.skinny: few rows through a kernel)."""
        dtype = next(model.parameters()).dtype
        self.kernels = self.cpu_kernel == "auto" and dtype == torch.float32 and cpu_kernels.load() is not None
        self.prefill_kernel = self.kernels and head_dim % cpu_kernels.PREFILL_DIM_MULTIPLE == 0
        use_skinny_linears(model, kernel=self.kernels)

    def plan(self, positions: torch.Tensor, num_keys: int | None = None) -> AttentionPlan | KernelPlan:
        """A plan for queries at `positions` ([Tq] sorted); `num_keys` (the last position + 1) is a hint
        a GPU backend uses instead of reading the positions back (the CPU reads them anyway)."""
        return KernelPlan(positions) if self.prefill_kernel else AttentionPlan.build(positions)

    def stager(self) -> Stager:
        return Stager()

    @cached_property
    def _host_buffers(self) -> BufferRecycler:
        return BufferRecycler()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # a fresh host buffer this large page-faults on first touch: recycled ones (blend.buffers)
        return self._host_buffers.empty(shape, dtype)

    def synchronize(self) -> None:
        pass  # the host's work is done when its call returns

    def decode_step(self, model: nn.Module) -> tuple[DecodeForm, str | None]:
        """The decode step, and why it is not the kernel step (None: it is): blend.kernel_step's where the CPU
        kernels run and its probe reproduces the model, else the model's layers (blend.batch.LayerStep)."""
        if not self.kernels:
            return LayerStep(model), "the CPU kernels are off, unavailable, or not for this dtype"
        step, reason = KernelStep.for_model(model)
        return step or LayerStep(model), reason

    def key_columns(self, needed: int, limit: int) -> int:
        """The key columns a decode step reads for rows of up to `needed` keys: a multiple of KEY_BLOCK (little
        masked work), at most `limit`. Eager and graphed steps read the same, so they give the same tokens."""
        return min(limit, -(-needed // KEY_BLOCK) * KEY_BLOCK)

    def step_graphs(self, setting: str) -> StepGraphs:
        """The decode step as CUDA graphs: never here (model.cuda_graphs: on is logged and runs eagerly)."""
        if setting == "on":
            log.warning("model.cuda_graphs: on needs CUDA; the decode step runs eagerly",
                        extra={"device": str(self.device)})
        return StepGraphs(enabled=False)


class Stager:
    """Host-synchronous staging: a layer is there once the loader has written it."""

    def overlaps(self, sources: Sequence[LayerSource]) -> bool:
        """Whether a loader thread beside the prefill hides loading: on the host only a read that waits on I/O
        (a byte tier's) gains; a copy of held tensors takes the cores the prefill computes on (a 4-token question
        pass ran 1.5-3x slower beside a loader copying memory-tier spans)."""
        return not all(source.resident for source in sources)

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

    def overlaps(self, sources: Sequence[LayerSource]) -> bool:
        return True  # the copies run on their own stream, beside the compute's

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

    def __init__(self, device: torch.device):
        super().__init__(device)
        # False only for the tests' twin on the host: the GPU's plans, eagerly, with host-synchronous staging
        self.on_gpu = device.type == "cuda"

    @property
    def placement(self) -> Placement:
        """The model's KV on the GPU; host copies bound for it pinned (copies then overlap compute); the device's
        free memory now (the store's gpu tier sizes itself from it)."""
        free = torch.cuda.mem_get_info(self.device)[0] if self.on_gpu else 0
        return Placement(self.device, on_host=not self.on_gpu, pin=self.on_gpu, device_free_bytes=free)

    def prepare(self, model: nn.Module, head_dim: int) -> None:
        pass  # F.linear is what a GPU wants for any row count

    @cached_property
    def _compiled_flex(self):
        from torch.nn.attention.flex_attention import flex_attention
        # the first call of a shape compiles (seconds); later shapes go dynamic
        return torch.compile(flex_attention)

    @property
    def _flex(self):
        """FlexAttention compiled on the GPU; eager on the host, where it computes the same thing slowly."""
        if self.on_gpu:
            return self._compiled_flex
        from torch.nn.attention.flex_attention import flex_attention
        return flex_attention

    def plan(self, positions: torch.Tensor, num_keys: int | None = None) -> FlexPlan:
        tq = positions.numel()
        if tq == 0:
            raise ValueError("an attention plan needs at least one query")
        if num_keys is None:   # a host read; the engine passes it
            num_keys = int(positions[-1]) + 1
        if tq == num_keys:  # sorted queries 0..n-1 over keys 0..n-1: a causal square, sdpa's flash kernel
            return FlexPlan(positions, num_keys, None, self._flex)
        return FlexPlan(positions, num_keys, flex_block_mask(positions, num_keys), self._flex)

    def stager(self) -> Stager:
        return StreamStager(self.device) if self.on_gpu else Stager()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def synchronize(self) -> None:
        if self.on_gpu:  # the compute stream: a phase's own work, not the loader's copies
            torch.cuda.current_stream(self.device).synchronize()

    def decode_step(self, model: nn.Module) -> tuple[DecodeForm, str | None]:
        return LayerStep(model), "the kernel step is the CPU's"

    def key_columns(self, needed: int, limit: int) -> int:
        """A power of two, at least KEY_BLOCK: few shapes, so few graphs; at most `limit`."""
        return min(limit, max(KEY_BLOCK, 1 << (needed - 1).bit_length()))

    def step_graphs(self, setting: str) -> StepGraphs:
        """The decode step as CUDA graphs unless model.cuda_graphs is off (a failed capture runs it eagerly)."""
        return StepGraphs(enabled=setting != "off" and self.on_gpu)


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
    CPU kernels of blend.cpu_kernels)."""
    if cpu_kernel not in ("auto", "off"):
        raise ValueError(f"cpu_kernel must be auto or off, got {cpu_kernel!r}")
    return CudaBackend(device) if device.type == "cuda" else Backend(device, cpu_kernel)
