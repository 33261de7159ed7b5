#!/usr/bin/env bash
# GPU check, run by hand on a CUDA machine (CI has no GPU). Stages, each time-boxed and logged
# to OUT_DIR/<stage>.log, so that one failing stage still leaves the others' results:
#   env     the device, torch and transformers versions;
#   parity  TP=1 greedy parity against transformers in float32 on CUDA, eager and compiled, torch and triton attention
#           (torch.compile pieces + CUDA graphs of decode batches on torch, whole-step decode
#           graphs on triton, whose replays it counts); and the triton forward, eager and
#           graphed, under torch.cuda.set_sync_debug_mode("error") (tests/gpu/test_sync_free.py);
#           the KV tiers' copy path and the FP8 KV cache on both backends;
#   step    `kvray bench step` in bf16 on a ~0.6B random checkpoint of Qwen3 shape: decode steps
#           at batch 1 and 64 and a 2,048-token prefill step, host and device ms, kernels per
#           step and the bandwidth roofline -- triton eager, triton with decode graphs, and the
#           torch backend with its piecewise graphs, one after the other;
#   profile tests/gpu/step_profile.py (not run by default): decode ms/step at batch 1-128 and
#           a prefill step, eager against compiled, and a torch.profiler table of each;
#   bench   `kvray bench throughput --compare --compile --attention-backend triton
#           --async-scheduling` in bf16 on the same checkpoint: kvray with decode graphs and
#           async scheduling, kvray eager, kvray synchronous, transformers generate and
#           generate_batch on one workload, with the bf16 matmul peak.
# Ray is not needed: the offline engine runs TP=1 in-process.
# Usage: bash tests/gpu/check.sh [OUT_DIR]   (PY: a Python with a CUDA build of torch;
#        default .venv/bin/python, else python3; KVRAY_GPU_STAGES: a subset of the stages,
#        e.g. "env profile"). A summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-/tmp/kvray-gpu}}
mkdir -p "$OUT"
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PROMPTS=${KVRAY_GPU_PROMPTS:-64}
MODEL=${KVRAY_GPU_MODEL:-random:qwen3-0.6b}
STAGES=" ${KVRAY_GPU_STAGES:-env parity step bench} "
SUMMARY=()

stage() {  # stage NAME LIMIT_S CMD...: runs CMD under a time limit, its output in NAME.log
    local name=$1 limit=$2 t0 rc
    shift 2
    [[ $STAGES == *" $name "* ]] || return 0
    echo "== $name (limit ${limit} s): $*"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    SUMMARY+=("$name: exit $rc after $(($(date +%s) - t0)) s")
}

stage env 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
    $PY -c 'import torch, transformers; assert torch.cuda.is_available(), \"no CUDA device\"; \
print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, \
torch.cuda.get_device_name(0))'"

# The repo's conftest starts Ray for the cluster tests; the parity test needs none of it.
XDIST=()
if $PY -c 'import xdist' 2>/dev/null; then XDIST=(-n 8); fi
stage parity 240 $PY -m pytest -q --noconftest -p no:cacheprovider "${XDIST[@]}" \
    tests/gpu/test_cuda_parity.py tests/gpu/test_sync_free.py tests/gpu/test_cuda_kv_tier.py \
    tests/gpu/test_cuda_fp8_kv.py \
    tests/workers/device/test_step_buffers.py \
    tests/workers/device/layers/test_sampler.py

STEP=(bench step --model "$MODEL" --dtype bfloat16 --batch-sizes 1,64 --context 512
    --prefill-tokens 2048 --steps 20)
# Each run on its own: one failing leaves the others' figures.
stage step 180 bash -c "rc=0; \
    echo '## triton, eager'; $PY -m cluster.cli.main ${STEP[*]} --attention-backend triton --no-compile || rc=1; \
    echo '## triton, decode graphs'; $PY -m cluster.cli.main ${STEP[*]} --attention-backend triton --compile || rc=1; \
    echo '## torch, piecewise graphs'; $PY -m cluster.cli.main ${STEP[*]} --attention-backend torch --compile || rc=1; \
    exit \$rc"

stage profile 200 $PY tests/gpu/step_profile.py --model "$MODEL" --out "$OUT"

stage bench 150 $PY -m cluster.cli.main bench throughput --model "$MODEL" \
    --dtype bfloat16 --compare --compile --attention-backend triton --async-scheduling \
    --num-prompts "$PROMPTS" \
    --output-len-range 16 128 --result-json "$OUT/bench.json"

echo
echo "== logs: $OUT"
[[ -f $OUT/env.log ]] && cat "$OUT/env.log"
echo "-- parity"
[[ -f $OUT/parity.log ]] && grep -E "passed|failed|skipped|rror|assert" "$OUT/parity.log" | tail -n 25
echo "-- step"
[[ -f $OUT/step.log ]] && grep -E "^(## |case|decode|prefill|kvray bench step)|Error" "$OUT/step.log"
echo "-- profile"
[[ -f $OUT/profile.log ]] && grep -v "it/s\]" "$OUT/profile.log" | tail -n 16
echo "-- bench"
[[ -f $OUT/bench.log ]] && grep -E "^(== |kvray|hf|ratio|backend|roofline|  )|compiled|matmul|start-up|ms/step|Error" \
    "$OUT/bench.log" | grep -v "it/s\]" | tail -n 45
echo
printf '%s\n' "${SUMMARY[@]}"
