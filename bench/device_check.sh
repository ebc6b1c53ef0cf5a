#!/usr/bin/env bash
# GPU check (issues #14, #25, #26, #27, #42), one call on a lent GPU machine. Parts, the most wanted numbers first,
# each under its own timeout (under 10 minutes in all; about 6 expected), each writing its JSON into $OUT as it goes:
#   decode   bench/decode.py --device cuda: the decode step (blend.batch.LayerStep, CUDA's one form) on a random
#            Llama-3-8B shape in bfloat16, 4k-token rows, batch 1/8/32, eager vs CUDA graphs (same tokens?), the
#            model's own forward at batch 1
#   prefill  bench/device_check.py: HF sdpa full prefill, and full prefill through the blend attention (sdpa's
#            causal square), vs reuse / blend (FlexAttention, compiled) at 4k and 16k tokens, KV resident, from
#            the memory and disk tiers (side-stream staging, pipelined and whole); synchronised phases; the
#            f32/bf16 exactness table; the gate's verdict; DecodeRuntime.step graphed at batch 1 and 32
#   tests    the blend tests with RAGBLEND_TEST_DEVICE=cuda (every tests/blend file but the SmolLM2 ones: no model
#            hub there): the decode pool's, the device seam's and the pooled attention's against the model's own
#            forward (windows, softcapping, a model the gate refused: test_gate.py) first
#   store    bench/store.py --device cuda: the tiers on the device (gpu / pinned memory / disk / int8)
#   codecs   bench/device_check.py --only codecs: every store codec (fp16, int8, int4, cachegen...) encoded on the
#            host, read from disk onto the device as a loader reads it, each layer within the codec's bound; decode MB/s
# Where there is no GPU it says so and exits 0.
#
# Usage: bench/device_check.sh [PARTS]    PARTS: a comma-separated subset, e.g. decode,prefill (default: all five)
#   PYTHON=... picks the interpreter (the repo's venv by default, else python3).
# The GPU image has an older transformers than requirements.txt pins (its layers take `past_key_values`, not
# `cache=`: every cache would be dropped silently) and none of the store's packages. So, here, first run
# bench/gpu_wheels.sh (wheels into .whl/, git-ignored) and make the device call carry [".whl"]:
#   run(command="bash bench/device_check.sh", carry=[".whl"], timeout_s=480)
# The wheels in .whl/ are installed into a scratch folder put first on PYTHONPATH; a transformers that is not
# the pinned one stops the check (exit 3) before anything is timed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${OUT:-$(mktemp -d)}"
PARTS=",${1:-decode,prefill,tests,store,codecs},"
want() { [[ "$PARTS" == *",$1,"* ]]; }

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo '{"gpu": false, "message": "no CUDA GPU here (torch.cuda.is_available() is False): nothing to check"}'
    exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "error: could not install the carried wheels in .whl/" >&2; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
pinned="$(sed -n 's/^transformers==//p' requirements.txt)"
found="$("$PY" -c 'import transformers; print(transformers.__version__)' 2>/dev/null)"
if [ "$found" != "$pinned" ]; then
    echo "error: transformers ${found:-missing} here, the project pins $pinned (bench/gpu_wheels.sh; carry .whl)" >&2
    exit 3
fi
"$PY" -c 'import store' 2>/dev/null || echo "note: \`store\` does not import here: its cases are skipped" >&2
export PYTHONUNBUFFERED=1

if want decode; then
    echo "decode on CUDA..." >&2
    timeout 150 "$PY" bench/decode.py --device cuda --out "$OUT/decode_cuda.json" > /dev/null
fi
if want prefill; then
    echo "prefill on CUDA..." >&2
    # (its log, with torch.compile's recompiles of FlexAttention: one per new prompt shape would be too many)
    TORCH_LOGS=recompiles timeout 190 "$PY" bench/device_check.py --out "$OUT" --tokens 4096,16384 --repeats 2 \
        --decode-batches 1,32 2> "$OUT/prefill_log.txt"
    echo "prefill: exit $?; $(grep -c -i recompil "$OUT/prefill_log.txt") log lines on recompiles" >&2
fi
if want tests; then
    cuda_tests() {  # cuda_tests SECONDS NAME PYTEST-ARGS...: the output in $OUT/NAME.txt
        RAGBLEND_TEST_DEVICE=cuda timeout "$1" "$PY" -m pytest -q -rfE -p no:cacheprovider \
            --continue-on-collection-errors "${@:3}" > "$OUT/$2.txt" 2>&1
        echo "$2: exit $?; $(tail -1 "$OUT/$2.txt")" >&2
    }
    echo "blend tests on CUDA..." >&2
    first=(tests/blend/test_batch_decode.py tests/blend/test_device.py tests/blend/test_backend.py
           tests/blend/test_gate.py)  # the decode pool's, the device seam's, the pooled attention's
    cuda_tests 60 blend_tests_first "${first[@]}"
    cuda_tests 45 blend_tests tests/blend "${first[@]/#/--ignore=}" --ignore=tests/blend/test_smollm.py \
        --ignore=tests/blend/test_selection_smollm.py --ignore=tests/blend/test_device_check.py
fi
if want store; then
    echo "store tiers on CUDA..." >&2
    timeout 30 "$PY" bench/store.py --device cuda --tokens 512 --chunks 8 --repeats 3 > "$OUT/store_cuda.json"
fi
if want codecs; then
    echo "codecs on CUDA..." >&2
    timeout 90 "$PY" bench/device_check.py --only codecs --codec-tokens 256 --repeats 3 --out "$OUT/codecs" \
        > "$OUT/codecs.txt" 2>&1
    echo "codecs: exit $?; $(grep -c 'within bound: True' "$OUT/codecs.txt") codecs within their bound" >&2
fi
[ -s "$OUT/decode_cuda.json" ] && tail -c 2500 "$OUT/decode_cuda.json"
echo "JSON in $OUT: $(ls "$OUT" | tr '\n' ' ')" >&2
