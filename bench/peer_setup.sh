#!/usr/bin/env bash
# Installs the peer engine for bench/peer.py: llama-cpp-python from PyPI, compiled from source with CMake
# (several minutes on two cores). A bench-only extra: never in requirements.txt, never run by `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
"$PY" -m pip install --no-cache-dir "llama-cpp-python==$VERSION"
"$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
