"""Repeatable sparse weights for the benchmarks: train a preset to a target L0 and save it.

    python -m benchmarks.sparse_weights --preset 1b --target-l0 30 --out runs/sparse_1b_l0_30
    python -m benchmarks.sparse_weights --tiny --target-l0 8 --out /tmp/sparse_tiny   # CPU, seconds

On the 1b preset (H100): 800 steps of 8 x 2048 tokens, L1 ramped to 1e-3 over 100 steps (where
L0 is near 30-50), then the controller's defaults; about 4.5 minutes. Trains through the trainer
itself (`benchmarks.common.sparsify`, i.e. `sparse_llm.train.run`) with the L1 coefficient driven
to the target by the sparsity controller (`sparsity.target_l0`), then measures L0 (mean active FFN
units per token, over layers, and each layer's) on held-out text of the embedded corpus with the
saved weights, and writes `<out>/sparse_weights.json` and `.md`: the target, the L0 on held-out
text and by layer, the layers over `model.ffn_dense_above` (which the trainer runs dense), the L0
of the last logged training step, the steps, the seconds, device, commit, date. `--per-layer`
drives each layer to the target with its own coefficient (`sparsity.controller.per_layer`)
instead of the mean over layers. The run directory holds the final checkpoint, which
`sparse_llm.inference.load_model(out)` and the other benchmarks (`--model <out>`) read.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks import common
from sparse_llm.analysis.runs import read_metrics
from sparse_llm.config import ModelConfig
from sparse_llm.inference import load_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__, report=False)
    p.add_argument("--preset", default="1b", help="configs/model/<preset>.yaml")
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (a smoke test)")
    p.add_argument("--target-l0", type=float, required=True, help="mean active FFN units per token")
    p.add_argument("--out", type=Path, required=True, help="the run directory to write")
    p.add_argument("--steps", type=int, default=None, help="default: 800 (1b), 150 (--tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="default: 2048 (1b), 64 (--tiny)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step; default 8 (1b), 8 (--tiny)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--l1-start", type=float, default=1e-3, help="L1 at the end of the warm-up ramp")
    p.add_argument(
        "--l1-warmup-end",
        type=int,
        default=None,
        help="steps of the linear L1 ramp before the controller adapts; default 100 (1b), 30 (--tiny)",
    )
    p.add_argument("--eval-rows", type=int, default=16, help="held-out rows L0 is measured on")
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="hold every layer at the target (sparsity.controller.per_layer) instead of the mean over layers",
    )
    return p.parse_args(argv)


@torch.no_grad()
def heldout_layer_l0(run_dir: Path, rows: int, seq_len: int) -> list[float]:
    """Active FFN units per token of each layer, on held-out text, with the saved weights."""
    loaded = load_model(run_dir)
    model = loaded.model
    ids, _ = common.token_batch(loaded.tokenizer, model.config.vocab_size, rows, seq_len)
    return (
        common.active_units_per_token(model, ids.to(model.lm_head.weight.device)).float().mean(dim=1).tolist()
    )


def heldout_l0(run_dir: Path, rows: int, seq_len: int) -> float:
    """Mean active FFN units per token over layers, on held-out text, with the saved weights."""
    per_layer = heldout_layer_l0(run_dir, rows, seq_len)
    return sum(per_layer) / len(per_layer)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny)
    on_gpu = device.type == "cuda"
    if args.tiny:
        model = dict(common.TINY_MODEL)
        steps, seq_len, batch = args.steps or 150, args.seq_len or 64, args.batch or 8
        warmup = 30 if args.l1_warmup_end is None else args.l1_warmup_end
    else:
        model = common.model_preset(args.preset)
        steps, seq_len, batch = args.steps or 800, args.seq_len or 2048, args.batch or 8
        warmup = 100 if args.l1_warmup_end is None else args.l1_warmup_end
    start = time.perf_counter()
    common.sparsify(
        args.out,
        model,
        steps=steps,
        l1_coeff=args.l1_start,
        lr=args.lr,
        seq_len=seq_len,
        batch=batch,
        l1_warmup_end=warmup,
        data={"max_documents": 300} if args.tiny else None,
        train={"device": device.type, "compile": on_gpu, "log_every": max(1, steps // 60)},
        overrides=[
            f"sparsity.target_l0={args.target_l0}",
            f"sparsity.controller.per_layer={str(args.per_layer).lower()}",
        ],
    )
    seconds = time.perf_counter() - start
    last = [r for r in read_metrics(args.out) if "l0/mean" in r][-1]
    layer_l0 = heldout_layer_l0(args.out, args.eval_rows, seq_len)
    l0 = sum(layer_l0) / len(layer_l0)
    # The trainer runs a layer denser than this many units with the dense FFN (training/ffn_fallback.py).
    max_density = model.get("ffn_dense_above", ModelConfig.ffn_dense_above)
    dense_above = max_density * model["intermediate_size"]
    row = {
        "preset": "tiny" if args.tiny else args.preset,
        "target_l0": args.target_l0,
        "heldout_l0": l0,
        "train_l0_last": last["l0/mean"],
        "l1_coeff_last": last.get("l1_coeff"),
        "per_layer_controller": args.per_layer,
        "heldout_layer_l0": layer_l0,
        "dense_above_units": dense_above,
        "layers_dense_above": common.layers_over_dense_above(
            layer_l0, model["intermediate_size"], max_density
        ),
        "steps": steps,
        "tokens_per_step": batch * seq_len,
        "seconds": seconds,
        "run_dir": str(args.out),
    }
    meta = common.run_meta(device)
    text = (
        f"# Sparse weights: {row['preset']} trained to a target L0 of {args.target_l0:g}\n\n"
        f"{meta.get('device')}, commit `{meta.get('commit')}`, {meta.get('date')}\n\n"
        "| target L0 | L0 on held-out text | L0 last training step | L1 coeff last | steps | tokens/step | s |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {args.target_l0:g} | {l0:.2f} | {row['train_l0_last']:.2f} | {row['l1_coeff_last']} | {steps} "
        f"| {row['tokens_per_step']} | {seconds:.0f} |\n\n"
        f"Controller: {'one L1 coefficient per layer' if args.per_layer else 'one L1 coefficient, the mean L0'}. "
        f"Held-out L0 by layer (min {min(layer_l0):.1f}, max {max(layer_l0):.1f}; "
        f"{row['layers_dense_above']} of {len(layer_l0)} above the {dense_above:g} units past which the "
        "trainer runs a layer dense):\n\n"
        "| layer | " + " | ".join(str(i) for i in range(len(layer_l0))) + " |\n"
        "|---|" + "---|" * len(layer_l0) + "\n"
        "| L0 | " + " | ".join(f"{v:.1f}" for v in layer_l0) + " |\n"
    )
    common.write_report(text, meta, [row], args.out / "sparse_weights.json", args.out / "sparse_weights.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
