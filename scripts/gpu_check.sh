#!/usr/bin/env bash
# One run on a GPU machine: build the extension, run the kernel GPU tests, a compute-sanitizer
# memcheck of small cases (benchmarks/sanitize_ffn.py), and the FFN benchmarks (benchmarks/ffn.py:
# inference forward; training forward+backward). Logs and results go to $OUT (default ./gpu_check_out).
# Env: TESTS (pytest paths, default the kernel test files), BENCH_ARGS / TRAIN_BENCH_ARGS (extra
# benchmarks/ffn.py arguments), SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_BENCH=1, SKIP_TRAIN_BENCH=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }

step "device"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1; } 2>&1 | tee "$OUT/build.log"

step "build"
if ! $PY -m sparse_llm.ops.build 2>&1 | tail -n 20 | tee -a "$OUT/build.log"; then
  echo "BUILD FAILED"; exit 1
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step "pytest -m gpu"
  # shellcheck disable=SC2086
  $PY -m pytest -m gpu -v -rfEs -s ${TESTS:-tests/ops/test_ops_cuda.py tests/ops/test_ops_train_cuda.py tests/model/test_kv_cache_gpu.py} 2>&1 \
    | tee "$OUT/gpu_tests.log" || status=1
fi

if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  step "compute-sanitizer memcheck"
  compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m benchmarks.sanitize_ffn 2>&1 \
    | tee "$OUT/sanitizer.log" || status=1
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  step "benchmark"
  # shellcheck disable=SC2086
  $PY -m benchmarks.ffn ${BENCH_ARGS:-} --json "$OUT/ffn_inference.json" --md "$OUT/ffn_inference.md" 2>&1 \
    | tee "$OUT/bench.log" || status=1
fi
if [ "${SKIP_TRAIN_BENCH:-0}" != 1 ]; then
  step "training benchmark"
  # shellcheck disable=SC2086
  $PY -m benchmarks.ffn --train ${TRAIN_BENCH_ARGS:-} --json "$OUT/ffn_train.json" --md "$OUT/ffn_train.md" \
    2>&1 | tee "$OUT/train_bench.log" || status=1
fi
step "done, status $status"
exit $status
