"""Downstream evaluation wall time: the shipped tasks through our lm-eval model class (the sparse
kernels) against lm-eval's own `hf` model on the export, same weights, same batch size.

    # 1b weights at L0 30 (benchmarks/sparse_weights.py --preset 1b --target-l0 30 --out runs/sparse_1b)
    python -m benchmarks.downstream_eval --model runs/sparse_1b --json downstream_eval.json --md downstream_eval.md
    python -m benchmarks.downstream_eval --tiny --out /tmp/bench      # CPU, toy size (what the test runs)

Each variant evaluates the tasks (default: the shipped offline ones, python_completion and
python_perplexity, sparse_llm/eval/tasks) --warmup times untimed, then --reps times timed: `hf`
(lm_eval.models.huggingface.HFLM: transformers' LlamaForCausalLM on the export) and ours
(sparse_llm.eval.lm.SparseLM) with each --ffn (the scoring FFN: dense, cuda, fastest, ...). The
table gives the median wall time of a whole evaluation, the part of it spent in the model's
request calls (lm-eval's task building and metrics are the rest), each against hf, the task
metrics, and the agreement with hf on the same requests: the largest difference of a request's
log-likelihood and the share of documents whose per-document score (acc, acc_norm) is the same.
L0 is measured on the tasks' own text (the python_perplexity documents) with the loaded weights.
A run directory (or its latest checkpoint) without an export gets one first, in the run's export/
(the trainer's place for it), which later calls reuse.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from sparse_llm.config import ModelConfig
from sparse_llm.eval import harness, results
from sparse_llm.eval.tasks import SHIPPED_TASKS, TASK_DIR
from sparse_llm.inference import load_model
from sparse_llm.inference.calibrate import CHOICES as FFN_CHOICES
from sparse_llm.inference.loading import resolve_device, resolve_dtype
from sparse_llm.model.hf_export import export_hf
from sparse_llm.run_files import CHECKPOINTS_DIR, EXPORT_DIR, latest_checkpoint

REQUEST_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--model", type=Path, help="run, checkpoint or export directory")
    p.add_argument("--tiny", action="store_true", help="train a toy model on CPU first (a smoke test)")
    p.add_argument("--tasks", nargs="+", default=list(SHIPPED_TASKS), help="lm-eval task names or presets")
    p.add_argument(
        "--ffn",
        nargs="+",
        default=None,
        choices=FFN_CHOICES,
        help="ours: default dense and the kernels (their reference where they cannot run)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="sequences per forward, both models")
    p.add_argument("--limit", type=int, default=None, help="examples per task")
    p.add_argument("--reps", type=int, default=3, help="timed evaluations per variant (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed evaluations per variant first")
    p.add_argument("--compile", action="store_true", help="torch.compile our scoring forward")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="both models: auto (bf16 on CUDA, fp32 on CPU)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="writes downstream_eval.json / .md here, and the --tiny model (default for that: "
        "runs/downstream_eval)",
    )
    args = p.parse_args(argv)
    if args.model is None and not args.tiny:
        p.error("give --model <run, checkpoint or export directory> (or --tiny)")
    return args


def tiny_model(out: Path) -> Path:
    """A toy model with some sparsity, trained for a few seconds on CPU (benchmarks.common.sparsify)."""
    return common.sparsify(
        out / "tiny_run",
        common.TINY_MODEL,
        steps=20,
        l1_coeff=1e-3,
        lr=3e-3,
        seq_len=64,
        batch=8,
        data={"max_documents": 200},
        train={"device": "cpu"},
    )


def export_for_hf(model_path: Path) -> Path:
    """The export `hf` loads: the model's own, or its run's `export/` (written there first if the
    run has none, as the trainer would have)."""
    target = results.locate(model_path)
    if target.source == "export":
        return target.model
    if latest_checkpoint(target.run_dir / CHECKPOINTS_DIR) != target.model:
        raise ValueError(f"{model_path}: the run's export holds its latest checkpoint; pass that or the run")
    export = target.run_dir / EXPORT_DIR
    if not (export / "config.json").is_file():
        loaded = load_model(target.model, device="cpu", dtype="float32")
        export_hf(loaded.model, loaded.tokenizer, export)
    return export


@torch.no_grad()
def tasks_l0(model_path: Path, device: torch.device, dtype: torch.dtype) -> tuple[float, ModelConfig]:
    """Mean active FFN units per token (over layers and tokens) on the python_perplexity documents,
    and the model's config."""
    loaded = load_model(model_path, device, dtype)
    docs = [
        json.loads(line)["text"] for line in (TASK_DIR / "python_perplexity.jsonl").read_text().splitlines()
    ]
    counts = []
    for text in docs:
        ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"][
            :, : loaded.model.config.max_position_embeddings
        ]
        counts.append(common.active_units_per_token(loaded.model, ids.to(device)).float())
    return torch.cat(counts, dim=1).mean().item(), loaded.model.config


def timed_requests(lm: Any) -> list[float]:
    """Wrap the LM's request methods (on the instance, where lm-eval's evaluator looks them up) so
    that each call's seconds are appended to the returned list."""
    spent: list[float] = []

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = method(*args, **kwargs)
            spent.append(time.perf_counter() - start)  # the results are on the host: synchronised
            return out

        return timed

    for name in REQUEST_METHODS:
        setattr(lm, name, wrap(getattr(lm, name)))
    return spent


