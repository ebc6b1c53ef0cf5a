#!/usr/bin/env bash
# GPU check (issues #14, #25, #26, #27). Where a CUDA GPU is present: runs the blend tests with RAGBLEND_TEST_DEVICE=cuda
# (every tests/blend file but the SmolLM2 ones: no model hub on a GPU machine), then bench/device_check.py
# (HF sdpa full prefill vs reuse / blend on a random Llama-3-8B-shaped model in bfloat16; exactness; the gate;
# decode), JSON into $OUT (or a temp folder), a short table last. Where there is none: says so, exits 0.
# Usage: bench/device_check.sh   (PYTHON=... picks the interpreter; the repo's venv by default)
# A GPU machine with torch but not this project's other packages: the blend tests and the check need only
# torch + transformers; the store's tier cases also need numpy, pydantic, diskcache and redis (wheels
# installed with `pip install --target DIR`, DIR on PYTHONPATH, as shared/gpu/README.md says) and are
# skipped, with the reason in the JSON, where `store` does not import.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${OUT:-$(mktemp -d)}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo '{"gpu": false, "message": "no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing to check"}'
    exit 0
fi

echo "blend tests on CUDA..." >&2
RAGBLEND_TEST_DEVICE=cuda timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/blend \
    --ignore=tests/blend/test_smollm.py --ignore=tests/blend/test_selection_smollm.py \
    --ignore=tests/blend/test_device_check.py > "$OUT/blend_tests.txt" 2>&1
tests_rc=$?
tail -3 "$OUT/blend_tests.txt" >&2
"$PY" bench/device_check.py --out "$OUT" --tests-rc "$tests_rc"
# The store tiers on the device (gpu / pinned memory / disk / int8: read + verify + decode, GB/s) and the pooled
# decode step (eager vs CUDA graphs at batch 1/8/32, tokens compared, the model's own forward at batch 1).
echo "store tiers on CUDA..." >&2
timeout 120 "$PY" bench/store.py --device cuda --tokens 512 --chunks 8 --repeats 3 > "$OUT/store_cuda.json"
echo "decode on CUDA..." >&2
timeout 150 "$PY" bench/decode.py --device cuda > "$OUT/decode_cuda.json"
tail -c 2000 "$OUT/decode_cuda.json"
