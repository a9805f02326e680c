#!/usr/bin/env bash
# Trainer checks for one device call (results under $OUT, at most 8 files):
#   bench1b   dense 1B preset, 8 x 2048 tokens per step, compiled bf16: tokens/s, MFU, peak memory
#   sparsity  ~100M model on the machine's Python sources: L1 + reinit, L1 without reinit, L1=0 twin
# Usage: bash scripts/gpu_train_check.sh bench1b sparsity
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_train_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
if [ -d .whl ]; then  # packages the device image lacks (hydra-core, omegaconf, datasets, ...)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 -c "import torch, datasets, hydra, transformers; print('torch', torch.__version__, 'datasets', datasets.__version__, torch.cuda.get_device_name())" || exit 1
RUNS=/tmp/runs
TRAIN="python3 -m sparse_llm.train logger=none train.progress=false"

for part in "$@"; do
  case "$part" in
    bench1b)
      $TRAIN experiment=bench_1b run_dir=$RUNS/bench_1b train.max_steps=40 2>&1 | tail -n 5
      python3 scripts/summarize_run.py $RUNS/bench_1b --name train_1b_dense --out "$OUT" --skip 2
      ;;
    sparsity)
      python3 scripts/make_python_corpus.py --out /tmp/corpus.jsonl --max-mb 600
      common="model=100m data=files data.paths=[/tmp/corpus.jsonl] data.val_fraction=0.01 train=gpu_bench
        train.seq_len=1024 train.global_batch_size=64 train.micro_batch_size=64 train.lr=1.5e-3
        train.warmup_steps=100 train.max_steps=${SPARSITY_STEPS:-1200} train.log_every=25 train.eval_every=200
        train.eval_batches=4 sparsity.l1_warmup_end=200 sparsity.dead_window_tokens=1000000"
      l1=${SPARSITY_L1:-3e-4}
      $TRAIN $common run_dir=$RUNS/l1_reinit sparsity.l1_coeff=$l1 sparsity.reinit.enabled=true \
        sparsity.reinit.every=100 2>&1 | tail -n 3
      $TRAIN $common run_dir=$RUNS/l1_noreinit sparsity.l1_coeff=$l1 2>&1 | tail -n 3
      $TRAIN $common run_dir=$RUNS/l1_zero sparsity.l1_coeff=0 2>&1 | tail -n 3
      python3 scripts/compare_runs.py $RUNS/l1_reinit $RUNS/l1_noreinit $RUNS/l1_zero --out "$OUT" \
        --name sparsity_100m --labels "L1 $l1 + reinit,L1 $l1,L1 0"
      ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
ls -la "$OUT"
