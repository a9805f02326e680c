#!/usr/bin/env bash
# The GPU checks and measurements of a GPU machine (a remote device session, or your own), the
# parts chosen by argument and run in that order; everything they write goes under $OUT.
#
#   bash scripts/gpu_check.sh [PART ...]        # no part: tests memcheck ffn ffn_train
#
# Kernels (the CUDA extension is built in the background when a part needs it):
#   tests         pytest -m gpu on $TESTS (default the kernel tests; e.g. tests/model/test_model_gpu.py
#                 for the model-level ones), at most $TEST_TIMEOUT s (default: no limit)
#   memcheck      compute-sanitizer memcheck of small FFN cases (python -m benchmarks.sanitize_ffn)
#   racecheck     the same cases under compute-sanitizer racecheck (shared-memory hazards; slow)
#   ab            this tree against BEFORE (a directory holding another commit's sparse_llm, kernels,
#                 benchmarks, configs, scripts, tests and pyproject.toml, e.g. from `git archive REV ... |
#                 tar -x -C .before`, carried to the machine), alternating in one call: the FFN training op
#                 (benchmarks.ffn --train at 15, 30, 60 non-zeros, M 16384) twice each, then a whole run
#                 of AB_STEPS steps (default 200, auto) each; ab_<side>_* files
#   ffn           python -m benchmarks.ffn (the inference forward), with $BENCH_ARGS
#   ffn_train     python -m benchmarks.ffn --train (forward+backward with L1), with $TRAIN_BENCH_ARGS
# The whole run, the figure of record (python -m benchmarks.whole_run: the trainer from
# initialisation to L0 30, 800 steps), then what fits in the rest of the call:
#   whole_run     one run per $IMPL (dense | auto | hot, default auto; several: one run each; hot: auto with
#                 the hot units, model.ffn_hot_share=$HOT_SHARE (default 0.01), named ..._hot) with SEED
#                 (train.seed, default 0), PRESET (default 1b), GPUS (processes, one GPU each; over 1:
#                 FSDP2, default 1); SIDE_BY_SIDE=1 runs the one-GPU IMPLs at the same time, one per GPU.
#                 An impl named again runs again, named whole_run_<impl>..._run<N>; with dense twice (e.g.
#                 IMPL="dense dense auto"), each other impl's pair is joined with the second dense run as
#                 its A/A pair (same seed and data): $OUT/run_aa_<impl>.md.
#                 MEMORY_RANGES (e.g. "2:3 30:33"): first a 40-step run of MEMORY_IMPL (default auto)
#                 writing the blocks alive at the peak of each step range (benchmarks.memory_peak).
#                 PROFILE_STEPS (e.g. 385:387): every run profiles those steps on every rank
#                 (benchmarks.step_profile: compute, exposed communication, idle) into
#                 $OUT/profile_<run>; it slows them (their log window at ~40% of its speed: inside the
#                 steady phase, 3-4% off its tokens/s). On one GPU profile just before the steady phase
#                 (385:387 of 800 steps, the last 400 steady) and the steady figures stand, but not quite
#                 the wall clock: the profiled steps still run slowed (until 8b460dc the report was also
#                 written inside the run: its window took `auto` 3.4-7.1 s more than its neighbours' pace,
#                 dense 1.6-2.0 s), so leave PROFILE_STEPS off a pair whose wall clock is the figure. On a
#                 run bound by its host every step after them slows too (12% on 4 GPUs: profile the
#                 run's last steps, e.g. 783:785), so such runs' tokens/s are not figures of record.
#                 OBJECT_STEPS (e.g. 100:380): the Python objects the run made between those steps, by
#                 type (benchmarks.object_growth) into $OUT/objects_<run>. RUN_OVERRIDES: Hydra
#                 overrides for every run (e.g. "train.fsdp_prefetch=2"). LAUNCH_ARGS: accelerate launch
#                 arguments for every multi-GPU run (e.g. "--fsdp_reshard_after_forward=false").
#                 On the last run's final weights: LAYER_FFN=1 (benchmarks.layer_ffn), DENSE_UNITS=1
#                 (benchmarks.dense_units: the backward's dense-unit threshold swept layer by layer), MODEL_STEP=1
#                 (benchmarks.model_step: the trainer's step, dense against cuda), PAPER_BATCH=1
#                 (benchmarks.model_step with 64 micro-batches of 8 a step: the paper's 512 x 2048 tokens).
#   early         the first EARLY_STEPS (default 60; 20 more than a multiple of 20) steps of one run per
#                 $IMPL (default auto), logged every step, then benchmarks.step_times on its metrics: each
#                 step's seconds, the slow ones by cause (a graph compiled, a record overflowed);
#                 early_steps_<impl>.md / .json / _metrics.jsonl
# Two GPUs of one host (docs/multi_gpu.md), stopped by $DEADLINE; results in $OUT/multi_results.tar.gz:
#   ddp_match     100M, same global batch: 1 GPU against 2-GPU DDP, plus the 1-GPU run at micro-batch 4
#                 (the noise floor); per-step losses compared. MATCH_STEPS, MATCH_FP32=1 (an fp32 pair too)
#   fsdp_resume   FSDP2 on 1b: checkpoint every FSDP_CKPT steps, SIGKILL after step FSDP_KILL_AFTER,
#                 resume=auto, resumed losses against those logged before the kill; the export checked.
#                 FSDP_STEPS, FSDP_COMPILE, FSDP_REFERENCE=1 (an uninterrupted run too), FSDP_KERNELS=1
#                 (the kernels and the per-layer L1 controller; the crash also resumed in one process)
#   scaling       1b compiled bf16, 8 x 2048 tokens a GPU: 1 GPU, DDP and FSDP2 tokens/s. SCALE_STEPS,
#                 SCALE_SKIP (warm-up windows dropped), SCALING_FSDP=0, SCALE_EXTRA (overrides of every
#                 scaling run), SCALE_BASELINE_EXTRA (a 1-GPU A/B run with these on the second GPU)
#   cuda_ffn      the ddp_match runs with model.ffn_impl=cuda under DDP and FSDP2, each against dense
# The trainer on one GPU (each run's metrics, config and plots come back as run_<name>.tar.gz):
#   bench1b       dense 1b, 8 x 2048 tokens a step, compiled bf16: tokens/s, MFU, peak memory
#   relu_dense swiglu_dense target target_reinit
#                 the 100M recipe table (benchmarks/results/recipe_100m_h200.md) on the machine's Python
#                 sources: ReLU and SwiGLU FFNs at L1 0, the L1 controller at 99.5% sparsity from
#                 SPARSITY_L1 (default 3e-4), and with dead-unit reinit; SPARSITY_LR (6e-4), SPARSITY_STEPS (1000)
#
# Env for all: OUT (default gpu_check_out), PYTHON (default python3), EXTRA (Hydra overrides appended
# to every trainer run of the two-GPU parts, e.g. EXTRA="model=tiny train.seq_len=64
# train.compile=false" for a smoke test on CPU), WORK (their scratch, default /tmp/multi), WHEELS
# (scripts/device_env.sh), GIT_COMMIT (recorded where git is absent).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh || exit 1
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
DEADLINE=${DEADLINE:-100000}
# The extension's build lives under build/: a warm machine keeps it between calls.
export SPARSE_LLM_CACHE=$PWD/build/extensions
# NVLink multicast stays off: it can take the host's shared GPUs down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TOKENIZERS_PARALLELISM=false
status=0

