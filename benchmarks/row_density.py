"""How active units spread over the tokens of a training step, layer by layer: what sizes the sparse
training op's records and its heavy rows' GEMMs (kernels/train_bindings.cpp).

    python -m benchmarks.row_density --model runs/sparse_1b [--rows 8 --seq-len 2048] [--json F] [--md F]
    python -m benchmarks.row_density --tiny      # CPU, seconds: the script end to end
    python -m benchmarks.row_density --model runs/sparse_1b --save-inputs DIR   # also keep the FFN inputs
    python -m benchmarks.row_density --model runs/sparse_1b --inputs DIR        # read them: no forward

`--save-inputs DIR` writes every layer's FFN input (the post-attention norm's output, what enters the
gate) for these tokens as DIR/layer_NN.safetensors (bf16, key "x", [M, D]) and DIR/meta.json (the
layers' L0, token count, text, the model config's hash); `--inputs DIR` here and in `layer_ffn.py`
reads them for a model of that config instead of running the forward.

For each layer, over one step's tokens (rows x seq-len of held-out text, the M of one op call):
L0, the tokens with an active unit (what the FFN block keeps), the largest and the 99th-percentile
active units of a token, and the heavy rows: tokens with more than `--heavy-threshold` active units,
which take the dense GEMM path. The forward queues the GEMMs of the first `early` heavy rows before
its host read (`early`: M / 64 rounded up to a multiple of 64); a sync-free forward would keep
that capacity and send the rest to an overflow path, so `past early` counts what that path would get.

How many units a tile of tokens shares, for a tensor-core design that loads a tile's weight rows once:
for tiles of T consecutive tokens (T in `TILES`, the M-tiles such a design would use; the last tile
may be shorter), the mean and p90 over tiles of the union (distinct units active in the tile) and the
reuse, sum over tiles of active entries / sum over tiles of unions (how often a loaded weight row is
used; a ratio of sums, so empty tiles weigh nothing). `sorted`: the same with the step's tokens
first sorted (stably) by their lowest active unit (tokens with none last), a cheap regrouping that
shows whether grouping tokens raises reuse.

Bounds on matmul work (multiply-adds), as speedup over the dense FFN's forward+backward. Dense, for
M tokens, D model and H hidden units: forward g = x Wg^T, u = x Wu^T, y = h Wd^T (3 MDH); backward
dh = dy Wd, dWd = dy^T h, dx = dg Wg + du Wu, dWg = dg^T x, dWu = du^T x (6 MDH): 9 MDH. A sparse
op must run the gate's forward dense (it finds the active units), but nothing else: with a = relu(g),
dg = dh * u * [g > 0] and du = dh * a vanish off the active entries (a = 0 there), so dx, dWg and dWu
need them only there; h = a * u needs u, dh (also the L1 term's sign(h) / M) and the rows of Wd
only there, and dWd = dy^T h only h's non-zeros. So each of the 8 other products costs D per
(token, unit) pair it computes, and bound = 9 MDH / (MDH + 8 D E) = 9 / (1 + 8 E / (M H)), E the
pairs computed:
- gather: every active entry and nothing else (a per-row design at its ideal), E = M L0;
- as built: the light rows' entries, and all H units of each heavy row (their GEMMs run over every
  unit), E = the light rows' entries + heavy rows x H;
- heavy rows over their union: as built, but the heavy rows' GEMMs over only the units active in
  some heavy row, E = the light rows' entries + heavy rows x that union;
- tiles T (and sorted): a dense GEMM over each tile's union, E = sum over tiles of rows x union.
Elementwise work, the gate's reduction and memory traffic are left out: these bound the matmuls only.
The 9x limit is the gate's forward alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks import common
from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model
from sparse_llm.ops import DEFAULT_HEAVY_THRESHOLD

EARLY_ROWS_PER = 64  # kEarlyHeavyRowsPer in kernels/train_bindings.cpp
HEAVY_ROWS_GRANULE = 64  # kHeavyRowsGranule in kernels/torch_glue.h
RANDOM_TINY = {**common.TINY_MODEL, "vocab_size": 97}  # --tiny: random weights, no tokenizer
TILES = (64, 128)  # token tiles: the M-tiles of a tensor-core design
DENSE_PRODUCTS = 9  # M x D x H products of the dense FFN's forward+backward (module docstring)
GATE_PRODUCTS = 1  # of which the gate's forward, dense in any sparse op
INPUTS_META = "meta.json"  # beside the layer_NN.safetensors of --save-inputs


def model_parser(description: str | None) -> argparse.ArgumentParser:
    """The options of a per-layer benchmark on a model's held-out tokens (`model_inputs`):
    --model or --tiny, --rows, --seq-len, --heavy-threshold, --inputs, --json, --md."""
    p = common.script_parser(description)
    p.add_argument("--model", type=Path, default=None, help="export, checkpoint or run directory")
    p.add_argument("--tiny", action="store_true", help="a tiny random model on CPU")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heavy-threshold", type=int, default=DEFAULT_HEAVY_THRESHOLD)
    p.add_argument(
        "--inputs", type=Path, default=None, help="FFN inputs saved by row_density --save-inputs: no forward"
    )
    return p


def parse_model_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`p`'s arguments, with exactly one of --model and --tiny."""
    args = p.parse_args(argv)
    if (args.model is None) == (not args.tiny):
        p.error("give --model or --tiny")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument(
        "--save-inputs", type=Path, default=None, help="write every layer's FFN input here (bf16 safetensors)"
    )
    return parse_model_args(p, argv)


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


