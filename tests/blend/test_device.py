"""model.device / model.dtype: auto resolution, clear errors, and the blend path on the model's device."""
from __future__ import annotations

import pytest
import torch

from blend import Blender
from blend.model import resolve_device, resolve_dtype
from tests.blend.conftest import TEST_DEVICE, random_ids, tiny_model

NO_CUDA = not torch.cuda.is_available()


def test_auto_picks_cuda_only_where_there_is_one():
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


@pytest.mark.parametrize("bad", ["tpu", "gpu", "cuda:x", "mps"])
def test_an_unknown_device_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="model.device must be"):
        resolve_device(bad)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_asking_for_a_missing_gpu_is_a_clear_error_not_a_cpu_run():
    with pytest.raises(ValueError, match="0 CUDA device"):
        resolve_device("cuda:0")


def test_the_blend_path_keeps_its_tensors_on_the_model_device():
    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama")
    assert blender.device.type == TEST_DEVICE.type
    head = blender.precompute(random_ids(5, 1))
    chunk = blender.precompute(random_ids(20, 2), random_ids(5, 1), context=head)
    for selection in ("query", "hkvd"):
        result = blender.prefill([head, chunk], random_ids(4, 3), 0.3, selection=selection, pipeline=True)
        assert result.cache.layers[0].keys.device.type == TEST_DEVICE.type
        # what leaves the blender for sampling and stats is on the host, whatever the device
        assert result.logits.device.type == "cpu" and result.selected.device.type == "cpu"