def run_variant(lm: Any, tasks: list[str], manager: Any, args: argparse.Namespace) -> dict[str, Any]:
    spent = timed_requests(lm)
    walls, model_times, output = [], [], None
    for rep in range(args.warmup + args.reps):
        spent.clear()
        start = time.perf_counter()
        output = harness.run_lm_eval(lm, tasks, manager, limit=args.limit, log_samples=True)
        if rep >= args.warmup:
            walls.append(time.perf_counter() - start)
            model_times.append(sum(spent))
    return {
        "wall_s": statistics.median(walls),
        "model_s": statistics.median(model_times),
        "tasks": harness.task_results(output),
        "_samples": output["samples"],
    }


def request_scores(samples: dict[str, list[dict]]) -> dict[tuple, float]:
    """(task, document, request) -> the request's log-likelihood."""
    scores = {}
    for task, docs in samples.items():
        for doc in docs:
            for k, response in enumerate(doc["resps"]):
                first = response[0]
                scores[(task, doc["doc_id"], k)] = float(
                    first[0] if isinstance(first, (tuple, list)) else first
                )
    return scores


def doc_scores(samples: dict[str, list[dict]]) -> dict[tuple, float]:
    """(task, document, metric) -> the document's accuracy-type score."""
    return {
        (task, doc["doc_id"], metric): doc[metric]
        for task, docs in samples.items()
        for doc in docs
        for metric in ("acc", "acc_norm")
        if metric in doc
    }


def agreement(row: dict[str, Any], hf: dict[str, Any]) -> None:
    ours, theirs = request_scores(row["_samples"]), request_scores(hf["_samples"])
    row["max_abs_ll_diff"] = max(abs(ours[k] - theirs[k]) for k in theirs)
    mine, base = doc_scores(row["_samples"]), doc_scores(hf["_samples"])
    row["same_doc_scores"] = sum(mine[k] == base[k] for k in base) / len(base) if base else None
    row["wall_vs_hf"] = hf["wall_s"] / row["wall_s"]
    row["model_vs_hf"] = hf["model_s"] / row["model_s"]


def markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    metrics = [(t, m) for t, r in rows[0]["tasks"].items() for m in r["metrics"]]
    lines = [
        f"# Downstream evaluation: ours against lm-eval's hf on {report['model']}",
        "",
        f"{report['device']}, {report['dtype']}, commit `{report['commit']}`, {report['date']}, "
        f"torch {report['torch']}, lm-eval {report['lm_eval']}; L0 on the tasks' text "
        f"{report['l0']:.1f} of {report['hidden']} units; batch {report['batch_size']}, "
        f"median of {report['reps']} evaluations after {report['warmup']} warm-up",
        "",
        "| model | FFN | wall s | vs hf | model s | vs hf | "
        + " | ".join(f"{t} {m}" for t, m in metrics)
        + " | max abs dlogL vs hf | same doc scores |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(metrics) + "---:|---:|",
    ]
    for row in rows:
        cells = [
            row["model"],
            row["ffn"],
            f"{row['wall_s']:.2f}",
            f"{row.get('wall_vs_hf', 1.0):.2f}x",
            f"{row['model_s']:.2f}",
            f"{row.get('model_vs_hf', 1.0):.2f}x",
            *(f"{row['tasks'][t]['metrics'][m]:.4g}" for t, m in metrics),
            "–" if "max_abs_ll_diff" not in row else f"{row['max_abs_ll_diff']:.2e}",
            "–" if row.get("same_doc_scores") is None else f"{row['same_doc_scores']:.1%}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from lm_eval.models.huggingface import HFLM

    from sparse_llm.eval.lm import SparseLM

    out = args.out or Path("runs/downstream_eval")
    out.mkdir(parents=True, exist_ok=True)
    model_path = tiny_model(out) if args.tiny and args.model is None else args.model
    device = resolve_device("cpu" if args.tiny else args.device)
    dtype = resolve_dtype(args.dtype, device)
    l0, cfg = tasks_l0(model_path, device, dtype)
    impls = args.ffn or ["dense", common.sparse_path("prefill", cfg, device, dtype)[0]]
    tasks = harness.expand_tasks(args.tasks)
    manager = harness.task_manager(tasks)
    harness.check_tasks(tasks, manager)
    export = export_for_hf(model_path)

    dtype_name = str(dtype).removeprefix("torch.")
    hf_lm = HFLM(pretrained=str(export), device=str(device), dtype=dtype_name, batch_size=args.batch_size)
    hf = {
        "model": "hf (transformers, lm-eval's HFLM)",
        "ffn": "dense",
        **run_variant(hf_lm, tasks, manager, args),
    }
    del hf_lm
    rows = [hf]
    for impl in impls:
        lm = SparseLM.from_pretrained(
            model_path, device, dtype, prefill_ffn=impl, compile=args.compile, batch_size=args.batch_size
        )
        row = {
            "model": "ours (SparseLM)",
            "ffn": lm.model.ffn_plan.prefill.impl,
            **run_variant(lm, tasks, manager, args),
        }
        row["ffn_asked"] = impl
        agreement(row, hf)
        rows.append(row)
        del lm
    import lm_eval

    report = common.run_meta(device) | {
        "model": str(model_path),
        "export": str(export),
        "dtype": dtype_name,
        "lm_eval": lm_eval.__version__,
        "l0": l0,
        "hidden": cfg.intermediate_size,
        "batch_size": args.batch_size,
        "reps": args.reps,
        "warmup": args.warmup,
        "tasks": tasks,
        "limit": args.limit,
        "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
    }
    json_path = args.json or (out / "downstream_eval.json" if args.out else None)
    md_path = args.md or (out / "downstream_eval.md" if args.out else None)
    meta = {k: v for k, v in report.items() if k != "rows"}
    common.write_report(markdown(report), meta, report["rows"], json_path, md_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
