#!/usr/bin/env bash
# The 1b training step (issue 5) in two runs on a GPU machine, each under 10 minutes. Run the
# second right after the first, on the same machine: it reads the sparsified weights the first
# left in $SPARSE_DIR (under /tmp). Results under $OUT.
#   PHASE=1  build; the GPU tests of the training path (alone on the GPU: beside the sparsify run
#            they run out of memory); sparsify the 1b preset (400 steps, L1 3e-3) into
#            $SPARSE_DIR; time dense vs cuda at micro-batch 8, with the blocks alive at the peak.
#   PHASE=2  time dense vs cuda at micro-batch 16 on the same weights; the loss alone
#            (benchmarks/loss.py: unfused, chunks in PyTorch, chunks with the kernel).
#   PHASE=3  A/B in one run: the step at micro-batch 8 of this tree, then of another commit's
#            tree on the same weights (AB_IMPLS, default cuda). Make that tree with
#            `git archive <commit> | tar -x -C ab_base` (ab_base in .git/info/exclude) and send it
#            to the GPU machine with this one. A tree from before benchmarks/ runs its
#            scripts/benchmark_model.py.
# Env: TESTS (pytest paths), SKIP_TESTS=1, SPARSE_DIR (default /tmp/sp), AB_BASE_DIR (default
# ab_base), AB_IMPLS (default cuda), GIT_COMMIT (recorded for this tree; AB_BASE_COMMIT for the other).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_train_1b_out}
SPARSE_DIR=${SPARSE_DIR:-/tmp/sp}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
source scripts/device_env.sh || exit 1
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }
bench() {  # output name, benchmarks/model_step.py arguments...
  local name=$1 script=benchmarks/model_step.py; shift
  [ -f "$script" ] || script=scripts/benchmark_model.py  # an A/B base tree from before benchmarks/
  python3 "$script" --compile "$@" --json "$OUT/$name.json" --md "$OUT/$name.md" 2>&1 \
    | grep -v -e Warning -e "it/s" | tail -n 8 || status=1
}

case "${PHASE:-1}" in
  1)
    step "build"
    python3 -m sparse_llm.ops.build >"$OUT/build.log" 2>&1 || { tail -n 30 "$OUT/build.log"; exit 1; }
    if [ "${SKIP_TESTS:-0}" != 1 ]; then
      step "pytest -m gpu"
      # shellcheck disable=SC2086
      python3 -m pytest -m gpu -q -rfEs ${TESTS:-tests/ops/test_activation_counts.py tests/model/test_loss.py \
        tests/ops/test_ops_train_block.py tests/ops/test_ops_train_cuda.py tests/model/test_model_gpu.py} \
        >"$OUT/gpu_tests.log" 2>&1 || status=1
      grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -n 12
    fi
    step "sparsify, micro-batch 8"
    rm -rf "$SPARSE_DIR" /tmp/memory_peak
    bench train_1b_mb8 --preset 1b --sparsify-steps 400 --sparsify-l1 3e-3 --sparsify-dir "$SPARSE_DIR" \
      --micro-batch 8 --memory-snapshot /tmp/memory_peak
    cp /tmp/memory_peak/*.txt "$OUT"/ 2>/dev/null
    ;;
  2)
    [ -d "$SPARSE_DIR" ] || { echo "no $SPARSE_DIR: run PHASE=1 first, on the same machine"; exit 1; }
    step "micro-batch 16"
    bench train_1b_mb16 --model "$SPARSE_DIR" --micro-batch 16
    step "loss"
    python3 -m benchmarks.loss --json "$OUT/loss.json" --md "$OUT/loss.md" 2>&1 | tail -n 8 || status=1
    ;;
  3)
    [ -d "$SPARSE_DIR" ] || { echo "no $SPARSE_DIR: run PHASE=1 first, on the same machine"; exit 1; }
    base=$(cd "${AB_BASE_DIR:-ab_base}" && pwd) || exit 1
    step "A/B: this tree"
    # shellcheck disable=SC2086
    bench ab_this --model "$SPARSE_DIR" --micro-batch 8 --impls ${AB_IMPLS:-cuda}
    step "A/B: $base"
    (cd "$base" && GIT_COMMIT=${AB_BASE_COMMIT:-unknown} PYTHONPATH="$base:$PYTHONPATH" bench ab_base \
      --model "$SPARSE_DIR" --micro-batch 8 --impls ${AB_IMPLS:-cuda}; exit $status) || status=1
    ;;
  *) echo "PHASE must be 1, 2 or 3"; exit 2 ;;
esac
step "done, status $status"
exit $status
