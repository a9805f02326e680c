"""How active units spread over the tokens of a training step, layer by layer: what sizes the sparse
training op's records and its heavy rows' GEMMs (kernels/train_bindings.cpp).

    python -m benchmarks.row_density --model runs/sparse_1b [--rows 8 --seq-len 2048] [--json F] [--md F]
    python -m benchmarks.row_density --tiny      # CPU, seconds: the script end to end

For each layer, over one step's tokens (rows x seq-len of held-out text, the M of one op call):
L0, the tokens with an active unit (what the FFN block keeps), the largest and the 99th-percentile
active units of a token, and the heavy rows: tokens with more than `--heavy-threshold` active units,
which take the dense GEMM path. The forward queues the GEMMs of the first `early` heavy rows before
its host read (`early`: M / 64 rounded up to a multiple of 64); a sync-free forward would keep
that capacity and send the rest to an overflow path, so `past early` counts what that path would get.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model
from sparse_llm.ops import DEFAULT_HEAVY_THRESHOLD

EARLY_ROWS_PER = 64  # kEarlyHeavyRowsPer in kernels/train_bindings.cpp
HEAVY_ROWS_GRANULE = 64  # kHeavyRowsGranule in kernels/torch_glue.h
RANDOM_TINY = {**common.TINY_MODEL, "vocab_size": 97}  # --tiny: random weights, no tokenizer


def model_parser(description: str | None) -> argparse.ArgumentParser:
    """The options of a per-layer benchmark on a model's held-out tokens (`model_and_tokens`):
    --model or --tiny, --rows, --seq-len, --heavy-threshold, --json, --md."""
    p = common.script_parser(description)
    p.add_argument("--model", type=Path, default=None, help="export, checkpoint or run directory")
    p.add_argument("--tiny", action="store_true", help="a tiny random model on CPU")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heavy-threshold", type=int, default=DEFAULT_HEAVY_THRESHOLD)
    return p


def parse_model_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`p`'s arguments, with exactly one of --model and --tiny."""
    args = p.parse_args(argv)
    if (args.model is None) == (not args.tiny):
        p.error("give --model or --tiny")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_model_args(model_parser(__doc__), argv)


def early_capacity(tokens: int) -> int:
    """The heavy rows whose GEMMs the forward queues before its host read, for `tokens` rows."""
    wanted = -(-tokens // EARLY_ROWS_PER)
    return -(-wanted // HEAVY_ROWS_GRANULE) * HEAVY_ROWS_GRANULE


def layer_rows(nnz: torch.Tensor, threshold: int) -> list[dict]:
    tokens = nnz.shape[1]
    early = early_capacity(tokens)
    rows = []
    for layer, counts in enumerate(nnz):
        heavy = int((counts > threshold).sum())
        rows.append(
            {
                "layer": layer,
                "l0": counts.float().mean().item(),
                "active_tokens": (counts > 0).float().mean().item(),
                "max_units": int(counts.max()),
                "p99_units": torch.quantile(counts.float(), 0.99).item(),
                "heavy_rows": heavy,
                "early": early,
                "past_early": max(0, heavy - early),
            }
        )
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"Device: {meta['device']}; commit {meta['commit']}; date {meta['date']}; model {meta['model']}; "
        f"{meta['tokens']} tokens ({meta['text']}); heavy threshold {meta['heavy_threshold']}; "
        f"early capacity {rows[0]['early']} rows.",
        "",
        "| layer | L0 | tokens with an active unit | max units | p99 units | heavy rows | past early |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['l0']:.1f} | {r['active_tokens']:.1%} | {r['max_units']} | "
            f"{r['p99_units']:.0f} | {r['heavy_rows']} | {r['past_early']} |"
        )
    return "\n".join(lines) + "\n"


def model_and_tokens(args: argparse.Namespace, device: torch.device) -> tuple[Any, torch.Tensor, str, str]:
    """(model in eval mode, token ids [rows, seq-len] on `device`, what the text is, the model's
    name) for `--model` or `--tiny` (a random tiny model, 2 x 64 tokens)."""
    if args.tiny:
        torch.manual_seed(0)
        model, tokenizer, name = build_model(ModelConfig(**RANDOM_TINY)), None, "tiny (random)"
        rows, seq_len = 2, 64
    else:
        from sparse_llm.inference import load_model

        loaded = load_model(args.model, device)
        model, tokenizer, name = loaded.model, loaded.tokenizer, str(args.model)
        rows, seq_len = args.rows, args.seq_len
    model.eval()
    ids, text = common.token_batch(tokenizer, model.config.vocab_size, rows, seq_len)
    return model, ids.to(device), text, name


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny)
    model, ids, text, name = model_and_tokens(args, device)
    nnz = common.active_units_per_token(model, ids).cpu()
    results = layer_rows(nnz, args.heavy_threshold)
    meta = common.run_meta(
        device, model=name, tokens=nnz.shape[1], text=text, heavy_threshold=args.heavy_threshold
    )
    common.write_report(markdown(meta, results), meta, results, args.json, args.md)


if __name__ == "__main__":
    main()
