# The two-GPU parts of scripts/gpu_check.sh (ddp_match, fsdp_resume, scaling, cuda_ffn: what they
# run and their knobs are in its header), sourced by it after its helpers (PY, OUT, step, fits,
# left, wait_build). The runs go under $WORK; pack_multi gathers their metrics, configs and logs
# into $OUT/multi_results.tar.gz after each part.
WORK=${WORK:-/tmp/multi}
# The parts' runs are scratch: a rerun on the same machine starts them anew (the trainer refuses a
# run_dir that holds a run).
rm -rf "$WORK/runs"
mkdir -p "$WORK/runs" "$WORK/logs" "$WORK/results"
RUNS=$WORK/runs
COMMON="logger=none train.progress=false"
# The two GPUs of the parts: the first two of CUDA_VISIBLE_DEVICES, so that another job can hold
# the others of a larger machine (CUDA_VISIBLE_DEVICES=2,3 bash scripts/gpu_check.sh ...).
IFS=, read -r GPU_A GPU_B _ <<<"${CUDA_VISIBLE_DEVICES:-0,1}"
# $EXTRA (overrides appended to every run; the last value of a key wins) shrinks the runs for a
# smoke test on CPU, e.g. EXTRA="model=tiny train.seq_len=64 train.compile=false".
one() {  # overrides: a 1-process run
  echo $PY -m sparse_llm.train $COMMON "$@" ${EXTRA:-}
}
launch() {  # accelerate config name, then overrides: a 2-process accelerate launch on a fresh port
  local config=$1 port; shift
  port=$(($(cat "$WORK/port" 2>/dev/null || echo 29500) + 1))
  echo $port >"$WORK/port"  # (called in a subshell: the counter lives in a file)
  echo $PY -m accelerate.commands.launch --config_file "configs/accelerate/$config.yaml" --num_processes 2 \
    --main_process_port $port -m sparse_llm.train $COMMON "$@" ${EXTRA:-}
}

kill_tree() {  # pid: SIGKILL it and every process below it. Not a process-group kill: torch's
  # launcher starts each worker in a session of its own, so the workers would outlive their group.
  $PY - "$1" <<'EOF'
import sys
import psutil
try:
    root = psutil.Process(int(sys.argv[1]))
    procs = [*root.children(recursive=True), root]
except psutil.NoSuchProcess:
    sys.exit(0)
for proc in procs:
    try:
        proc.kill()
    except psutil.NoSuchProcess:
        pass
psutil.wait_procs(procs, timeout=60)
EOF
}

run_limited() {  # seconds, name, command...: the whole process tree is killed at the limit
  local secs=$1 name=$2; shift 2
  local log=$WORK/logs/$name.log cap=$(($(left) - 5))
  [ "$secs" -gt "$cap" ] && secs=$cap
  echo "== $name ($(date -u +%H:%M:%S), limit ${secs}s): $*" | tee -a "$WORK/logs/commands.log"
  "$@" >"$log" 2>&1 &
  local pid=$!
  (sleep "$secs"; echo "TIMEOUT after ${secs}s" >>"$log"; kill_tree "$pid") &
  local watchdog=$!
  wait "$pid"
  local rc=$?
  kill "$watchdog" 2>/dev/null
  wait "$watchdog" 2>/dev/null
  echo "   $name: rc $rc, $(tail -n 1 "$log")"
  [ "$rc" -ne 0 ] && tail -n 25 "$log"
  return $rc
}

pack_multi() {  # everything small the two-GPU parts produced, as one tarball under $OUT
  (cd "$WORK" && find runs -maxdepth 2 \( -name metrics.jsonl -o -name config.yaml -o -name run_info.json \) -print0 | tar -czf "$OUT/multi_results.tar.gz" --null -T - logs results)
}

# ---- the runs ---------------------------------------------------------------------------------
MATCH_STEPS=${MATCH_STEPS:-30}
# 100M model, 16 x 1024 tokens per step, L1 on (and dead-unit reinit, DDP) so the statistics'
# reduction over ranks is in the loss.
MATCH="model=100m train.seq_len=1024 train.global_batch_size=16 train.max_steps=$MATCH_STEPS train.lr=1e-3 \
train.warmup_steps=5 train.log_every=1 train.eval_every=10 train.eval_batches=4 train.checkpoint_every=0 \
train.export=false train.compile=false sparsity=paper sparsity.l1_coeff=3e-4 sparsity.l1_warmup_end=10"
REINIT="sparsity.reinit.enabled=true sparsity.reinit.every=10"