def tile_unions(mask: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct units active in each tile of `tile` consecutive tokens of mask [M, H], each tile's
    token count): the last tile holds what is left."""
    m, h = mask.shape
    pad = -m % tile
    padded = torch.cat([mask, mask.new_zeros(pad, h)]) if pad else mask
    unions = padded.view(-1, tile, h).any(dim=1).sum(dim=1)
    rows = torch.full_like(unions, tile)
    rows[-1] -= pad
    return unions, rows


def lowest_unit_order(mask: torch.Tensor) -> torch.Tensor:
    """The tokens of mask [M, H] sorted stably by their lowest active unit, those with none last."""
    lowest = torch.where(mask.any(dim=1), mask.to(torch.uint8).argmax(dim=1), mask.shape[1])
    return torch.sort(lowest, stable=True).indices


def speedup_bound(entries: float, tokens: int, units: int) -> float:
    """Dense matmul work over a sparse op's that computes `entries` (token, unit) pairs past the
    dense gate forward (module docstring)."""
    return DENSE_PRODUCTS / (GATE_PRODUCTS + (DENSE_PRODUCTS - GATE_PRODUCTS) * entries / (tokens * units))


def tile_rows(mask: torch.Tensor, threshold: int) -> dict[str, float]:
    """One layer's tile figures and work bounds from its active units, mask [M, H] (module docstring)."""
    m, h = mask.shape
    counts = mask.sum(dim=1)
    entries = counts.sum().item()
    heavy = counts > threshold
    light_entries = counts[~heavy].sum().item()
    built = light_entries + heavy.sum().item() * h
    # The heavy rows' GEMMs over only the units some heavy row uses (the others' columns are zero
    # in every heavy row): what a column-compacted heavy path would compute.
    heavy_union = int(mask[heavy].any(dim=0).sum())
    row = {
        "units_active": int(mask.any(dim=0).sum()),
        "units_active_heavy": heavy_union,
        "bound_gather": speedup_bound(entries, m, h),
        "bound_as_built": speedup_bound(built, m, h),
        "bound_heavy_union": speedup_bound(light_entries + heavy.sum().item() * heavy_union, m, h),
    }
    for suffix, ordered in (("", mask), ("_sorted", mask[lowest_unit_order(mask)])):
        for tile in TILES:
            unions, rows = tile_unions(ordered, tile)
            row[f"union_mean_{tile}{suffix}"] = unions.float().mean().item()
            row[f"union_p90_{tile}{suffix}"] = torch.quantile(unions.float(), 0.9).item()
            row[f"reuse_{tile}{suffix}"] = entries / max(unions.sum().item(), 1)
            row[f"bound_tile_{tile}{suffix}"] = speedup_bound((rows * unions).sum().item(), m, h)
    return row


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
    tiles = [f"{t}{s}" for t in TILES for s in ("", "_sorted")]
    names = [f"T={t}" + (", sorted" if s else "") for t in TILES for s in ("", "_sorted")]
    lines += [
        "",
        "Token tiles: units active in a tile (mean / p90 over tiles) and reuse (active entries / units "
        "loaded); sorted: tokens sorted by their lowest active unit first.",
        "",
        "| layer | " + " | ".join(f"{n}: union | {n}: reuse" for n in names) + " |",
        "|---:|" + "---:|---:|" * len(tiles),
    ]
    for r in rows:
        cells = [
            f"{r[f'union_mean_{t}']:.0f} / {r[f'union_p90_{t}']:.0f} | {r[f'reuse_{t}']:.2f}" for t in tiles
        ]
        lines.append(f"| {r['layer']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Bounds on matmul work, speedup over the dense FFN forward+backward (9 MDH; the gate's forward "
        "stays dense): gather (active entries only), as built (heavy rows over all units), heavy rows "
        "over their union (the units active in some heavy row; units active in the step and in its "
        "heavy rows beside it), dense GEMMs over each tile's union.",
        "",
        "| layer | units active: step / heavy rows | gather | as built | heavy rows over their union | "
        + " | ".join(names)
        + " |",
        "|---:|---:|---:|---:|---:|" + "---:|" * len(tiles),
    ]
    for r in rows:
        cells = [f"{r[f'bound_tile_{t}']:.2f}x" for t in tiles]
        lines.append(
            f"| {r['layer']} | {r['units_active']} / {r['units_active_heavy']} | {r['bound_gather']:.2f}x "
            f"| {r['bound_as_built']:.2f}x | {r['bound_heavy_union']:.2f}x | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def bench_model(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, str]:
    """(model in eval mode on `device`, its tokenizer or None, its name) for `--model` or `--tiny`
    (a random tiny model)."""
    if args.tiny:
        torch.manual_seed(0)
        model, tokenizer, name = build_model(ModelConfig(**RANDOM_TINY)), None, "tiny (random)"
    else:
        from sparse_llm.inference import load_model

        loaded = load_model(args.model, device)
        model, tokenizer, name = loaded.model, loaded.tokenizer, str(args.model)
    return model.to(device).eval(), tokenizer, name


def config_hash(cfg: Any) -> str:
    """A short digest of a model config: saved inputs belong to models of that config."""
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_inputs(directory: Path, inputs: list[torch.Tensor], cfg: Any, **meta: Any) -> None:
    """Every layer's FFN input [M, D] as directory/layer_NN.safetensors (bf16), and `meta` with the
    token count and the config's hash as meta.json."""
    directory.mkdir(parents=True, exist_ok=True)
    for layer, x in enumerate(inputs):
        save_file(
            {"x": x.to(torch.bfloat16).contiguous().cpu()}, directory / f"layer_{layer:02d}.safetensors"
        )
    meta |= {"tokens": inputs[0].shape[0], "layers": len(inputs), "config_hash": config_hash(cfg)}
    (directory / INPUTS_META).write_text(json.dumps(meta, indent=1) + "\n")


def load_inputs(directory: Path, cfg: Any, device: torch.device) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The inputs and meta that `save_inputs` wrote, for a model of config `cfg` (exits on another)."""
    meta = json.loads((directory / INPUTS_META).read_text())
    if meta["config_hash"] != config_hash(cfg):
        raise SystemExit(
            f"{directory}: inputs of another model config ({meta['config_hash']} != {config_hash(cfg)})"
        )
    files = [directory / f"layer_{layer:02d}.safetensors" for layer in range(meta["layers"])]
    return [load_file(f, device=str(device))["x"] for f in files], meta


def training_impl(model: Any, device: torch.device) -> str:
    """The training FFN the package picks for `model` on `device` (bf16 on a GPU, float32 on the
    CPU): what a per-layer training benchmark times as ours."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return common.sparse_path("train", model.config, device, dtype)[0]


def model_inputs(args: argparse.Namespace, device: torch.device) -> tuple[Any, list[torch.Tensor], str, str]:
    """(model, every layer's FFN input [M, D], what the text is, the model's name): loaded from
    `--inputs`, else from one forward over the held-out text (rows x seq-len tokens; --tiny: 2 x 64
    random tokens)."""
    model, tokenizer, name = bench_model(args, device)
    if args.inputs is not None:
        inputs, meta = load_inputs(args.inputs, model.config, device)
        return model, inputs, meta["text"], name
    rows, seq_len = (2, 64) if args.tiny else (args.rows, args.seq_len)
    ids, text = common.token_batch(tokenizer, model.config.vocab_size, rows, seq_len)
    return model, common.ffn_inputs(model, ids.to(device)), text, name


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny)
    model, inputs, text, name = model_inputs(args, device)
    if args.save_inputs is not None:  # what is saved is what this report describes
        inputs = [x.to(torch.bfloat16) for x in inputs]
    counts, tiles = [], []
    for x, layer in zip(inputs, model.model.layers, strict=True):  # one [M, H] mask at a time
        mask = common.gate_active(x, layer.mlp)
        counts.append(mask.sum(dim=1).cpu())
        tiles.append(tile_rows(mask, args.heavy_threshold))
    results = layer_rows(torch.stack(counts), args.heavy_threshold)
    for row, tile in zip(results, tiles, strict=True):
        row.update(tile)
    meta = common.run_meta(
        device, model=name, tokens=len(inputs[0]), text=text, heavy_threshold=args.heavy_threshold
    )
    if args.save_inputs is not None:
        save_inputs(
            args.save_inputs, inputs, model.config, model=name, text=text, layer_l0=[r["l0"] for r in results]
        )
    common.write_report(markdown(meta, results), meta, results, args.json, args.md)
    return results


if __name__ == "__main__":
    main()