step() { echo "== $1 ($(date -u +%H:%M:%S))"; }
left() { echo $((DEADLINE - ($(date +%s) - START))); }
fits() {  # seconds a run needs, its name: false (and a note) when the deadline leaves less
  if [ "$(left)" -lt "$1" ]; then
    echo "SKIP: $2 needs ~$1 s, $(left) s left" | tee -a "$OUT/skipped.log"
    return 1
  fi
}
wait_build() {  # the background build's exit status (waited for once); its log's tail if it failed
  if [ -n "${BUILD_PID:-}" ]; then
    wait "$BUILD_PID"
    BUILD_RC=$?
    BUILD_PID=
    echo "   extension build: rc $BUILD_RC, $(tail -n 1 "$OUT/build.log")"
    [ "$BUILD_RC" = 0 ] || tail -n 30 "$OUT/build.log"
  fi
  return "${BUILD_RC:-0}"
}
quiet() { grep -v -e Warning -e warn -e "it/s"; }  # a benchmark's output without the noise

# ---- kernels ------------------------------------------------------------------------------------
tests() {
  wait_build || return 1
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-0}" $PY -m pytest -m gpu -q -rfEs -p no:cacheprovider \
    ${TESTS:-tests/ops/ffn/test_inference_gpu.py tests/ops/ffn/test_training_gpu.py tests/ops/test_kv_cache_write_gpu.py} \
    >"$OUT/gpu_tests.log" 2>&1
  local rc=$?
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -n 15
  return $rc
}
sanitize() {  # tool: compute-sanitizer over benchmarks.sanitize_ffn's cases
  wait_build || return 1
  compute-sanitizer --tool "$1" --error-exitcode 9 $PY -m benchmarks.sanitize_ffn >"$OUT/sanitizer_$1.log" 2>&1
  local rc=$?
  grep -E "repeat|SUMMARY" "$OUT/sanitizer_$1.log" | tail -n 4
  return $rc
}
memcheck() { sanitize memcheck; }
racecheck() { sanitize racecheck; }
ffn() {
  wait_build || return 1
  # shellcheck disable=SC2086
  $PY -m benchmarks.ffn ${BENCH_ARGS:-} --json "$OUT/ffn_inference.json" --md "$OUT/ffn_inference.md" 2>&1 \
    | tee "$OUT/ffn_inference.log" | quiet | tail -n 20
}
ffn_train() {
  wait_build || return 1
  # shellcheck disable=SC2086
  $PY -m benchmarks.ffn --train ${TRAIN_BENCH_ARGS:-} --json "$OUT/ffn_train.json" --md "$OUT/ffn_train.md" \
    2>&1 | tee "$OUT/ffn_train.log" | quiet | tail -n 20
}

