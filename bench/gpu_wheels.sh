#!/usr/bin/env bash
# The wheels a GPU machine lacks for bench/device_check.sh, fetched here (where PyPI is reachable) into .whl/
# (git-ignored), at the versions this checkout's venv runs. The GPU image (python 3.12, torch, numpy, xxhash,
# huggingface-hub, tokenizers, safetensors) has an older transformers, whose layers take `past_key_values`,
# not the `cache=` this project passes (the cache would be dropped silently), and none of the store's
# packages. device_check.sh installs whatever lies in .whl/ into a scratch folder before it runs.
# Usage: bench/gpu_wheels.sh, then the device call carries [".whl"] (about 16 MB; the limit is 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=".venv/bin/pip"
WANTED="transformers pydantic pydantic_core pydantic-settings python-dotenv annotated-types typing-inspection
        typing_extensions redis diskcache constriction llguidance"
pins=()
for name in $WANTED; do
    pin=$("$PIP" freeze 2>/dev/null | grep -i "^${name//[-_]/[-_]}==" || true)
    [ -n "$pin" ] || { echo "error: $name is not installed in .venv (run make setup)" >&2; exit 1; }
    pins+=("$pin")
done
rm -rf .whl && mkdir -p .whl
platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$tag")
done
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "${pins[@]}"
ls .whl >&2
du -sh .whl >&2
