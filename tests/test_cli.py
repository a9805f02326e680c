"""The training command as a user meets it: every failure one line on stderr with a stable exit code,
no traceback, and no run directory left behind by a run that never started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import TINY_CLI_OVERRIDES

from sparse_llm.train import single_run

REPO = Path(__file__).resolve().parents[1]
# The tiny run of tests/tiny.py without its step count (each test sets its own).
TINY = [o for o in TINY_CLI_OVERRIDES if not o.startswith("train.max_steps=")]


def _run(tmp_path: Path, capsys, *overrides: str) -> tuple[int, str, Path]:
    run_dir = tmp_path / "run"
    code = single_run([f"run_dir={run_dir}", *TINY, *overrides])
    return code, capsys.readouterr().err, run_dir


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("sparsity.l1_coeff=nan", "sparsity.l1_coeff"),
        ("train.lr=nan", "train.lr"),
        ("train.lr=inf", "train.lr"),
        ("train.global_batch_size=3", "train.global_batch_size"),
        ("model.hidden=3", "model.hidden"),  # an unknown key: Hydra's error, our one line
        ("model.ffn_impl=cuda", "model.ffn_impl"),  # no Hopper GPU here
        ("model=no_such_preset", "model"),
    ],
)
def test_config_errors_are_one_line_exit_2_and_leave_no_run_directory(tmp_path, capsys, override, key):
    code, err, run_dir = _run(tmp_path, capsys, override)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert lines[-1].startswith("error: ") and key in lines[-1], err
    assert "Traceback" not in err
    assert not run_dir.exists()


def test_data_without_usable_text_is_exit_3_before_the_run_directory(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err, run_dir = _run(tmp_path, capsys, "data=files", f"data.paths=[{empty}]")
    assert code == 3, err
    assert err.strip().splitlines()[-1].startswith("error: no usable") and "Traceback" not in err
    assert not run_dir.exists()


def test_a_truncated_checkpoint_falls_back_to_the_older_one(tmp_path, capsys):
    assert (
        _run(tmp_path, capsys, "train.max_steps=4", "train.checkpoint_every=2", "train.log_every=1")[0] == 0
    )
    newest = tmp_path / "run" / "checkpoints" / "step_00000004"
    data = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match=r"skipping .*step_00000004: model\.safetensors has"):
        code, err, _ = _run(tmp_path, capsys, "train.max_steps=6", "train.log_every=1", "train.resume=auto")
    assert code == 0, err
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4, 5, 6]
    code, err, _ = _run(tmp_path, capsys, "train.max_steps=8", f"train.resume={newest}")
    assert code == 4 and "cannot resume from" in err and "Traceback" not in err


def test_the_command_exits_with_the_code_and_debug_shows_the_traceback(tmp_path):
    cmd = [sys.executable, "-m", "sparse_llm.train", f"run_dir={tmp_path / 'run'}", *TINY, "train.lr=-1"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: config key 'train.lr': must be > 0, got -1.0"
    debug = subprocess.run([*cmd, "--debug"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    assert not (tmp_path / "run").exists()
