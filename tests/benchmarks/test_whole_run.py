"""benchmarks/whole_run.py on the tiny model (CPU): two real training runs, their summaries from
metrics.jsonl, and the joined comparison."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from in_process import run_module

from benchmarks import whole_run
from benchmarks.whole_run import main, parse_args, recipe, run_name, scaling, summarize, train_command


def test_summarize_reads_phases_from_the_timed_records():
    tokens = 100
    records = [
        {"step": 1, "elapsed_s": 10.0, "l0/mean": 500.0, "peak_mem_gib": 3.0},
        {"step": 5, "elapsed_s": 14.0, "l0/mean": 80.0, "peak_mem_gib": 5.0, "ffn/capacity_overflows": 18.0},
        {
            "step": 9,
            "elapsed_s": 16.0,
            "l0/mean": 50.0,
            "peak_mem_gib": 4.0,
            "compile/recompiles": 1.0,
            "ffn/capacity_overflows": 19.0,
        },
        {
            "step": 13,
            "elapsed_s": 17.0,
            "l0/mean": 30.0,
            "peak_mem_gib": 4.0,
            "val_loss": 2.5,
            "ffn_fallback/flips": 3.0,
            "compile/recompiles": 1.0,
            "ffn/capacity_overflows": 20.0,
            "ffn/capacity_overflows/heavy_rows": 2.0,
        },
    ]
    got = summarize(records, early_l0=60, steady_steps=8, tokens_per_step=tokens, target_l0=40.0)
    assert got["wall_s"] == 17.0 and got["first_step_s"] == 10.0 and got["wall_s_after_first_step"] == 7.0
    assert got["early_end_step"] == 9 and got["early_tokens_per_s"] == pytest.approx(8 * tokens / 6.0)
    assert got["steady_tokens_per_s"] == pytest.approx(8 * tokens / 3.0)
    assert got["peak_mem_gib"] == 5.0 and got["flips"] == 3.0 and got["recompiles"] == 1.0
    assert got["final_val_loss"] == 2.5
    # Overflowed layer-steps: in all, in the steady phase (steps 6-13: step 5's record holds step 5),
    # and by size.
    assert got["capacity_overflows"] == 20.0 and got["capacity_overflows_steady"] == 2.0
    assert got["capacity_overflows_by"] == {"heavy_rows": 2.0}
    # L0 against the target over the steady phase's records (steps 9 and 13: 50 and 30 of 40).
    assert got["target_l0"] == 40.0 and got["steady_l0_mean"] == pytest.approx(40.0)
    assert got["steady_l0_log_rms"] == pytest.approx(
        math.sqrt((math.log(1.25) ** 2 + math.log(0.75) ** 2) / 2)
    )
    with pytest.raises(ValueError, match=r"multiple of train\.log_every"):
        summarize(records, early_l0=60, steady_steps=7, tokens_per_step=tokens, target_l0=40.0)


@pytest.mark.slow
def test_two_tiny_runs_and_their_comparison(tmp_path, monkeypatch):
    # The trainer's command line runs in this process (the script times a run by its own records).
    monkeypatch.setattr(whole_run, "subprocess", SimpleNamespace(run=run_module))
    # Without the runs' own end-of-run figures (matplotlib: seconds a run; the comparison's plot stays).
    quiet = ["--override", "sparsity.plots=false"]
    # The tiny model's layers sit near half dense: a bound of 1.0 takes them off the dense fallback.
    sparse_from_step_2 = ["--override", "model.ffn_dense_above=1.0"]
    for impl in ("dense", "reference"):
        main(
            [
                "--tiny",
                *("--impl", impl, "--out-dir", str(tmp_path), "--run-dir", str(tmp_path / impl)),
                *quiet,
                *sparse_from_step_2,
            ]
        )
    dense = json.loads((tmp_path / "whole_run_dense.json").read_text())["results"][0]
    sparse = json.loads((tmp_path / "whole_run_reference.json").read_text())["results"][0]
    assert dense["steps"] == sparse["steps"] == 8
    # The same function on the same data and seed: the same losses up to rounding.
    assert sparse["final_val_loss"] == pytest.approx(dense["final_val_loss"], rel=1e-4)
    assert [p["step"] for p in sparse["series"]] == [1, 4, 8]
    assert all(p["l1_coeff"] > 0 for p in sparse["series"][1:])  # the controller's lambda kept
    assert sparse["dense_layers_at_end"] == 0 and sparse["series"][-1]["ffn_fallback/dense_layers"] == 0
    assert sparse["heldout_l0"] > 0 and len(sparse["heldout_layer_l0"]) == 4
    out = tmp_path / "run_tiny"
    result = main(
        [
            "--join",
            str(tmp_path / "whole_run_dense.json"),
            str(tmp_path / "whole_run_reference.json"),
            "--json",
            f"{out}.json",
            "--md",
            f"{out}.md",
            "--plot",
            f"{out}.png",
        ]
    )
    saved = json.loads(out.with_suffix(".json").read_text())["results"][0]
    assert len(saved["pairs"]) == 1 and saved["pairs"][0]["sparse"]["impl"] == "reference"
    for key in (
        "wall_speedup",
        "steady_speedup",
        "run_peak_mem_ratio",
        "recompiles",
        "final_loss_ratio",
        "heldout_l0",
    ):
        assert key in saved and key in result
    assert result["final_loss_ratio"] == pytest.approx(1.0, rel=1e-4)
    assert "wall clock after the first step" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0


def test_multi_gpu_runs_launch_fsdp2_with_one_gpus_batch_on_each():
    args = parse_args(["--impl", "auto", "--gpus", "2", "--out-dir", "/tmp/x", "--preset", "2b"])
    overrides = recipe(args, Path("/tmp/run"))
    assert "train.global_batch_size=16" in overrides and "train.micro_batch_size=8" in overrides
    assert "train.export=true" in overrides  # the gathered weights, for the held-out L0
    command = train_command(args, overrides)
    assert command[1:3] == ["-m", "accelerate.commands.launch"]
    config = Path(command[command.index("--config_file") + 1])
    assert config.is_file() and config.name == "fsdp2.yaml"
    assert command[command.index("--num_processes") + 1] == "2"
    sharded = parse_args(
        [
            "--impl",
            "auto",
            "--gpus",
            "4",
            "--out-dir",
            "/tmp/x",
            "--launch-arg=--fsdp_reshard_after_forward=false",
        ]
    )
    launched = train_command(sharded, overrides)
    assert launched.index("--fsdp_reshard_after_forward=false") < launched.index("sparse_llm.train")
    with pytest.raises(SystemExit):
        parse_args(
            ["--impl", "auto", "--out-dir", "/tmp/x", "--launch-arg=--fsdp_reshard_after_forward=false"]
        )
    assert run_name(args) == "whole_run_auto_2b_2gpu"
    again = parse_args(["--impl", "dense", "--out-dir", "/tmp/x", "--tag", "run2"])
    assert run_name(again) == "whole_run_dense_run2"  # a repeat of an impl: the A/A pair's second run
    one = parse_args(["--impl", "dense", "--out-dir", "/tmp/x"])
    assert train_command(one, [])[1:] == ["-m", "sparse_llm.train"] and run_name(one) == "whole_run_dense"


def test_a_steady_phase_that_starts_between_logged_steps_is_refused_before_the_run(capsys):
    # 450 steps logged every 20: step 350 has no record, which the summary found only after the run.
    with pytest.raises(SystemExit):
        parse_args(["--impl", "auto", "--out-dir", "/tmp/x", "--steps", "450", "--steady-steps", "100"])
    assert "multiple of the runs' log_every (20)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--impl", "auto", "--out-dir", "/tmp/x", "--steps", "400", "--steady-steps", "400"])
    assert parse_args(["--impl", "auto", "--out-dir", "/tmp/x", "--steps", "450", "--steady-steps", "50"])


def test_scaling_against_one_gpu_uses_the_medians_of_each_side():
    def pair(dense: float, sparse: float, gpus: int) -> dict:
        return {
            "dense": {"steady_tokens_per_s": dense, "gpus": gpus},
            "sparse": {"steady_tokens_per_s": sparse, "gpus": gpus},
            "steady_speedup": sparse / dense,
        }

    one_gpu = [pair(70.0, 84.0, 1), pair(74.0, 86.0, 1)]
    got = scaling([pair(140.0, 160.0, 2)], one_gpu)
    assert got["gpus"] == 2
    assert got["dense_scaling"] == pytest.approx(140 / 72) and got["sparse_scaling"] == pytest.approx(
        160 / 85
    )
    assert got["sparse_tokens_per_s_per_gpu"] == 80.0
    assert got["steady_speedup_one_gpu"] == pytest.approx((84 / 70 + 86 / 74) / 2)
    assert got["steady_speedup_change"] == pytest.approx(160 / 140 - got["steady_speedup_one_gpu"])


def _summary(impl: str, loss: float, steady: float) -> dict:
    """A run's summary with the fields the join reads."""
    return {
        "impl": impl,
        "preset": "1b",
        "steps": 800,
        "early_end_step": 100,
        "wall_s": 300.0,
        "wall_s_after_first_step": 250.0,
        "early_tokens_per_s": steady,
        "steady_tokens_per_s": steady,
        "peak_mem_gib": 40.0,
        "recompiles": 0,
        "flips": 0,
        "final_val_loss": loss,
        "heldout_l0": 30.0,
    }


