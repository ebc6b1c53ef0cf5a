"""The start-up gate judges the blend loop against the model's own rounding in its dtype: the real loop is
accepted in float32 and bfloat16, deliberately broken loops are refused, and the decision is a pure function."""
from __future__ import annotations

import pytest
import torch

from blend import BLEND_ATTENTION, Blender
from blend.backend import Backend, CudaBackend
from blend.gate import judge
from blend.rope import RopeShifter
from tests.blend.conftest import ARCHS, tiny_model

DTYPES = [torch.float32, torch.bfloat16]


def blender_in(arch: str, dtype: torch.dtype) -> Blender:
    return Blender(tiny_model(arch).to(dtype), tokenizer=None, fingerprint=f"tiny-{arch}-{dtype}")


def test_the_issues_numbers():
    # bfloat16 on an H200: blend@1 0.196 from the model, whose own one-vs-two-pieces spread was 0.227
    assert judge(0.196, 0.227, True, torch.bfloat16)
    # the same error against float32's spread (1.6e-4) is a loop that computes something else
    assert not judge(0.196, 2e-4, True, torch.bfloat16)
    assert not judge(0.196, 2e-4, True, torch.float32)
    assert not judge(0.01, 0.227, False, torch.bfloat16)   # within the spread, but another top token
    # float32 spreads of ~0: a few rounding steps of the logits' size are still rounding
    assert judge(3e-7, 0.0, True, torch.float32, scale=1.5)
    assert not judge(1e-4, 0.0, True, torch.float32, scale=1.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_real_loop_is_accepted(arch, dtype):
    blender = blender_in(arch, dtype)
    assert blender.unsupported is None
    assert blender.model.config._attn_implementation == BLEND_ATTENTION


def shifted_too_far(monkeypatch):
    rotation = RopeShifter.rotation
    # every moved chunk lands 5 positions past its place (the exact prefix, not moved, stays right)
    monkeypatch.setattr(RopeShifter, "rotation",
                        lambda self, deltas, dtype: rotation(self, deltas + 5 * (deltas != 0), dtype))


def layer_skipped(monkeypatch):
    layers = Blender._layers

    def skipping(self, hidden, run, cache, start, stop, probe=None):
        if start <= 1 < stop:  # layer 1 never runs
            hidden = yield from layers(self, hidden, run, cache, start, 1, probe)
            return (yield from layers(self, hidden, run, cache, 2, stop, probe))
        return (yield from layers(self, hidden, run, cache, start, stop, probe))
    monkeypatch.setattr(Blender, "_layers", skipping)


class ScaledPlan:
    """A backend's plan whose attention scale is 1.5x too large."""

    def __init__(self, plan):
        self.plan, self.num_keys = plan, plan.num_keys

    def attend(self, query, key, value, scale=None):
        return self.plan.attend(query, key, value, scale * 1.5)


def wrong_scale(monkeypatch):
    """Every backend's prefill attention: the CPU kernel, the planned pieces, FlexAttention."""
    for backend in (Backend, CudaBackend):
        monkeypatch.setattr(backend, "plan", lambda self, *args, plan=backend.plan, **options:
                            ScaledPlan(plan(self, *args, **options)))


BROKEN = {"keys shifted 5 positions too far": (shifted_too_far, "RoPE shift"),
          "a layer skipped": (layer_skipped, "blend loop"),
          "attention scale 1.5x": (wrong_scale, "blend loop")}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("broken", sorted(BROKEN))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_broken_loop_is_refused_and_says_why(arch, broken, dtype, monkeypatch):
    breaks, part = BROKEN[broken]
    breaks(monkeypatch)
    blender = blender_in(arch, dtype)
    assert blender.unsupported is not None and part in blender.unsupported
    assert str(dtype) in blender.unsupported and "spread" in blender.unsupported
    assert blender.model.config._attn_implementation != BLEND_ATTENTION  # the model keeps its own attention
