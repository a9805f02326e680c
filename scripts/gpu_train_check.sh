#!/usr/bin/env bash
# Trainer checks for one run on a GPU machine; results under $OUT, a few files (one tarball a run).
#   bench1b          dense 1B preset, 8 x 2048 tokens per step, compiled bf16: tokens/s, MFU, peak memory
#   l1reinit L1 0    ~100M model on the machine's Python sources with the L1 coefficient $SPARSITY_L1:
#   l1noreinit       with dead-unit reinit, without it, and the L1 = 0 twin. Each run's metrics,
#   l1zero           config, run info and plots come back as one tarball to compare here with
#                    scripts/compare_runs.py.
#   relu_dense       the recipe table (issue 30), same model, data and budget, learning rate $SPARSITY_LR:
#   swiglu_dense     ReLU FFN with L1 0, SwiGLU FFN (model.hidden_act=silu) with L1 0, the L1 controller
#   target           at 99.5% sparsity (sparsity=target, starting from $SPARSITY_L1), and the same with
#   target_reinit    dead-unit reinit every 100 steps
#   gputest          model-level GPU tests (compiled statistics match eager, ffn_impl=cuda logits)
# Usage: bash scripts/gpu_train_check.sh gputest bench1b l1zero l1reinit
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_train_out}
mkdir -p "$OUT"
source scripts/device_env.sh || exit 1
python3 -c "import torch, datasets, hydra; print('torch', torch.__version__, 'datasets', datasets.__version__, torch.cuda.get_device_name())" || exit 1
RUNS=/tmp/runs
TRAIN="python3 -m sparse_llm.train logger=none train.progress=false"
L1=${SPARSITY_L1:-3e-4}
STEPS=${SPARSITY_STEPS:-1000}
LR=${SPARSITY_LR:-6e-4}  # 1.5e-3 (the older runs' rate) kills a dense ReLU model's units: recipe_100m_h200.md

sparsity_run() {  # name, extra overrides...
  local name=$1; shift
  [ -f /tmp/corpus.jsonl ] || python3 scripts/make_python_corpus.py --out /tmp/corpus.jsonl --max-mb 600
  $TRAIN model=100m data=files "data.paths=[/tmp/corpus.jsonl]" data.val_fraction=0.01 train=gpu_bench \
    train.seq_len=1024 train.global_batch_size=64 train.micro_batch_size=64 train.lr=$LR \
    train.warmup_steps=100 train.max_steps=$STEPS train.log_every=25 train.eval_every=250 train.eval_batches=8 \
    sparsity.l1_warmup_end=200 sparsity.dead_window_tokens=1000000 run_dir=$RUNS/$name "$@" 2>&1 | tail -n 4
  tar -czf "$OUT/run_$name.tar.gz" -C $RUNS "$name/metrics.jsonl" "$name/config.yaml" "$name/run_info.json" \
    $(cd $RUNS && ls $name/*.png $name/nnz_hist.json 2>/dev/null)
}

for part in "$@"; do
  case "$part" in
    gputest)  # model-level GPU tests (compiled statistics, ffn_impl=cuda logits)
      python3 -m pytest -q -m gpu tests/model/test_model_gpu.py 2>&1 | tee "$OUT/model_gpu_tests.log" | tail -n 5
      ;;
    bench1b)
      $TRAIN experiment=bench_1b run_dir=$RUNS/bench_1b train.max_steps=40 2>&1 | tail -n 5
      python3 scripts/summarize_run.py $RUNS/bench_1b --name train_1b_dense --out "$OUT" --skip 2
      ;;
    l1reinit) sparsity_run l1reinit sparsity.l1_coeff=$L1 sparsity.reinit.enabled=true sparsity.reinit.every=100 ;;
    l1noreinit) sparsity_run l1noreinit sparsity.l1_coeff=$L1 ;;
    l1zero) sparsity_run l1zero sparsity.l1_coeff=0 ;;
    relu_dense) sparsity_run relu_dense_lr$LR sparsity.l1_coeff=0 ;;
    swiglu_dense) sparsity_run swiglu_dense_lr$LR model.hidden_act=silu sparsity.l1_coeff=0 ;;
    target) sparsity_run target_lr$LR sparsity=target sparsity.l1_coeff=$L1 ;;
    target_reinit)
      sparsity_run target_reinit_lr$LR sparsity=target sparsity.l1_coeff=$L1 \
        sparsity.reinit.enabled=true sparsity.reinit.every=100 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
ls -la "$OUT"