@pytest.mark.parametrize(("sparse_loss", "exceeds"), [(3.03, True), (3.0012, False)])
def test_join_puts_the_aa_pair_beside_ab(tmp_path, sparse_loss, exceeds):
    runs = {
        "dense": ("dense", 3.0, 100.0),
        "dense_run2": ("dense", 3.0015, 98.0),
        "auto": ("auto", sparse_loss, 120.0),
    }
    for name, summary in runs.items():
        (tmp_path / f"{name}.json").write_text(
            json.dumps({"meta": {"commit": name}, "results": [_summary(*summary)]})
        )
    md = tmp_path / "joined.md"
    files = [str(tmp_path / f"{name}.json") for name in runs]
    result = main(["--join", files[0], files[2], "--aa", files[1], "--md", str(md)])
    aa = result["pairs"][0]["aa"]
    assert aa["final_loss_ratio"] == pytest.approx(1.0005) and aa["steady_speedup"] == pytest.approx(0.98)
    assert aa["loss_ab_exceeds_aa"] is exceeds and result["aa_final_loss_ratio"] == pytest.approx(1.0005)
    line = next(line for line in md.read_text().splitlines() if line.startswith("A/A"))
    assert "commit `dense_run2`" in line
    assert (
        "more than the runs' own nondeterminism" if exceeds else "within the runs' own nondeterminism"
    ) in line
    with pytest.raises(SystemExit, match="one second dense run per pair"):
        main(["--join", files[0], files[2], "--aa", files[1], files[1]])