in_tree() {  # side (before | after), command...: the command run in that side's tree, with its build
  local dir=$PWD; [ "$1" = before ] && dir=$AB_BEFORE
  shift
  (cd "$dir" && SPARSE_LLM_CACHE=$dir/build/extensions "$@")
}
# A run directory of this script's own under /tmp, emptied first: a warm machine keeps /tmp between
# calls, and the trainer (rightly) refuses to start a fresh run in a directory that holds one.
scratch_run_dir() { rm -rf "$1" && echo "$1"; }

ab() {
  [ -d "${BEFORE:-}" ] || { echo "ab: BEFORE must name a directory with the other commit's tree"; return 2; }
  local rc=0 side i
  AB_BEFORE=$(cd "$BEFORE" && pwd)
  in_tree before $PY -m sparse_llm.ops.build >"$OUT/ab_build_before.log" 2>&1 \
    || { tail -n 20 "$OUT/ab_build_before.log"; return 1; }
  wait_build || return 1
  for i in 1 2; do
    for side in before after; do
      step "ab: ffn --train, $side ($i)"
      in_tree $side $PY -m benchmarks.ffn --train --nnz 15 30 60 --M 16384 --json "$OUT/ab_${side}_ffn_train_$i.json" \
        2>&1 | grep -E "^\| *16384" || rc=1
    done
  done
  for side in before after; do
    step "ab: whole run, auto, ${AB_STEPS:-200} steps, $side"
    in_tree $side $PY -m benchmarks.whole_run --impl auto --steps "${AB_STEPS:-200}" --steady-steps 100 \
      --out-dir "$OUT/ab_${side}_whole_run" --run-dir "$(scratch_run_dir "/tmp/ab_$side")" >"$OUT/ab_${side}_whole_run.log" 2>&1 || rc=1
    tail -n 1 "$OUT/ab_${side}_whole_run.log" | cut -c1-400
  done
  return $rc
}

