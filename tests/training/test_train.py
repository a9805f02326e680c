"""End-to-end training on CPU: loss falls, resume is bitwise, bad states never become checkpoints."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from in_process import logging_kept
from tiny import TINY_CLI_OVERRIDES, tiny_run_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts.summarize_sweep import main as summarize_sweep_main
from sparse_llm import run_files
from sparse_llm.config import RunConfig
from sparse_llm.model import build_model
from sparse_llm.model import state as model_state
from sparse_llm.train import main, single_run
from sparse_llm.training import checkpoint as ckpt_io
from sparse_llm.training.callbacks import Callback
from sparse_llm.training.trainer import Trainer, TrainingDiverged


def train(cfg: RunConfig, callbacks: list[Callback] | None = None) -> Trainer:
    trainer = Trainer(cfg, Path(cfg.run_dir), callbacks)
    trainer.fit()
    return trainer


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class SimulatedKill(Exception):
    pass


class KillAfterCheckpoint(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_checkpoint(self, trainer, step, path):
        if step == self.step:
            raise SimulatedKill


def test_short_run_loss_falls(tmp_path: Path):
    # 30 steps: the last 5 steps' CE ends ~1.3 below the first (1 or 2 threads), 60 steps ~1.5.
    cfg = tiny_run_config(
        tmp_path, max_steps=30, eval_every=15, lr=1e-2, seq_len=64, global_batch_size=8, micro_batch_size=4
    )
    trainer = train(cfg)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 31))
    last = sum(r["ce"] for r in records[-5:]) / 5
    assert last < records[0]["ce"] - 1.0
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0]
    for key in ("loss", "tokens_per_s", "l1", "lr", "sparsity/mean", "l0/mean", "dead/mean", "gc_s"):
        assert key in records[-1]
    assert gc.isenabled()  # Python's own collection is back after the trainer's schedule
    assert trainer.step == 30
    assert run_files.latest_checkpoint(tmp_path / "checkpoints").name == "step_00000030"


@pytest.mark.slow  # Inductor compiles C++ for the CPU: 5-30 s for the first, beside other tests
@pytest.mark.parametrize("recompute_norms", [False, True])
def test_compiled_run_with_the_sparse_training_ffn_matches_eager(tmp_path: Path, recompute_norms: bool):
    """train.compile=true goes through compile_model with the sparse training op (the reference
    on CPU: records of data-dependent length, like the CUDA op's): same losses as eager, with the
    norms saved or recomputed (train.recompute_norms)."""
    # A bound of 1.0: the tiny model's layers (near half dense) leave the dense fallback after step 1.
    model = {"ffn_impl": "reference", "ffn_dense_above": 1.0}
    eager = train(tiny_run_config(tmp_path / "eager", model=model, max_steps=3))
    compiled = train(
        tiny_run_config(
            tmp_path / "compiled", model=model, max_steps=3, compile=True, recompute_norms=recompute_norms
        )
    )
    assert all(hasattr(layer.forward, "__wrapped__") for layer in compiled.model.model.layers)
    assert [r["compile/graphs"] for r in read_metrics(tmp_path / "compiled")][-1] >= 2
    assert compiled.model.model.norm.recompute is recompute_norms
    got, want = read_metrics(tmp_path / "compiled"), read_metrics(tmp_path / "eager")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[-1]["ffn_fallback/dense_layers"] == 0  # the sparse op ran, compiled
    for g, w in zip(got, want, strict=True):
        assert g["ce"] == pytest.approx(w["ce"], rel=1e-4)
        assert g["l0/mean"] == pytest.approx(w["l0/mean"], rel=1e-3)
    assert eager.step == compiled.step == 3


@pytest.mark.parametrize("prefetch", [0, 2], ids=["in_loop", "prefetched"])
def test_resume_reproduces_uninterrupted_run_bitwise(tmp_path: Path, prefetch: int):
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    run = dict(max_steps=8, checkpoint_every=4, prefetch=prefetch)
    straight = train(tiny_run_config(straight_dir, **run))
    with pytest.raises(SimulatedKill):
        train(tiny_run_config(resumed_dir, **run), [KillAfterCheckpoint(4)])
    assert [r["step"] for r in read_metrics(resumed_dir)] == [1, 2, 3, 4]
    resumed = train(tiny_run_config(resumed_dir, resume="auto", **run))

    a, b = read_metrics(straight_dir), read_metrics(resumed_dir)
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce", "l1", "lr", "grad_norm", "tokens_seen", "sparsity/mean", "dead/mean"):
            assert ra[key] == rb[key], (ra["step"], key)
    for (name, pa), pb in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
    assert straight.train_stream.state_dict() == resumed.train_stream.state_dict()


def test_resume_restores_the_per_layer_dense_fallback(tmp_path: Path):
    """A sparse training FFN (the reference path on CPU) whose per-layer fallback is model state
    in the checkpoint: the resumed run continues with the checkpoint's flags, not a fresh
    trainer's (every layer dense), and reproduces the uninterrupted run bitwise (log_every=2: the
    resumed step 5 is not a log step, so only the checkpoint can tell it which layers are dense).
    The tiny model's layers sit near half dense, so the rule's bound is 1.0: sparse from step 2."""
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    run = dict(max_steps=8, checkpoint_every=4, log_every=2)
    model = {"ffn_impl": "reference", "ffn_dense_above": 1.0}
    straight = train(tiny_run_config(straight_dir, model=model, **run))
    at_step_4 = next(r for r in read_metrics(straight_dir) if r["step"] == 4)
    assert at_step_4["ffn_fallback/dense_layers"] < 2, "the test needs flags a fresh trainer lacks"
    with pytest.raises(SimulatedKill):
        train(tiny_run_config(resumed_dir, model=model, **run), [KillAfterCheckpoint(4)])
    resumed = Trainer(tiny_run_config(resumed_dir, model=model, resume="auto", **run), resumed_dir)
    resumed._maybe_resume()
    flags = [at_step_4[f"ffn_fallback/layer_{i:02d}"] == 1.0 for i in range(2)]
    assert resumed.model.ffn_dense_fallback() == flags
    resumed.fit()
    a, b = read_metrics(straight_dir), read_metrics(resumed_dir)
    assert [r["step"] for r in b] == [r["step"] for r in a] == [1, 2, 4, 6, 8]
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce", "l1", "grad_norm", "ffn_fallback/dense_layers", "ffn_fallback/layer_00"):
            assert ra[key] == rb[key], (ra["step"], key)
    assert straight.model.ffn_dense_fallback() == resumed.model.ffn_dense_fallback()
    for (name, pa), pb in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("per_layer", [False, True], ids=["global", "per_layer"])
def test_resume_restores_the_l1_controller_bitwise(tmp_path: Path, per_layer: bool):
    """The coefficients adapt every step and live in the checkpoint: the resumed run logs the
    uninterrupted run's losses and coefficients bit for bit."""
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    sparsity = dict(l1_coeff=1e-2, target_l0=20.0, controller=dict(per_layer=per_layer))
    run = dict(max_steps=8, checkpoint_every=4, sparsity=sparsity)
    straight = train(tiny_run_config(straight_dir, **run))
    with pytest.raises(SimulatedKill):
        train(tiny_run_config(resumed_dir, **run), [KillAfterCheckpoint(4)])
    resumed = train(tiny_run_config(resumed_dir, resume="auto", **run))

    a, b = read_metrics(straight_dir), read_metrics(resumed_dir)
    keys = ["loss", "ce", "l1", "l1_coeff", "l0/mean", "grad_norm"]
    if per_layer:
        keys += ["l1_coeff/layer_00", "l1_coeff/layer_01"]
        assert a[-1]["l1_coeff/layer_00"] != a[-1]["l1_coeff/layer_01"]
    else:
        assert "l1_coeff/layer_00" not in a[-1]
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b, strict=True):
        for key in keys:
            assert ra[key] == rb[key], (ra["step"], key)
    # The resumed steps ran on adapted coefficients that only the checkpoint could give back. A
    # step's L0 sets lambda from the step after next (training/step_scalars.py): steps 1 and 2 both
    # run on l1_coeff, every later one on its own.
    assert a[4]["l1_coeff"] != 1e-2 and [r["l1_coeff"] for r in a[:2]] == [1e-2, 1e-2]
    assert len({r["l1_coeff"] for r in a}) == 7
    assert resumed.l1_controller.state_dict() == straight.l1_controller.state_dict()
    saved = ckpt_io.load_checkpoint(resumed_dir / "checkpoints" / "step_00000004").state["l1_controller"]
    assert saved["per_layer"] is per_layer and len(saved["integral"]) == (2 if per_layer else 1)


