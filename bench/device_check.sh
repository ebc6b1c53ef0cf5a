#!/usr/bin/env bash
# GPU readiness check (issue #14). Where a CUDA GPU is present: runs the blend tests that hold on any
# device with RAGBLEND_TEST_DEVICE=cuda, then prints JSON TTFTs (bench/device_check.py): full / reuse /
# blend@0.15, pipelined and not, KV from memory and disk, for SmolLM2 and a randomly initialised
# Llama-3-8B-shaped model in bfloat16, at 4k and 16k prompt tokens. Where there is none: says so, exits 0.
# Usage: bench/device_check.sh   (PYTHON=... to pick the interpreter; the repo's venv by default)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo '{"gpu": false, "message": "no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing to check"}'
    exit 0
fi

echo "blend tests on CUDA..." >&2
RAGBLEND_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    tests/blend/test_pipeline.py tests/blend/test_device.py >&2
tests_rc=$?
"$PY" bench/device_check.py --tests-rc "$tests_rc"
