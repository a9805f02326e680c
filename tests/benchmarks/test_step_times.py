"""benchmarks/step_times.py: a run's logged steps timed one by one, the slow ones named by what
changed in them."""

import json

import pytest

from benchmarks import step_times


def _metrics(tmp_path, seconds: list[float], graphs: list[int], overflows: list[int], every: int = 1):
    """A metrics.jsonl logging every `every` steps, with the scalars step_times reads; the trainer
    also writes records without elapsed_s (evaluation), which must be skipped."""
    lines, elapsed = [], 0.0
    for i, (s, g, o) in enumerate(zip(seconds, graphs, overflows, strict=True)):
        elapsed += s
        record = {"step": (i + 1) * every, "elapsed_s": elapsed, "l0/mean": 30.0, "compile/graphs": g}
        record |= {"ffn/capacity_overflows": o, "ffn_fallback/dense_layers": 0.0}
        lines.append(json.dumps(record))
    lines.append(json.dumps({"step": len(seconds) * every, "val_loss": 3.0}))
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_slow_steps_are_named_by_what_changed_in_them(tmp_path):
    seconds = [10.0, 0.2, 0.2, 3.5, 0.2, 0.5, 0.25, 0.2]
    graphs = [2, 2, 2, 3, 3, 3, 3, 3]
    overflows = [0, 0, 0, 1, 1, 2, 3, 3]  # step 4 compiles and overflows: counted as the compile
    md = tmp_path / "steps.md"
    result = step_times.main([str(_metrics(tmp_path, seconds, graphs, overflows)), "--md", str(md)])
    assert result["median_step_s"] == pytest.approx(0.2)
    assert [(s["step"], s["cause"]) for s in result["slow_steps"]] == [
        (1, "first step (first compile)"),
        (4, "graph compiled"),
        (6, "record overflowed (rebuilt)"),
    ]
    assert result["excess_s_by_cause"]["graph compiled"] == pytest.approx(3.3)
    # Steps 6 and 7 overflowed (7 under the slow threshold): 0.3 + 0.05 over the median.
    assert result["overflow_steps"] == 2 and result["overflow_steps_excess_s"] == pytest.approx(0.35)
    assert "| 4 | 3.500 |" in md.read_text()


def test_a_sparser_log_gives_seconds_per_step(tmp_path):
    rows = step_times.step_rows(
        [
            json.loads(line)
            for line in _metrics(tmp_path, [4.0, 2.0], [2, 2], [0, 0], every=10).read_text().splitlines()
        ]
    )
    assert [(r["step"], r["seconds"]) for r in rows] == [(10, 0.4), (20, 0.2)]


def test_missing_or_untimed_metrics_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        step_times.main([str(tmp_path / "none.jsonl")])
    untimed = tmp_path / "untimed.jsonl"
    untimed.write_text(json.dumps({"step": 1, "val_loss": 3.0}) + "\n")
    with pytest.raises(SystemExit, match="no timed step"):
        step_times.main([str(untimed)])
