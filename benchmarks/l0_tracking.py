"""Whole runs' L0 against their target, side by side: how closely an L1 controller setting holds it.

    python -m benchmarks.l0_tracking --run default whole_run_auto.json \
      --run "gain 0.15" whole_run_auto_gain015.json --json tracking.json --md tracking.md --plot tracking.png

Each `--run` is a label and a whole run's JSON (`benchmarks.whole_run`), or a joined pair's
(`whole_run --join`) with `#dense` or `#sparse` after its path for one of its first pair. The table gives each run's
sparsity settings (its `sparsity.*` overrides, the last of each key), then from its logged windows:
L0's lowest after the L1 ramp (a collapse towards no active units, which the controller answers by
cutting lambda, and the rebound after it), L0's mean and its RMS log error over the steady phase (the
run's last `--steady-steps`), lambda's range after the ramp; then the run's peak memory, overflowed
layer-steps, held-out L0 and held-out loss. Runs made at once on one GPU share it: compare their L0,
memory and loss here, never their tokens/s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.whole_run import l0_tracking

SETTING_PREFIX = "sparsity."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument(
        "--run",
        nargs=2,
        action="append",
        required=True,
        metavar=("LABEL", "WHOLE_RUN_JSON"),
        help="one run: its label and whole-run JSON",
    )
    p.add_argument("--steady-steps", type=int, default=400, help="the steady phase: each run's last N steps")
    p.add_argument("--plot", type=Path, default=None, help="L0 and lambda over the steps (PNG)")
    return p.parse_args(argv)


def load_run(spec: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run's meta and summary from its JSON, or from a joined pair's: PATH#dense or PATH#sparse."""
    path, _, side = spec.partition("#")
    data = json.loads(Path(path).read_text())
    summary = data["results"][0]
    if "pairs" not in summary:
        return data["meta"], summary
    if side not in ("dense", "sparse"):
        raise SystemExit(f"{path} joins a dense and a sparse run: give {path}#dense or {path}#sparse")
    return data["meta"]["pairs"][0][side], summary["pairs"][0][side]


