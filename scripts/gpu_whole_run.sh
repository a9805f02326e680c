#!/usr/bin/env bash
# One whole training run on a GPU machine (benchmarks/whole_run.py: the trainer from initialisation
# to L0 30 on the 1b preset, 800 steps), then what fits in the rest of the call. The extension is
# built into build/extensions (kept on a warm machine between calls) while a dense run goes.
# Results under $OUT: whole_run_<impl>.json, the run's log, layer_ffn.* and gpu_tests.log.
# Env: IMPL (dense | auto, default auto), LAYER_FFN=1 (benchmarks/layer_ffn.py on the run's final
# weights), TESTS (pytest paths of GPU tests to run after; empty: none), TEST_TIMEOUT (s, default
# 240), MEMCHECK=1 (compute-sanitizer on benchmarks/sanitize_ffn.py), GIT_COMMIT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_whole_run_out}
IMPL=${IMPL:-auto}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
source scripts/device_env.sh || exit 1
export SPARSE_LLM_CACHE=$PWD/build/extensions
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }

step "device"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step "build (background)"
python3 -m sparse_llm.ops.build >"$OUT/build.log" 2>&1 &
build=$!
if [ "$IMPL" != dense ]; then wait $build || { tail -n 30 "$OUT/build.log"; exit 1; }; fi

step "whole run: $IMPL"
python3 -m benchmarks.whole_run --impl "$IMPL" --out-dir "$OUT" --run-dir "/tmp/whole_run_$IMPL" \
  >"$OUT/whole_run_$IMPL.log" 2>&1 || status=1
grep -v -e Warning -e warn "$OUT/whole_run_$IMPL.log" | tail -n 12
wait $build || { tail -n 30 "$OUT/build.log"; status=1; }

if [ "${LAYER_FFN:-0}" = 1 ]; then
  step "layer_ffn on the run's weights"
  python3 -m benchmarks.layer_ffn --model "/tmp/whole_run_$IMPL" --json "$OUT/layer_ffn.json" \
    --md "$OUT/layer_ffn.md" 2>&1 | grep -v Warning | tail -n 30 || status=1
fi
if [ -n "${TESTS:-}" ]; then
  step "pytest -m gpu"
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider $TESTS \
    >"$OUT/gpu_tests.log" 2>&1 || status=1
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -n 15
fi
if [ "${MEMCHECK:-0}" = 1 ]; then
  step "compute-sanitizer memcheck"
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_ffn.py \
    >"$OUT/sanitizer.log" 2>&1 || status=1
  tail -n 2 "$OUT/sanitizer.log"
fi
step "done, status $status"
exit $status