# ---- the whole run ------------------------------------------------------------------------------
whole_run() {
  local rc=0 seed=${SEED:-0} preset=${PRESET:-1b} gpus=${GPUS:-1} gpu=0 impl name run visible suffix tag n launch_arg
  local -a names=()
  local -A runs=()  # the runs of each impl so far: a repeat is tagged run<N>
  # whole_run.py's run_name: the 1b preset, one GPU and seed 0 unmarked
  suffix=$([ "$preset" = 1b ] || echo "_$preset")$([ "$gpus" = 1 ] || echo "_${gpus}gpu")
  suffix=$suffix$([ "$seed" = 0 ] || echo "_seed$seed")
  IFS=, read -ra visible <<<"${CUDA_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7}"  # SIDE_BY_SIDE: one each, in order
  if [ "${IMPL:-auto}" != dense ] || [ -n "${MEMORY_RANGES:-}" ]; then wait_build || return 1; fi
  if [ -n "${MEMORY_RANGES:-}" ]; then
    step "memory peaks: ${MEMORY_IMPL:-auto}, steps $MEMORY_RANGES"
    local entries="" r
    for r in $MEMORY_RANGES; do
      entries="$entries${entries:+,}{_target_:benchmarks.memory_peak.MemoryPeak,first:${r%%:*},last:${r##*:},out:$OUT}"
    done
    $PY -m benchmarks.whole_run --impl "${MEMORY_IMPL:-auto}" --seed "$seed" --out-dir /tmp/memory_run --steps 40 \
      --steady-steps 20 --run-dir "$(scratch_run_dir /tmp/memory_run/run)" --override "callbacks=[$entries]" >"$OUT/memory_run.log" 2>&1 \
      || rc=1
    head -n 3 "$OUT"/memory_peak_steps_*.txt
  fi
  for impl in ${IMPL:-auto}; do
    runs[$impl]=$((${runs[$impl]:-0} + 1))
    tag=$([ "${runs[$impl]}" = 1 ] || echo "run${runs[$impl]}")
    local impl_arg=$impl
    if [ "$impl" = hot ]; then impl_arg=auto tag=hot$tag; fi
    step "whole run: $impl${tag:+ ($tag)}, preset $preset, $gpus GPU(s), seed $seed"
    name=whole_run_$impl_arg$suffix${tag:+_$tag}
    names+=("$name")
    run=($PY -m benchmarks.whole_run --impl "$impl_arg" --seed "$seed" --preset "$preset" --gpus "$gpus"
      --out-dir "$OUT" --run-dir "$(scratch_run_dir "/tmp/$name")" ${tag:+--tag "$tag"})
    [ "$impl" != hot ] || run+=(--override "model.ffn_hot_share=${HOT_SHARE:-0.01}")
    local callbacks="" override
    [ -z "${PROFILE_STEPS:-}" ] || callbacks="{_target_:benchmarks.step_profile.StepProfile,\
first:${PROFILE_STEPS%%:*},last:${PROFILE_STEPS##*:},out:$OUT/profile_$name}"
    [ -z "${OBJECT_STEPS:-}" ] || callbacks="$callbacks${callbacks:+,}{_target_:benchmarks.object_growth.ObjectGrowth,\
first:${OBJECT_STEPS%%:*},last:${OBJECT_STEPS##*:},out:$OUT/objects_$name}"
    [ -z "$callbacks" ] || run+=(--override "callbacks=[$callbacks]")
    for override in ${RUN_OVERRIDES:-}; do run+=(--override "$override"); done
    for launch_arg in ${LAUNCH_ARGS:-}; do run+=("--launch-arg=$launch_arg"); done
    if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
      CUDA_VISIBLE_DEVICES=${visible[$gpu]} "${run[@]}" >"$OUT/$name.log" 2>&1 &
      gpu=$((gpu + 1))
    else
      "${run[@]}" >"$OUT/$name.log" 2>&1 || rc=1
      quiet <"$OUT/$name.log" | tail -n 3
    fi
  done
  if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
    local job
    for job in $(jobs -p); do [ "$job" = "${BUILD_PID:-}" ] || wait "$job" || rc=1; done
    for n in "${names[@]}"; do tail -n 2 "$OUT/$n.log"; done
  fi
  if [ "${runs[dense]:-0}" -ge 2 ]; then
    for impl in "${!runs[@]}"; do
      [ "$impl" = dense ] && continue
      step "A/B beside A/A: dense against $impl, dense against dense"
      n=run_aa_$impl$suffix
      local b=whole_run_$impl$suffix
      [ "$impl" != hot ] || b=whole_run_auto${suffix}_hot
      $PY -m benchmarks.whole_run --join "$OUT/whole_run_dense$suffix.json" "$OUT/$b.json" \
        --aa "$OUT/whole_run_dense${suffix}_run2.json" --json "$OUT/$n.json" --md "$OUT/$n.md" >"$OUT/$n.log" 2>&1 \
        || rc=1
      grep "^A/A" "$OUT/$n.md"
    done
  fi
  local weights=/tmp/$name  # the last run's final weights
  if [ "${LAYER_FFN:-0}${DENSE_UNITS:-0}${MODEL_STEP:-0}${PAPER_BATCH:-0}" != 0000 ]; then wait_build || return 1; fi
  if [ "${LAYER_FFN:-0}" = 1 ]; then
    step "layer_ffn on the run's weights"
    $PY -m benchmarks.layer_ffn --model "$weights" --json "$OUT/layer_ffn.json" --md "$OUT/layer_ffn.md" 2>&1 \
      | quiet | tail -n 30 || rc=1
  fi
  if [ "${DENSE_UNITS:-0}" = 1 ]; then
    step "dense_units on the run's weights"
    $PY -m benchmarks.dense_units --model "$weights" --json "$OUT/dense_units.json" --md "$OUT/dense_units.md" 2>&1 \
      | quiet | tail -n 25 || rc=1
  fi
  if [ "${MODEL_STEP:-0}" = 1 ]; then
    step "model_step on the run's weights (the trainer's step, dense against cuda)"
    $PY -m benchmarks.model_step --model "$weights" --compile --steps 10 --warmup 3 \
      --json "$OUT/model_step.json" --md "$OUT/model_step.md" 2>&1 | quiet | tail -n 6 || rc=1
  fi
  if [ "${PAPER_BATCH:-0}" = 1 ]; then
    step "the paper's batch (64 x 8 x 2048 tokens a step) on the run's final weights"
    [ -d "$weights/export" ] && weights=$weights/export
    $PY -m benchmarks.model_step --model "$weights" --compile --accumulate 64 --steps 2 --warmup 0 \
      --json "$OUT/paper_batch.json" --md "$OUT/paper_batch.md" 2>&1 | quiet | tail -n 6 || rc=1
  fi
  return $rc
}