match_pair() {  # precision, tag: the ddp_match runs in that precision
  local prec=$1 tag=$2
  fits 150 "ddp_match $prec" || return 0
  # The two 1-GPU runs side by side, one per GPU.
  CUDA_VISIBLE_DEVICES=$GPU_A run_limited 240 ${tag}_1gpu $(one $MATCH $REINIT train.precision=$prec \
    train.micro_batch_size=8 run_dir=$RUNS/${tag}_1gpu) &
  local first=$!
  CUDA_VISIBLE_DEVICES=$GPU_B run_limited 240 ${tag}_1gpu_mb4 $(one $MATCH $REINIT train.precision=$prec \
    train.micro_batch_size=4 run_dir=$RUNS/${tag}_1gpu_mb4) &
  wait $first; wait $!
  run_limited 240 ${tag}_ddp $(launch ddp $MATCH $REINIT train.precision=$prec train.micro_batch_size=8 \
    run_dir=$RUNS/${tag}_ddp)
  $PY scripts/compare_losses.py $RUNS/${tag}_1gpu $RUNS/${tag}_ddp $RUNS/${tag}_1gpu_mb4 \
    --labels 1gpu,ddp2,1gpu_mb4 --json "$WORK/results/${tag}.json" 2>&1 | tail -n 6
}

FSDP_STEPS=${FSDP_STEPS:-8}
FSDP_CKPT=${FSDP_CKPT:-4}
FSDP_KILL_AFTER=${FSDP_KILL_AFTER:-6}
FSDP="model=1b train.seq_len=2048 train.global_batch_size=8 train.micro_batch_size=4 train.max_steps=$FSDP_STEPS \
train.lr=1e-3 train.warmup_steps=2 train.log_every=1 train.eval_every=0 train.eval_batches=2 \
train.checkpoint_every=$FSDP_CKPT train.keep_last=2 train.export=true train.precision=bf16 \
train.compile=${FSDP_COMPILE:-false} sparsity=paper sparsity.l1_coeff=2e-5 sparsity.l1_warmup_end=0"
# The kernels from the first step and the per-layer controller moving every step.
FSDP_KERNELS_ARGS="model.ffn_impl=cuda model.ffn_dense_above=1.0 sparsity=target sparsity.target_sparsity=null \
sparsity.target_l0=30 sparsity.l1_coeff=1e-3 sparsity.l1_warmup_end=2 sparsity.controller.per_layer=true"
[ "${FSDP_KERNELS:-0}" = 1 ] && FSDP="$FSDP $FSDP_KERNELS_ARGS"
RESUME_KEYS="loss,ce,l1,grad_norm,l1_coeff,l1_coeff/layer_00,l1_coeff/layer_17"