def _text(value: Any) -> str:
    """A setting as the table shows it: one spelling whether from YAML or an override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    try:
        return format(float(value), "g")
    except (TypeError, ValueError):
        return str(value)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = _text(value)
    return flat


def settings(overrides: list[str], resolved: dict[str, Any] | None = None) -> dict[str, str]:
    """The run's sparsity settings, key to value: its resolved `sparsity` config where the summary
    keeps it (runs since it did), else only its overrides, the last of each key (Hydra's)."""
    found = _flatten(resolved or {})
    for override in overrides:
        key, _, value = override.partition("=")
        if key.startswith(SETTING_PREFIX):
            found[key.removeprefix(SETTING_PREFIX)] = _text(value)
    return found


def track(label: str, summary: dict[str, Any], steady_steps: int) -> dict[str, Any]:
    """One run's row: its settings and how its L0 and lambda went after the ramp."""
    chosen = settings(summary["overrides"], summary.get("sparsity"))
    if "target_l0" not in chosen:
        raise ValueError(f"run {label!r} has no sparsity.target_l0 override: not a target-L0 run")
    target = float(chosen["target_l0"])
    ramp_end = int(chosen.get("l1_warmup_end", 0))
    series = summary["series"]
    after_ramp = [p for p in series if p["step"] > ramp_end]
    steady = l0_tracking(series, target, summary["steps"] - steady_steps)
    coeffs = [p["l1_coeff"] for p in after_ramp if p.get("l1_coeff")]
    return {
        "label": label,
        "settings": chosen,
        "target_l0": target,
        "ramp_end": ramp_end,
        "lowest_l0_after_ramp": min(p["l0/mean"] for p in after_ramp),
        "steady_l0_mean": steady["mean"],
        "steady_l0_log_rms": steady["log_rms"],
        "l1_coeff_min_after_ramp": min(coeffs) if coeffs else None,
        "l1_coeff_max_after_ramp": max(coeffs) if coeffs else None,
        "peak_mem_gib": summary["peak_mem_gib"],
        "capacity_overflows": summary.get("capacity_overflows"),
        "heldout_l0": summary.get("heldout_l0"),
        "final_val_loss": summary.get("final_val_loss"),
        "impl": summary["impl"],
        "series": [{k: p.get(k) for k in ("step", "l0/mean", "l1_coeff")} for p in series],
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]], metas: list[dict[str, Any]], steady_steps: int) -> str:
    # Only the settings some run changes from another's are worth a column each.
    keys = sorted({k for r in rows for k in r["settings"]})
    varied = [k for k in keys if len({r["settings"].get(k) for r in rows}) > 1]
    head = ["run", "impl", "commit", *varied, "lowest L0 after the ramp", f"L0, last {steady_steps} steps"]
    head += [
        "RMS log(L0/target)",
        "lambda after the ramp",
        "peak GiB",
        "overflows",
        "held-out L0",
        "held-out loss",
    ]
    lines = [
        f"# L0 against its target: {metas[0].get('device')}",
        "",
        f"Target L0 {rows[0]['target_l0']:g}; every figure from the runs' logged windows (20 steps each "
        "in the whole-run recipe). A setting's `default`: the trainer's default at the run's commit "
        "(its summary keeps only its overrides). Runs made at once on one GPU: their tokens/s are not "
        "figures.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r, meta in zip(rows, metas, strict=True):
        coeff = (
            f"{r['l1_coeff_min_after_ramp']:.1e} - {r['l1_coeff_max_after_ramp']:.1e}"
            if r["l1_coeff_min_after_ramp"] is not None
            else "-"
        )
        cells = [
            r["label"],
            r["impl"],
            f"`{meta.get('commit')}`",
            *(r["settings"].get(k, "default") for k in varied),
        ]
        cells += [
            _fmt(r["lowest_l0_after_ramp"], ".1f"),
            _fmt(r["steady_l0_mean"], ".1f"),
            _fmt(r["steady_l0_log_rms"], ".3f"),
            coeff,
            _fmt(r["peak_mem_gib"], ".2f"),
            _fmt(r["capacity_overflows"], ".0f"),
            _fmt(r["heldout_l0"], ".2f"),
            _fmt(r["final_val_loss"], ".4f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l0, ax_coeff) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for i, r in enumerate(rows):
        # After the ramp only, on a linear axis: the first steps' thousands would flatten the target's band.
        pts = [p for p in r["series"] if p["step"] > r["ramp_end"]]
        steps = [p["step"] for p in pts]
        ax_l0.plot(steps, [p["l0/mean"] for p in pts], color=f"C{i}", label=r["label"])
        coeff = [(p["step"], p["l1_coeff"]) for p in pts if p.get("l1_coeff")]
        if coeff:
            ax_coeff.plot(*zip(*coeff, strict=True), color=f"C{i}", label=r["label"])
    ax_l0.axhline(rows[0]["target_l0"], color="black", linestyle=":", linewidth=0.8, label="target")
    ax_l0.set_ylabel("active units per token (L0)")
    ax_l0.legend(fontsize="small", ncol=2)
    ax_coeff.set_yscale("log")
    ax_coeff.set_ylabel("L1 coefficient")
    ax_coeff.set_xlabel("step")
    fig.suptitle("L0 against its target, and the coefficient driving it")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    loaded = [(label, *load_run(spec)) for label, spec in args.run]
    rows = [track(label, summary, args.steady_steps) for label, _, summary in loaded]
    targets = {r["target_l0"] for r in rows}
    if len(targets) > 1:
        raise SystemExit(f"the runs have different targets ({sorted(targets)}): compare runs of one target")
    metas = [meta for _, meta, _ in loaded]
    text = markdown(rows, metas, args.steady_steps)
    common.write_report(text, {"runs": metas, "steady_steps": args.steady_steps}, rows, args.json, args.md)
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