# ---- the trainer on one GPU ---------------------------------------------------------------------
TRAIN="$PY -m sparse_llm.train logger=none train.progress=false"
bench1b() {
  rm -rf /tmp/runs/bench_1b  # scratch: a rerun starts anew (the trainer refuses a run_dir in use)
  $TRAIN experiment=bench_1b run_dir=/tmp/runs/bench_1b train.max_steps=40 2>&1 | tail -n 5
  $PY scripts/summarize_run.py /tmp/runs/bench_1b --name train_1b_dense --out "$OUT" --skip 2
}
recipe_run() {  # run name, overrides...: a 100M run of the recipe table on the machine's Python sources
  local name=$1 runs=/tmp/runs lr=${SPARSITY_LR:-6e-4}  # 1.5e-3 kills a dense ReLU model's units
  shift
  name=${name}_lr$lr
  rm -rf "${runs:?}/$name"  # scratch: a rerun starts anew (the trainer refuses a run_dir in use)
  [ -f /tmp/corpus.jsonl ] || $PY scripts/make_python_corpus.py --out /tmp/corpus.jsonl --max-mb 600
  $TRAIN model=100m data=files "data.paths=[/tmp/corpus.jsonl]" data.val_fraction=0.01 train=gpu_bench \
    train.seq_len=1024 train.global_batch_size=64 train.micro_batch_size=64 train.lr="$lr" \
    train.warmup_steps=100 train.max_steps="${SPARSITY_STEPS:-1000}" train.log_every=25 train.eval_every=250 \
    train.eval_batches=8 sparsity.l1_warmup_end=200 sparsity.dead_window_tokens=1000000 run_dir=$runs/$name "$@" \
    2>&1 | tail -n 4
  # shellcheck disable=SC2046
  tar -czf "$OUT/run_$name.tar.gz" -C $runs "$name/metrics.jsonl" "$name/config.yaml" "$name/run_info.json" \
    $(cd $runs && ls "$name"/*.png "$name"/nnz_hist.json 2>/dev/null)
}
L1=${SPARSITY_L1:-3e-4}
REINIT="sparsity.reinit.enabled=true sparsity.reinit.every=100"
relu_dense() { recipe_run relu_dense sparsity.l1_coeff=0; }
swiglu_dense() { recipe_run swiglu_dense model.hidden_act=silu sparsity.l1_coeff=0; }
target() { recipe_run target sparsity=target sparsity.l1_coeff="$L1"; }
# shellcheck disable=SC2086
target_reinit() { recipe_run target_reinit sparsity=target sparsity.l1_coeff="$L1" $REINIT; }

source scripts/gpu_multi.sh  # ddp_match, fsdp_resume, scaling, cuda_ffn

early() {
  local rc=0 impl run_dir
  for impl in ${IMPL:-auto}; do
    [ "$impl" = dense ] || wait_build || return 1
    step "early steps: $impl, ${EARLY_STEPS:-60} steps logged every step"
    run_dir=$(scratch_run_dir "/tmp/early_$impl")
    $PY -m benchmarks.whole_run --impl "$impl" --steps "${EARLY_STEPS:-60}" --steady-steps 20 \
      --override train.log_every=1 --out-dir "$OUT/early_$impl" --run-dir "$run_dir" >"$OUT/early_$impl.log" 2>&1 || rc=1
    cp "$run_dir/metrics.jsonl" "$OUT/early_steps_${impl}_metrics.jsonl" || { rc=1; continue; }
    $PY -m benchmarks.step_times "$OUT/early_steps_${impl}_metrics.jsonl" --md "$OUT/early_steps_$impl.md" \
      --json "$OUT/early_steps_$impl.json" | head -n 12 || rc=1
  done
  return $rc
}

# ---- main ---------------------------------------------------------------------------------------
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(tests memcheck ffn ffn_train)
KERNEL_PARTS=" tests memcheck racecheck ffn ffn_train whole_run early cuda_ffn ab "
MULTI_PARTS=" ddp_match fsdp_resume scaling cuda_ffn "
build=0
for part in "${PARTS[@]}"; do
  case " $KERNEL_PARTS$MULTI_PARTS bench1b relu_dense swiglu_dense target target_reinit " in
    *" $part "*) ;;
    *) echo "unknown part $part (the parts: see the header of $0)"; exit 2 ;;
  esac
  [[ $KERNEL_PARTS == *" $part "* ]] && build=1
done
[ "${FSDP_KERNELS:-0}" = 1 ] && build=1
step "device"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  nvidia-smi topo -m
  nvcc --version | tail -n 1
  echo "commit ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"; } >"$OUT/device.log" 2>&1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', \
torch.cuda.device_count(), torch.cuda.is_available() and torch.cuda.get_device_name())" 2>&1 \
  | tee -a "$OUT/device.log" || exit 1
if [ $build = 1 ]; then  # CPU work: overlaps the parts that need no kernels, or none yet
  step "build (background)"
  $PY -m sparse_llm.ops.build >"$OUT/build.log" 2>&1 &
  BUILD_PID=$!
fi
for part in "${PARTS[@]}"; do
  step "$part ($(left) s left)"
  "$part" || { status=1; echo "   $part: failed"; }
  [[ $MULTI_PARTS == *" $part "* ]] && pack_multi
done
wait_build || status=1
step "done in $(($(date +%s) - START)) s, status $status"
ls -la "$OUT"
exit $status