fsdp_resume() {
  fits 200 fsdp_resume || return 0
  if [ "${FSDP_KERNELS:-0}" = 1 ]; then wait_build || return 1; fi
  local dir=$RUNS/fsdp_killed
  local log=$WORK/logs/fsdp_killed.log
  echo "== fsdp_killed ($(date -u +%H:%M:%S)): kill -9 after step $FSDP_KILL_AFTER" | tee -a "$WORK/logs/commands.log"
  # shellcheck disable=SC2046
  $(launch fsdp2 $FSDP run_dir=$dir) >"$log" 2>&1 &
  local pid=$! waited=0
  until $PY - "$dir" "$FSDP_KILL_AFTER" <<'EOF' 2>/dev/null
import sys
from sparse_llm.analysis.runs import read_metrics
records = read_metrics(sys.argv[1])  # fails (not yet) while the first record is being written
sys.exit(0 if records and records[-1]["step"] >= int(sys.argv[2]) else 1)
EOF
  do
    if ! kill -0 "$pid" 2>/dev/null || [ $waited -ge 1500 ]; then
      echo "FAILED: the FSDP2 run ended or stalled before step $FSDP_KILL_AFTER"; tail -n 30 "$log"
      kill_tree "$pid"
      return 1
    fi
    sleep 0.2; waited=$((waited + 1))
  done
  kill_tree "$pid"  # the launcher and both workers, SIGKILL: a crash, no clean-up
  wait "$pid" 2>/dev/null
  echo "   killed at $(date -u +%H:%M:%S); checkpoints: $(ls -a "$dir/checkpoints" | tr '\n' ' ')" | tee -a "$log"
  # The losses logged before the kill, as a run directory of their own for compare_losses.py.
  mkdir -p "$RUNS/fsdp_prekill" && cp "$dir/metrics.jsonl" "$RUNS/fsdp_prekill/metrics.jsonl"
  local keys=loss,ce,l1,grad_norm
  if [ "${FSDP_KERNELS:-0}" = 1 ]; then
    keys=$RESUME_KEYS
    cp -r "$dir" "${dir}_1proc"  # the same crash, resumed on one process below
  fi
  run_limited 300 fsdp_resumed $(launch fsdp2 $FSDP run_dir=$dir train.resume=auto) || return 1
  local resumed_at
  resumed_at=$(grep -ho "at step [0-9]*" "$WORK/logs/fsdp_resumed.log" | head -n 1 | awk '{print $3}')
  echo "   resumed at step ${resumed_at:-?}"
  # Steps after the checkpoint: logged before the kill, and again by the resumed run.
  $PY scripts/compare_losses.py "$RUNS/fsdp_prekill" "$dir" --labels before_kill,resumed \
    --keys $keys --min-step $((${resumed_at:-0} + 1)) --json "$WORK/results/fsdp_resume.json" 2>&1 \
    | tail -n 8
  if [ "${FSDP_KERNELS:-0}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$GPU_A run_limited 300 fsdp_resumed_1proc $(one $FSDP run_dir=${dir}_1proc train.resume=auto) || return 1
  fi
  if [ "${FSDP_REFERENCE:-0}" = 1 ] && fits 150 fsdp_straight; then
    run_limited 300 fsdp_straight $(launch fsdp2 $FSDP run_dir=$RUNS/fsdp_straight) \
      && $PY scripts/compare_losses.py $RUNS/fsdp_straight "$dir" --labels straight,killed_resumed \
        --keys $keys,val_loss --json "$WORK/results/fsdp_resume_vs_straight.json" 2>&1 | tail -n 4
    # Across process counts: the one-process resume against the uninterrupted two-process run.
    [ -d "${dir}_1proc" ] && $PY scripts/compare_losses.py $RUNS/fsdp_straight "${dir}_1proc" \
      --labels straight_2proc,resumed_1proc --keys $keys,val_loss --min-step $((${resumed_at:-0} + 1)) \
      --json "$WORK/results/fsdp_resume_1proc_vs_straight.json" 2>&1 | tail -n 4
  fi
  # The export gathered from the shards: every weight of a transformers Llama, with its shape.
  $PY - "$dir/export" "$WORK/results/fsdp_export.json" <<'EOF' 2>&1 | tail -n 3
import json, sys
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM
export, out = sys.argv[1], sys.argv[2]
config = AutoConfig.from_pretrained(export)
with torch.device("meta"):
    expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
with safe_open(f"{export}/model.safetensors", "pt") as f:
    saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
missing = sorted(set(expected) - set(saved) - tied)
wrong = sorted(k for k in saved if k in expected and saved[k] != expected[k])
result = {"tensors": len(saved), "missing": missing, "unexpected": sorted(set(saved) - set(expected)),
          "wrong_shape": wrong, "ok": not missing and not wrong and set(saved) <= set(expected)}
json.dump(result, open(out, "w"), indent=1)
print("export check:", result)
EOF
}

SCALE_STEPS=${SCALE_STEPS:-40}
SCALE_BASE="experiment=bench_1b train.max_steps=$SCALE_STEPS train.log_every=5"
SCALE="$SCALE_BASE ${SCALE_EXTRA:-}"
summarize() {  # run name: its tokens/s summary into $WORK/results
  $PY scripts/summarize_run.py "$RUNS/$1" --name "$1" --out "$WORK/results" --skip ${SCALE_SKIP:-2} >/dev/null
}
scaling() {
  if [ -n "${SCALE_BASELINE_EXTRA:-}" ]; then
    # A/B on one GPU, side by side: the baseline overrides run on GPU 1 while the main run uses GPU 0.
    fits 150 scaling_1gpu_base && (CUDA_VISIBLE_DEVICES=$GPU_B run_limited 400 scale_1gpu_base $(one $SCALE_BASE \
      $SCALE_BASELINE_EXTRA run_dir=$RUNS/scale_1gpu_base) \
      && summarize scale_1gpu_base) &
  fi
  fits 150 scaling_1gpu && CUDA_VISIBLE_DEVICES=$GPU_A run_limited 400 scale_1gpu $(one $SCALE run_dir=$RUNS/scale_1gpu) \
    && summarize scale_1gpu
  wait
  fits 150 scaling_ddp && run_limited 400 scale_ddp $(launch ddp $SCALE train.global_batch_size=16 \
    run_dir=$RUNS/scale_ddp) && summarize scale_ddp
  if [ "${SCALING_FSDP:-1}" = 1 ] && fits 150 scaling_fsdp; then
    run_limited 400 scale_fsdp $(launch fsdp2 $SCALE train.global_batch_size=16 run_dir=$RUNS/scale_fsdp) \
      && summarize scale_fsdp
  fi
  $PY - "$WORK/results" <<'EOF'
import json, pathlib, sys
results = pathlib.Path(sys.argv[1])
runs = {n: json.loads((results / f"scale_{n}.json").read_text()) for n in ("1gpu", "1gpu_base", "ddp", "fsdp")
        if (results / f"scale_{n}.json").is_file()}
base = runs.get("1gpu", {}).get("tokens_per_s_median")
for name, r in runs.items():
    speedup = r["tokens_per_s_median"] / base if base else float("nan")
    print(f"scaling {name}: {r['tokens_per_s_median']:,.0f} tok/s, {speedup:.3f}x, "
          f"MFU {100 * r.get('mfu_median', 0):.1f}%, {r['peak_mem_gib']:.1f} GiB, {r['windows']} windows")
EOF
}

cuda_ffn() {
  wait_build || return 1
  local cuda="model.ffn_impl=cuda model.ffn_dense_above=1.0"
  # The dense twin of cuda_ddp is ddp_match's DDP run.
  [ -f $RUNS/bf16_ddp/metrics.jsonl ] || { fits 100 dense_ddp && run_limited 240 bf16_ddp $(launch ddp $MATCH $REINIT \
    train.precision=bf16 train.micro_batch_size=8 run_dir=$RUNS/bf16_ddp); }
  fits 100 cuda_ffn_ddp && run_limited 240 cuda_ddp $(launch ddp $MATCH $REINIT train.precision=bf16 \
    train.micro_batch_size=8 $cuda run_dir=$RUNS/cuda_ddp)
  # FSDP2 refuses dead-unit reinit on sharded weights: this pair runs without it.
  fits 100 cuda_ffn_fsdp && run_limited 240 cuda_fsdp $(launch fsdp2 $MATCH train.precision=bf16 \
    train.micro_batch_size=8 $cuda run_dir=$RUNS/cuda_fsdp)
  fits 100 dense_fsdp && run_limited 240 dense_fsdp $(launch fsdp2 $MATCH train.precision=bf16 \
    train.micro_batch_size=8 run_dir=$RUNS/dense_fsdp)
  grep -h -i "warn.*\(fall\|refer\)" "$WORK"/logs/cuda_*.log | sort | uniq -c | head -n 5
  [ -f $RUNS/cuda_ddp/metrics.jsonl ] && $PY scripts/compare_losses.py $RUNS/bf16_ddp $RUNS/cuda_ddp --labels dense_ddp,cuda_ddp \
    --json "$WORK/results/cuda_ffn_ddp.json" 2>&1 | tail -n 4
  [ -f $RUNS/cuda_fsdp/metrics.jsonl ] && $PY scripts/compare_losses.py $RUNS/dense_fsdp $RUNS/cuda_fsdp \
    --labels dense_fsdp,cuda_fsdp --json "$WORK/results/cuda_ffn_fsdp.json" 2>&1 | tail -n 4
}

ddp_match() {
  match_pair bf16 bf16 || return 1
  if [ "${MATCH_FP32:-0}" = 1 ]; then match_pair fp32 fp32; fi
}
