"""Atomic checkpoints: complete ones are found, interrupted writes never are, old ones are pruned."""

from pathlib import Path

import pytest
import torch

from sparse_llm import run_files
from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model
from sparse_llm.model import state as model_state
from sparse_llm.training import checkpoint as ckpt_io


def make_checkpoint(step: int) -> ckpt_io.Checkpoint:
    model = build_model(
        ModelConfig(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
    )
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 50, (1, 5)), labels=torch.randint(0, 50, (1, 5))).loss.backward()
    optimizer.step()
    return ckpt_io.Checkpoint(
        step=step,
        model=model_state.model_state_to_save(model),
        optimizer=optimizer.state_dict(),
        tensors={"rng/torch_cpu": torch.get_rng_state()},
        state={"tokens_seen": step * 10, "data": [{"docs": step}]},
    )


def test_round_trip(tmp_path: Path):
    ckpt = make_checkpoint(7)
    path = ckpt_io.save_checkpoint(tmp_path, ckpt, keep_last=2)
    loaded = ckpt_io.load_checkpoint(path)
    assert loaded.step == 7 and loaded.state == {"tokens_seen": 70, "data": [{"docs": 7}]}
    assert "lm_head.weight" not in loaded.model  # tied: stored once
    for key, value in ckpt.model.items():
        assert torch.equal(loaded.model[key], value)
    state = loaded.optimizer["state"][0]
    assert torch.equal(state["exp_avg"], ckpt.optimizer["state"][0]["exp_avg"])
    assert torch.equal(loaded.tensors["rng/torch_cpu"], ckpt.tensors["rng/torch_cpu"])


def test_interrupted_write_is_ignored(tmp_path: Path):
    ckpt_io.save_checkpoint(tmp_path, make_checkpoint(10), keep_last=3)
    # A crash mid-write leaves a temporary directory, or a step directory without its manifest.
    (tmp_path / ".tmp-step_00000020-deadbeef").mkdir()
    (tmp_path / ".tmp-step_00000020-deadbeef" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "step_00000030").mkdir()
    assert run_files.latest_checkpoint(tmp_path) == tmp_path / "step_00000010"
    ckpt_io.remove_stale_temporaries(tmp_path)
    assert not list(tmp_path.glob(".tmp-*"))


def test_keep_last_k(tmp_path: Path):
    for step in (1, 2, 3, 4):
        ckpt_io.save_checkpoint(tmp_path, make_checkpoint(step), keep_last=2)
    names = [p.name for p in run_files.list_checkpoints(tmp_path)]
    assert names == ["step_00000003", "step_00000004"]


def test_load_model_state_restores_tied_weights():
    cfg = ModelConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    torch.manual_seed(0)
    source = build_model(cfg)
    torch.manual_seed(1)
    target = build_model(cfg)
    model_state.load_model_state(target, model_state.model_state_to_save(source))
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert target.lm_head.weight is target.model.embed_tokens.weight


def test_optimizer_file_loads_without_unpickling_code(tmp_path: Path):
    path = ckpt_io.save_checkpoint(tmp_path, make_checkpoint(1), keep_last=1)
    torch.load(path / "optimizer.pt", weights_only=True)


def _damage(path: Path, how: str) -> None:
    target = path / "model.safetensors"
    data = target.read_bytes()
    if how == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        target.unlink()


def test_every_file_is_recorded_and_written_with_the_run_s_permissions(tmp_path: Path):
    path = ckpt_io.save_checkpoint(tmp_path, make_checkpoint(3), keep_last=2)
    assert ckpt_io.verify_checkpoint(path) is None
    import json
    import os
    import stat

    recorded = json.loads((path / run_files.CHECKPOINT_MANIFEST).read_text())[ckpt_io.FILES_KEY]
    assert set(recorded) == {"model.safetensors", "optimizer.pt", "tensors.safetensors"}
    umask = os.umask(0)
    os.umask(umask)
    for file in path.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file.name


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
def test_a_damaged_checkpoint_is_skipped_by_auto_and_refused_by_name(tmp_path: Path, how: str, caplog):
    older = ckpt_io.save_checkpoint(tmp_path, make_checkpoint(2), keep_last=3)
    newer = ckpt_io.save_checkpoint(tmp_path, make_checkpoint(4), keep_last=3)
    _damage(newer, how)
    assert "model.safetensors" in ckpt_io.verify_checkpoint(newer)
    assert ckpt_io.checkpoint_to_resume(tmp_path, "auto") == older
    # A log line (the run's log and train.log), not a Python warning.
    assert [(r.levelname, r.getMessage().split(": model")[0]) for r in caplog.records] == [
        ("WARNING", f"resume=auto: skipping {newer}")
    ]
    with pytest.raises(ckpt_io.CheckpointError, match=f"cannot resume from {newer}: model.safetensors"):
        ckpt_io.checkpoint_to_resume(tmp_path, str(newer))
    _damage(older, how)
    caplog.clear()
    assert ckpt_io.checkpoint_to_resume(tmp_path, "auto") is None
    assert len(caplog.records) == 2  # both skipped, each named


def test_previous_run_and_move_aside(tmp_path: Path):
    run = tmp_path / "run"
    assert run_files.previous_run(run) is None
    run.mkdir()
    (run / "config.yaml").write_text("a: 1\n")  # a run that stopped before its first record
    (run / "metrics.jsonl").write_text("")
    assert run_files.previous_run(run) is None
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("b: 2\n")
    assert run_files.previous_run(run) == "1 checkpoint (up to step_00000001), metrics.jsonl (1 record)"
    aside = run_files.move_aside(run)
    assert aside.parent == tmp_path and aside.name.startswith("run.replaced-")
    assert sorted(p.name for p in aside.iterdir()) == [
        ".hydra",
        "checkpoints",
        "config.yaml",
        "metrics.jsonl",
    ]
    # Hydra's record of the job that runs now stays; everything else of the old run moved.
    assert [p.name for p in run.iterdir()] == [".hydra"] and run_files.previous_run(run) is None
    assert run_files.move_aside(run) != aside  # a second replacement in the same second: its own name