def test_resume_ignores_an_interrupted_checkpoint_write(tmp_path: Path):
    train(tiny_run_config(tmp_path, max_steps=4, checkpoint_every=2))
    root = tmp_path / "checkpoints"
    partial = root / ".tmp-step_00000006-0badc0de"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    (root / "step_00000008").mkdir()  # renamed but never completed: no manifest
    trainer = Trainer(tiny_run_config(tmp_path, max_steps=6, resume="auto"), tmp_path)
    trainer._maybe_resume()
    assert trainer.step == 4
    assert not partial.exists()


class PoisonWeightsAfterCheckpoint(Callback):
    def on_checkpoint(self, trainer, step, path):
        if step == 2:
            with torch.no_grad():
                trainer.model.model.layers[0].mlp.up_proj.weight.fill_(float("nan"))


@pytest.mark.parametrize("every", [1, 2], ids=["logged", "read_one_step_late"])
def test_nan_loss_stops_without_writing_a_checkpoint(tmp_path: Path, every: int):
    """Step 3's loss is NaN. Logged and checkpointed every step, it stops at once; logged every 10
    steps and checkpointed every 2, step 3's scalars are read when step 4 ends
    (training/step_scalars.py), before step 4's checkpoint."""
    log_every = 1 if every == 1 else 10
    cfg = tiny_run_config(tmp_path, max_steps=6, checkpoint_every=every, log_every=log_every)
    with pytest.raises(TrainingDiverged, match="step 3"):
        train(cfg, [PoisonWeightsAfterCheckpoint()])
    names = [p.name for p in run_files.list_checkpoints(tmp_path / "checkpoints")]
    assert names[-1] == "step_00000002"


