"""benchmarks/collectives.py: FSDP2's units counted from the model, the collectives timed over two
CPU processes (gloo), a step's total from the rows, NCCL's transports from its log, and the step
times read from whole_run JSONs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import collectives, common


def test_the_units_are_the_models_layers_and_the_rest():
    units = collectives.unit_params(dict(common.TINY_MODEL))
    d, h = common.TINY_MODEL["hidden_size"], common.TINY_MODEL["intermediate_size"]
    # A layer: q, k, v, o (no grouped keys in the tiny model), gate, up, down, two norms.
    assert units == {"layer": 4 * d * d + 3 * d * h + 2 * d, "root": units["root"], "layers": 2}
    assert units["root"] == 49152 * d + d  # tied embeddings (the default vocabulary) and the final norm
    assert collectives.shard_numel(10, 4) == 3 and collectives.shard_numel(12, 4) == 3


def test_a_steps_collectives_add_up_by_unit():
    rows = [
        {"unit": "layer", "collective": "all_gather", "ms": 1.0},
        {"unit": "layer", "collective": "reduce_scatter", "ms": 3.0},
        {"unit": "root", "collective": "all_gather", "ms": 10.0},
        {"unit": "root", "collective": "reduce_scatter", "ms": 20.0},
    ]
    units = {"layer": 0, "root": 0, "layers": 18}
    assert collectives.step_collectives_ms(rows, units) == 18 * (2 * 1 + 3) + 2 * 10 + 20
    assert collectives.step_collectives_ms(rows, units, reshard_after_forward=False) == 18 * 4 + 30


def test_the_nccl_log_names_the_transports(tmp_path: Path):
    (tmp_path / "nccl.host.11.log").write_text(
        "host:11 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
        "host:11 [0] NCCL INFO Connected all rings\n"
    )
    (tmp_path / "nccl.host.12.log").write_text(
        "host:12 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via SHM/direct/direct\n"
    )
    assert collectives.nccl_transports(tmp_path) == ["P2P/CUMEM/read", "SHM/direct/direct"]


def test_two_cpu_processes_time_every_collective_and_set_them_beside_a_run(tmp_path: Path):
    run = tmp_path / "whole_run_auto_2gpu.json"
    run.write_text(
        json.dumps(
            {
                "results": [
                    {
                        "impl": "auto",
                        "gpus": 2,
                        "steady_tokens_per_s_per_gpu": 80000.0,
                        "overrides": ["train.global_batch_size=16", "train.seq_len=2048", "model=1b"],
                    }
                ]
            }
        )
    )
    out_json, out_md = tmp_path / "c.json", tmp_path / "c.md"
    options = ["--cpu", "--gpus", "2", "--tiny", "--reps", "2", "--warmup", "0", "--runs", str(run)]
    collectives.main([*options, "--json", str(out_json), "--md", str(out_md)])
    report = json.loads(out_json.read_text())
    units = report["meta"]["units"]
    rows = report["results"]
    assert [(r["unit"], r["collective"]) for r in rows] == [
        ("layer", "all_gather"),
        ("layer", "reduce_scatter"),
        ("root", "all_gather"),
        ("root", "reduce_scatter"),
    ]
    for r in rows:
        size = 2 if r["collective"] == "all_gather" else 4  # bf16 parameters, fp32 gradients
        assert r["bytes"] == collectives.shard_numel(units[r["unit"]], 2) * 2 * size
        assert r["ms"] > 0 and r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] / 2)
    assert report["step_collectives_ms"] == pytest.approx(collectives.step_collectives_ms(rows, units))
    assert report["transports"] == []  # gloo: no NCCL log
    assert report["meta"]["runs"][0]["step_ms"] == pytest.approx(1e3 * 16384 / 80000)
    assert "collectives / step" in out_md.read_text()


def test_one_process_is_refused_before_anything_starts():
    with pytest.raises(SystemExit):
        collectives.parse_args(["--cpu", "--gpus", "1"])


def test_a_joined_comparison_gives_both_runs_step_times(tmp_path: Path):
    def run(impl: str, tokens_per_s: float) -> dict:
        overrides = ["train.global_batch_size=32", "train.seq_len=2048", "train.micro_batch_size=4"]
        return {"impl": impl, "gpus": 4, "steady_tokens_per_s_per_gpu": tokens_per_s, "overrides": overrides}

    joined = tmp_path / "run_1b_4xh200.json"
    joined.write_text(
        json.dumps(
            {"results": [{"pairs": [{"dense": run("dense", 16384.0), "sparse": run("auto", 32768.0)}]}]}
        )
    )
    times = collectives.run_step_times(joined)
    assert [(t["impl"], t["gpus"], t["step_ms"]) for t in times] == [("dense", 4, 1000.0), ("auto", 4, 500.0)]