def test_a_multi_gpu_run_records_whether_fsdp2_keeps_its_parameters_for_the_backward(tmp_path):
    # The setting as the run's trainer recorded it (run_info.json), whatever launched it.
    for parallel, want in (
        ({"mode": "fsdp2", "reshard_after_forward": False, "prefetch": 1}, False),
        ({"mode": "fsdp2", "reshard_after_forward": True, "prefetch": 1}, True),
        ({"mode": "ddp"}, None),
    ):
        (tmp_path / "run_info.json").write_text(json.dumps({"world_size": 2, "parallel": parallel}))
        assert whole_run.reshard_after_forward(tmp_path) is want
    runs = {"dense": ("dense", 3.0, 100.0, True), "auto": ("auto", 3.0, 120.0, False)}
    for name, (impl, loss, steady, resharded) in runs.items():
        summary = {**_summary(impl, loss, steady), "gpus": 2, "reshard_after_forward": resharded}
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": {}, "results": [summary]}))
    files = [str(tmp_path / f"{name}.json") for name in runs]
    with pytest.raises(SystemExit, match="differs from its dense run in reshard_after_forward"):
        main(["--join", *files])
    kept = json.loads((tmp_path / "dense.json").read_text())
    kept["results"][0]["reshard_after_forward"] = False
    (tmp_path / "dense.json").write_text(json.dumps(kept))
    md = tmp_path / "joined.md"
    main(["--join", *files, "--md", str(md)])
    assert "2 GPUs (FSDP2, parameters kept from the forward to the backward" in md.read_text()
    # A run from before the setting was recorded joins a new one; a run on other GPUs does not.
    older = {**_summary("dense", 3.0, 100.0), "gpus": 2}
    (tmp_path / "older.json").write_text(json.dumps({"meta": {}, "results": [older]}))
    main(["--join", str(tmp_path / "older.json"), files[1]])
    one_gpu = _summary("auto", 3.0, 120.0)  # no `gpus`: one GPU, as the oldest runs were
    (tmp_path / "one.json").write_text(json.dumps({"meta": {}, "results": [one_gpu]}))
    with pytest.raises(SystemExit, match="differs from its dense run in gpus: 1 vs 2"):
        main(["--join", files[0], str(tmp_path / "one.json")])
    with pytest.raises(SystemExit, match="differs from its dense run in gpus"):  # the A/A run too
        main(["--join", *files, "--aa", str(tmp_path / "one.json")])


def test_each_run_compiles_from_empty_caches_of_its_own(tmp_path, monkeypatch):
    """The trainer's Inductor and Triton caches are a fresh directory a run, gone after it: a run
    never compiles from the graphs of the run before it on the machine."""
    seen = []

    def record(command, check, env):
        cache_dirs = (Path(env["TORCHINDUCTOR_CACHE_DIR"]), Path(env["TRITON_CACHE_DIR"]))
        seen.append((cache_dirs, [d.parent.is_dir() and not any(d.parent.iterdir()) for d in cache_dirs]))
        raise RuntimeError("stop after the launch")

    monkeypatch.setattr(whole_run, "subprocess", SimpleNamespace(run=record))
    for name in ("a", "b"):
        with pytest.raises(RuntimeError, match="stop after the launch"):
            main(["--tiny", "--impl", "dense", "--out-dir", str(tmp_path), "--run-dir", str(tmp_path / name)])
    (first, first_empty), (second, _) = seen
    assert first_empty == [True, True] and first[0].parent == first[1].parent
    assert first[0].parent != second[0].parent and not first[0].parent.exists()