def test_export_loads_in_plain_transformers_with_same_logits(tmp_path: Path):
    trainer = train(tiny_run_config(tmp_path, max_steps=2, export=True))
    export = tmp_path / "export"
    hf_model = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = torch.tensor([tokenizer("def main():\n    return 42\n")["input_ids"]])
    ours = build_model(trainer.cfg.model).eval()
    ckpt = ckpt_io.load_checkpoint(run_files.latest_checkpoint(tmp_path / "checkpoints"))
    model_state.load_model_state(ours, ckpt.model)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)
    assert hf_model.config.hidden_act == "relu"
    assert tokenizer.eos_token_id == trainer.tokenizer.eos_token_id


def test_command_line_run_and_config_error(tmp_path: Path, capsys):
    # In-process: the command's single_run on the same overrides (tests/test_cli.py runs the
    # command itself, for its exit codes and console log).
    run_dir = tmp_path / "cli"
    overrides = [f"run_dir={run_dir}", *TINY_CLI_OVERRIDES]
    code = single_run(overrides)
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert out.strip().splitlines()[-1] == f"run_dir: {run_dir}"
    assert (run_dir / "export" / "config.json").is_file()
    assert (run_dir / "config.yaml").is_file()
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["parallel"] == {"mode": "single"} and info["world_size"] == 1

    bad = single_run([*overrides, "train.global_batch_size=3"])
    assert bad == 2
    assert "train.global_batch_size" in capsys.readouterr().err


def test_l1_sweep_multirun_and_summary(tmp_path: Path, monkeypatch):
    # The command's main in-process, through Hydra's launcher (its multirun and job directories);
    # tests/test_cli.py tests the command's process itself.
    sweep_dir = tmp_path / "sweep"
    argv = ["sparse_llm.train", "-m", "sparsity.l1_coeff=0,1e-2", f"hydra.sweep.dir={sweep_dir}"]
    monkeypatch.setattr(sys, "argv", argv + TINY_CLI_OVERRIDES)
    with logging_kept():
        main()  # a failed job ends in SystemExit
    assert sorted(p.name for p in sweep_dir.iterdir() if (p / "metrics.jsonl").is_file()) == ["0", "1"]
    assert summarize_sweep_main([str(sweep_dir)]) == 0  # in-process: the script's main
    rows = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [row["l1_coeff"] for row in rows] == [0.0, 0.01]
    assert (sweep_dir / "sweep_val_ce_vs_sparsity.png").stat().st_size > 0


def test_prefetch_defaults_to_the_loop_on_cpu(tmp_path: Path):
    """data.prefetch unset (None): no background thread on CPU (2 on a GPU)."""
    from sparse_llm.data.prefetch import BatchPrefetcher

    cfg = tiny_run_config(tmp_path, max_steps=1, prefetch=None)
    assert cfg.data.prefetch is None
    trainer = Trainer(cfg, tmp_path)
    assert not isinstance(trainer.train_stream, BatchPrefetcher)
    explicit = Trainer(tiny_run_config(tmp_path / "explicit", max_steps=1, prefetch=2), tmp_path / "explicit")
    assert isinstance(explicit.train_stream, BatchPrefetcher)
    explicit.train_stream.close()


def test_deterministic_is_set_by_the_config_when_the_trainer_is_built(tmp_path: Path, monkeypatch):
    """train.deterministic turns PyTorch's deterministic algorithms on (with the fixed cuBLAS
    workspace they need) and a later trainer without it turns them off: the config decides, not
    what an earlier run in the process left."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        train(tiny_run_config(tmp_path / "on", max_steps=1, deterministic=True))  # no op refuses
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        Trainer(tiny_run_config(tmp_path / "off", max_steps=1), tmp_path / "off")
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
