#!/usr/bin/env bash
# One run on a GPU machine: sparsify the 1b preset by a short high-L1 run on the embedded text,
# then time inference (prefill + decode, dense vs cuda: benchmarks/inference.py) and the training
# step (dense vs cuda: benchmarks/model_step.py) on those same weights. Results under $OUT.
# Env: STEPS (sparsify steps, default 400), L1 (default 3e-3: the committed results; it overshoots
# to ~99.99% sparsity on the 1b preset, a lower value gives weights nearer the paper's ~99.5%),
# PROFILE=1 (kernel tables of one prefill and one training step per FFN impl, in $OUT),
# TRAIN_ARGS (extra benchmarks/model_step.py arguments), SKIP_TRAIN=1 (inference only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_sparse_1b_out}
mkdir -p "$OUT"
source scripts/device_env.sh || exit 1
status=0
python3 -m sparse_llm.ops.build >/dev/null || exit 1
python3 -m benchmarks.inference --sparsify --preset 1b --sparsify-steps "${STEPS:-400}" \
  --l1-coeff "${L1:-3e-3}" --prompt-len 1920 --decode-tokens 128 --out /tmp/inference \
  ${PROFILE:+--profile} 2>&1 \
  | grep -v -e Warning -e "it/s" -e "step/s" | tail -n 25 || status=1
cp /tmp/inference/*.json /tmp/inference/*.md /tmp/inference/*.txt "$OUT"/ 2>/dev/null
# shellcheck disable=SC2086
[ "${SKIP_TRAIN:-0}" = 1 ] || python3 -m benchmarks.model_step --model /tmp/inference/sparsify_run --compile ${TRAIN_ARGS:-} \
  ${PROFILE:+--profile "$OUT"} \
  --json "$OUT/train_1b_sparse.json" --md "$OUT/train_1b_sparse.md" 2>&1 | grep -v Warning | tail -n 12 || status=1
ls "$OUT"
exit $status
