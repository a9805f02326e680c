"""`sparse-llm-eval` (or `python -m sparse_llm.eval`): lm-evaluation-harness tasks on trained models.

    sparse-llm-eval runs/my_run --tasks paper                     # the paper's suite (hub data)
    sparse-llm-eval runs/my_run/export --tasks offline            # the shipped tasks, no download
    sparse-llm-eval runs/a runs/b --tasks arc_easy,piqa --limit 200
    sparse-llm-eval --compare runs/sparse runs/dense              # their results side by side
    sparse-llm-eval --compare runs/sparse runs/dense --tasks quick   # evaluate first, then compare

A model is a run directory (its latest checkpoint), a checkpoints/step_* directory or an export.
--tasks takes lm-eval task names and presets (configs/eval/: paper, quick, offline), comma- or
space-separated; a preset brings its example limit and shots unless --limit / --num-fewshot say
otherwise. Each model is scored through the project's inference path (sparse_llm.eval.lm: the
prefill FFN of a Generator, `fastest` by default); its results go to eval/<step>.json and
eval/<step>.md in its run directory (an export outside any run: <export>/eval/export.*), merged
with earlier tasks of the same step, and the table is printed. --compare writes
downstream_compare.md, .json and .png (tasks x runs, with each run's sparsity and L0) into --out.
Errors are one line on stderr: exit code 2, or 4 for a damaged model (a weights file that is
truncated or does not match its recorded SHA-256, a config that does not parse, weights of another
shape than the config's; the line names the file), found before any model is evaluated.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparse_llm.eval.harness import LMEvalMissing
from sparse_llm.eval.results import EvalTarget
from sparse_llm.inference import FASTEST
from sparse_llm.inference.calibrate import CHOICES as FFN_CHOICES
from sparse_llm.inference.loading import DamagedModel, inspect_model

EXIT_DAMAGED = 4  # a model's files are damaged or disagree (sparse_llm.inference.loading)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sparse-llm-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("models", nargs="+", type=Path, help="run, checkpoint or export directories")
    p.add_argument("--tasks", nargs="+", default=[], help="lm-eval task names or presets")
    p.add_argument("--compare", action="store_true", help="one table and bar plot of the models' results")
    p.add_argument("--out", type=Path, default=Path("."), help="where --compare writes its files")
    p.add_argument("--limit", type=at_least(1), default=None, help="examples per task (default: all)")
    p.add_argument("--num-fewshot", type=at_least(0), default=None, help="default: each task's own")
    p.add_argument("--batch-size", type=at_least(1), default=32, help="sequences per scoring forward")
    p.add_argument("--max-batch-tokens", type=at_least(1), default=32768, help="tokens per scoring forward")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    p.add_argument("--prefill-ffn", default=FASTEST, choices=FFN_CHOICES, help="the FFN that scores")
    p.add_argument("--decode-ffn", default=FASTEST, choices=FFN_CHOICES, help="generation tasks' decode")
    p.add_argument("--compile", action="store_true", help="torch.compile the scoring forward")
    p.add_argument("--verbose", action="store_true", help="lm-eval's warnings too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except DamagedModel as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_DAMAGED
    except (ValueError, FileNotFoundError, NotADirectoryError, LMEvalMissing) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from sparse_llm.eval import compare, harness, results

    names = [name for entry in args.tasks for name in entry.split(",") if name]
    if not names and not args.compare:
        raise ValueError("name the tasks to run: --tasks <lm-eval task names or presets>")
    # Every path and task is checked before a model is loaded.
    targets = [results.locate(path) for path in args.models]
    if names:
        for target in targets:  # a damaged model: one line before any evaluation
            inspect_model(target.model)
        harness.require_lm_eval()
        tasks = harness.expand_tasks(names)
        manager = harness.task_manager(tasks)
        harness.check_tasks(tasks, manager)
        harness.fetch_task_data(tasks, manager, args.verbose)
        # One preset named: its limit and shots, where the command line sets none.
        chosen = [preset for name, preset in harness.presets().items() if name in names]
        preset = chosen[0] if len(chosen) == 1 else None
        limit = args.limit if args.limit is not None or preset is None else preset.limit
        shots = args.num_fewshot if args.num_fewshot is not None or preset is None else preset.num_fewshot
        for target in targets:
            _evaluate(target, tasks, manager, limit, shots, args)
    if args.compare:
        comparison = compare.compare(targets)
        written = compare.write_comparison(comparison, args.out)
        print(compare.to_markdown(comparison))
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _evaluate(
    target: EvalTarget,
    tasks: list[str],
    manager: Any,
    limit: int | None,
    shots: int | None,
    args: argparse.Namespace,
) -> None:
    from sparse_llm.eval import harness, results
    from sparse_llm.eval.lm import SparseLM

    lm = SparseLM.from_pretrained(
        target.model,
        args.device,
        args.dtype,
        args.prefill_ffn,
        args.decode_ffn,
        args.compile,
        batch_size=args.batch_size,
        max_batch_tokens=args.max_batch_tokens,
    )
    record = harness.evaluate(lm, tasks, manager, limit=limit, num_fewshot=shots, verbose=args.verbose)
    json_path, md_path = results.write_result(target, record)
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path}")
