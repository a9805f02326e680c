#!/usr/bin/env bash
# One whole training run on a GPU machine (benchmarks/whole_run.py: the trainer from initialisation
# to L0 30 on the 1b preset, 800 steps), then what fits in the rest of the call. The extension is
# built into build/extensions (kept on a warm machine between calls) while a dense run goes.
# Results under $OUT: whole_run_<impl>.json, the run's log, layer_ffn.* and gpu_tests.log.
# Env: IMPL (dense | auto, default auto; several: one run each), SEED (train.seed, default 0),
# PRESET (model preset, default 1b), GPUS (processes, one GPU each; over 1: FSDP2, default 1),
# SIDE_BY_SIDE=1 (one-GPU runs: the IMPLs at the same time, one per GPU of the machine),
# PAPER_BATCH=1 (benchmarks/model_step.py with 64 micro-batches of 8 a step, train=paper's 512 x 2048
# tokens, dense against cuda on the last run's final weights),
# MEMORY_RANGES (e.g. "2:3 30:33": first a 40-step run of MEMORY_IMPL (default auto) that writes the blocks alive
# at the peak of each step range, benchmarks/memory_peak.py), LAYER_FFN=1 (benchmarks/layer_ffn.py on the run's final
# weights), MODEL_STEP=1 (benchmarks/model_step.py on them: the trainer's step on fixed weights), TESTS (pytest paths of GPU tests to run after; empty: none), TEST_TIMEOUT (s, default
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
if [ "$IMPL" != dense ] || [ -n "${MEMORY_RANGES:-}" ]; then wait $build || { tail -n 30 "$OUT/build.log"; exit 1; }; fi

SEED=${SEED:-0}
if [ -n "${MEMORY_RANGES:-}" ]; then
  step "memory peaks: ${MEMORY_IMPL:-auto}, steps $MEMORY_RANGES"
  entries=""
  for r in $MEMORY_RANGES; do
    entries="$entries${entries:+,}{_target_:benchmarks.memory_peak.MemoryPeak,first:${r%%:*},last:${r##*:},out:$OUT}"
  done
  python3 -m benchmarks.whole_run --impl "${MEMORY_IMPL:-auto}" --seed "$SEED" --out-dir /tmp/memory_run --steps 40 \
    --steady-steps 20 --run-dir /tmp/memory_run/run --override "callbacks=[$entries]" >"$OUT/memory_run.log" 2>&1 || status=1
  head -n 3 "$OUT"/memory_peak_steps_*.txt
fi
PRESET=${PRESET:-1b}
GPUS=${GPUS:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
gpu=0
for impl in $IMPL; do
  step "whole run: $impl, preset $PRESET, $GPUS GPU(s), seed $SEED"
  name=whole_run_$impl$([ "$PRESET" = 1b ] || echo "_$PRESET")$([ "$GPUS" = 1 ] || echo "_${GPUS}gpu")
  name=$name$([ "$SEED" = 0 ] || echo "_seed$SEED")
  run=(python3 -m benchmarks.whole_run --impl "$impl" --seed "$SEED" --preset "$PRESET" --gpus "$GPUS"
    --out-dir "$OUT" --run-dir "/tmp/$name")
  if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$gpu "${run[@]}" >"$OUT/$name.log" 2>&1 &
    gpu=$((gpu + 1))
  else
    "${run[@]}" >"$OUT/$name.log" 2>&1 || status=1
    grep -v -e Warning -e warn "$OUT/$name.log" | tail -n 3
  fi
done
if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
  for job in $(jobs -p); do [ "$job" = "$build" ] || wait "$job" || status=1; done
  for impl in $IMPL; do tail -n 2 "$OUT"/whole_run_"$impl"*.log; done
fi
wait $build || { tail -n 30 "$OUT/build.log"; status=1; }

if [ "${LAYER_FFN:-0}" = 1 ]; then
  step "layer_ffn on the run's weights"
  python3 -m benchmarks.layer_ffn --model "/tmp/$name" --json "$OUT/layer_ffn.json" \
    --md "$OUT/layer_ffn.md" 2>&1 | grep -v Warning | tail -n 30 || status=1
fi
if [ "${MODEL_STEP:-0}" = 1 ]; then
  step "model_step on the run's weights (the trainer's step, dense against cuda)"
  python3 -m benchmarks.model_step --model "/tmp/$name" --compile --steps 10 --warmup 3 \
    --json "$OUT/model_step.json" --md "$OUT/model_step.md" 2>&1 | grep -v Warning | tail -n 6 || status=1
fi
if [ "${PAPER_BATCH:-0}" = 1 ]; then
  step "the paper's batch (64 x 8 x 2048 tokens a step) on the run's final weights"
  weights=/tmp/$name; [ -d "$weights/export" ] && weights=$weights/export
  python3 -m benchmarks.model_step --model "$weights" --compile --accumulate 64 --steps 2 --warmup 0 \
    --json "$OUT/paper_batch.json" --md "$OUT/paper_batch.md" 2>&1 | grep -v Warning | tail -n 6 || status=1
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
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m benchmarks.sanitize_ffn \
    >"$OUT/sanitizer.log" 2>&1 || status=1
  tail -n 2 "$OUT/sanitizer.log"
fi
step "done, status $status"
exit $status
