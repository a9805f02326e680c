"""benchmarks.l0_tracking: whole runs' L0 against their target, from their summaries."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import l0_tracking

RECIPE = ["sparsity=target", "sparsity.target_l0=30", "sparsity.l1_coeff=1e-3", "sparsity.l1_warmup_end=100"]


def summary(l0s: list[float], extra: list[str] = ()) -> dict:
    """A whole run's summary logged at steps 20, 40, ...: L0 and lambda at each."""
    series = [{"step": 1, "l0/mean": 2800.0, "l1_coeff": 0.0}]
    series += [{"step": 20 * (i + 1), "l0/mean": v, "l1_coeff": 1e-4 * (i + 1)} for i, v in enumerate(l0s)]
    return {
        "steps": series[-1]["step"],
        "series": series,
        "overrides": RECIPE + list(extra),
        "peak_mem_gib": 23.0,
        "capacity_overflows": 7.0,
        "heldout_l0": 31.0,
        "final_val_loss": 3.0,
        "impl": "auto",
    }


def write(path: Path, s: dict) -> Path:
    path.write_text(json.dumps({"meta": {"device": "H200", "commit": "abc1234"}, "results": [s]}))
    return path


def test_the_table_from_two_runs(tmp_path: Path):
    # Logged at steps 20-180; the ramp ends at step 100; steady: the last 40 steps (140, 180].
    base = write(tmp_path / "a.json", summary([900.0, 200.0, 60.0, 40.0, 35.0, 12.0, 33.0, 27.0, 33.0]))
    fast = write(
        tmp_path / "b.json",
        summary([900.0, 200.0, 60.0, 40.0, 35.0, 25.0, 30.0, 30.0, 30.0], ["sparsity.controller.gain=0.15"]),
    )
    md, out, png = tmp_path / "t.md", tmp_path / "t.json", tmp_path / "t.png"
    runs = ["--run", "base", str(base), "--run", "gain", str(fast), "--steady-steps", "40"]
    rows = l0_tracking.main([*runs, "--md", str(md), "--json", str(out), "--plot", str(png)])
    a, b = rows
    assert a["lowest_l0_after_ramp"] == 12.0 and b["lowest_l0_after_ramp"] == 25.0
    assert a["steady_l0_mean"] == pytest.approx(30.0) and b["steady_l0_mean"] == pytest.approx(30.0)
    assert a["steady_l0_log_rms"] == pytest.approx(math.sqrt((math.log(0.9) ** 2 + math.log(1.1) ** 2) / 2))
    assert b["steady_l0_log_rms"] == 0.0
    assert a["l1_coeff_min_after_ramp"] == pytest.approx(6e-4)
    assert a["l1_coeff_max_after_ramp"] == pytest.approx(9e-4)
    assert b["settings"]["controller.gain"] == "0.15" and "controller.gain" not in a["settings"]
    assert a["settings"]["l1_coeff"] == b["settings"]["l1_coeff"] == "0.001"
    text = md.read_text()
    # Only the setting the runs differ in gets a column; the run without it shows the default.
    assert "| controller.gain |" in text and "| l1_coeff |" not in text
    assert "| base | auto | `abc1234` | default | 12.0 |" in text
    assert json.loads(out.read_text())["results"][1]["label"] == "gain"
    assert png.stat().st_size > 0


def test_the_last_override_of_a_key_is_the_setting_over_the_resolved_config():
    overrides = ["sparsity.l1_coeff=1e-3", "train.lr=1", "sparsity.l1_coeff=3e-4"]
    assert l0_tracking.settings(overrides) == {"l1_coeff": "0.0003"}
    resolved = {"l1_coeff": 1e-3, "controller": {"gain": 0.15, "per_layer": False}}
    assert l0_tracking.settings(overrides, resolved) == {
        "l1_coeff": "0.0003",
        "controller.gain": "0.15",
        "controller.per_layer": "false",
    }


def test_runs_of_other_targets_or_none_are_refused(tmp_path: Path):
    a = write(tmp_path / "a.json", summary([40.0] * 8))
    other = summary([40.0] * 8, ["sparsity.target_l0=60"])
    b = write(tmp_path / "b.json", other)
    with pytest.raises(SystemExit, match="different targets"):
        l0_tracking.main(["--run", "a", str(a), "--run", "b", str(b), "--steady-steps", "40"])
    fixed = summary([40.0] * 8)
    fixed["overrides"] = ["sparsity.l1_coeff=1e-3"]
    c = write(tmp_path / "c.json", fixed)
    with pytest.raises(ValueError, match="not a target-L0 run"):
        l0_tracking.main(["--run", "c", str(c)])


def test_a_run_of_a_joined_pair(tmp_path: Path):
    dense, sparse = summary([40.0] * 8), summary([30.0] * 8)
    pair = {"dense": {"commit": "d"}, "sparse": {"commit": "s"}}
    joined = {"meta": {"pairs": [pair]}, "results": [{"pairs": [{"dense": dense, "sparse": sparse}]}]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(joined))
    meta, got = l0_tracking.load_run(f"{path}#sparse")
    assert meta == {"commit": "s"} and got["series"] == sparse["series"]
    with pytest.raises(SystemExit, match="#dense or"):
        l0_tracking.load_run(str(path))
