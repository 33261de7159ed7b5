#!/usr/bin/env bash
# GPU check, run by hand on a CUDA machine (CI has no GPU):
#   1. TP=1 greedy parity against transformers in float32 on CUDA (the parity tests, on cuda);
#   2. `kvray bench throughput` in bf16 on a ~0.6B random checkpoint of Qwen3 shape, vs hf;
#   3. the same, compiled (torch.compile + CUDA graphs of decode batches) side by side with
#      eager (`--compile` with --compare also runs kvray-eager); parity in 1. covers both.
# Usage: bash tests/gpu/check.sh [OUT_DIR]   (needs a venv with a CUDA build of torch)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-/tmp/kvray-gpu}}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
$PY - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print("cuda:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PYEOF
KVRAY_TEST_DEVICE=cuda $PY -m pytest -q -x tests/gpu/test_cuda_parity.py 2>&1 | tee "$OUT/parity.log"
$PY -m cluster.cli.main bench throughput --model random:qwen3-0.6b --dtype bfloat16 --compare \
    --num-prompts 256 --result-json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
$PY -m cluster.cli.main bench throughput --model random:qwen3-0.6b --dtype bfloat16 --compare \
    --compile --num-prompts 256 --result-json "$OUT/bench_compiled.json" 2>&1 \
    | tee "$OUT/bench_compiled.log"
