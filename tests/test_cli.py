"""The training command as a user meets it: every failure one line on stderr with a stable exit code,
no traceback, and no run directory left behind by a run that never started."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from bad_files import BAD_FILES, write_bad_file
from omegaconf import OmegaConf
from tiny import TINY_CLI_OVERRIDES

from sparse_llm.train import _setup_logging, main, single_run

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


def test_config_errors_name_the_valid_choices_in_one_line(tmp_path, capsys):
    code, err, _ = _run(tmp_path, capsys, "train.max_step=5")
    assert (code, err) == (
        2,
        "error: config key 'train.max_step' does not exist; did you mean train.max_steps?\n",
    )
    code, err, _ = _run(tmp_path, capsys, "model=7b")
    expected = (
        "error: config group 'model' has no preset '7b'; its presets are 0.5b, 1.5b, 100m, 1b, 2b, tiny\n"
    )
    assert (code, err) == (2, expected)
    code, err, _ = _run(tmp_path, capsys, "sparsity=targt")
    assert code == 2 and "did you mean target?" in err and err.count("\n") == 1


def test_an_explicit_target_replaces_the_presets_target(tmp_path, capsys):
    code, err, run_dir = _run(
        tmp_path, capsys, "sparsity=target", "sparsity.target_l0=30", "train.max_steps=2"
    )
    assert code == 0, err
    saved = OmegaConf.load(run_dir / "config.yaml").sparsity
    assert (saved.target_l0, saved.target_sparsity) == (30, None)


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_each_bad_data_file_is_one_line_exit_3_and_no_run_directory(tmp_path, capsys, name):
    path, words = write_bad_file(tmp_path / "data", name)
    code, err, run_dir = _run(tmp_path, capsys, "data=files", f"data.paths=[{path}]")
    assert code == 3, err
    assert err.startswith(f"error: data.paths: {path} ") and words in err and err.count("\n") == 1, err
    assert not run_dir.exists()


@pytest.mark.parametrize("kind", ["directory", "glob", "none"])
def test_every_no_usable_path_mistake_is_exit_3_in_one_form(tmp_path, capsys, kind):
    (tmp_path / "corpus").mkdir()
    paths = {"directory": f"[{tmp_path / 'corpus'}]", "glob": f"[{tmp_path}/corpus/*.jsonl]", "none": "[]"}
    code, err, run_dir = _run(tmp_path, capsys, "data=files", f"data.paths={paths[kind]}")
    assert code == 3 and err.startswith("error: data.paths: ") and err.count("\n") == 1, err
    if kind == "directory":
        assert f"a directory: use a glob such as '{tmp_path / 'corpus'}/*.jsonl'" in err
    assert not run_dir.exists()


def test_data_without_usable_text_is_exit_3_before_the_run_directory(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err, run_dir = _run(tmp_path, capsys, "data=files", f"data.paths=[{empty}]")
    assert code == 3, err
    assert err.strip().splitlines()[-1].startswith("error: no usable") and "Traceback" not in err
    assert not run_dir.exists()


def test_a_truncated_checkpoint_falls_back_to_the_older_one(tmp_path, capsys, caplog):
    assert (
        _run(tmp_path, capsys, "train.max_steps=4", "train.checkpoint_every=2", "train.log_every=1")[0] == 0
    )
    newest = tmp_path / "run" / "checkpoints" / "step_00000004"
    data = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.INFO, logger="sparse_llm"):
        code, err, _ = _run(tmp_path, capsys, "train.max_steps=6", "train.log_every=1", "train.resume=auto")
    assert code == 0, err
    skipped = [r for r in caplog.records if "skipping" in r.getMessage()]
    assert [r.levelname for r in skipped] == ["WARNING"]  # a log line, not a Python warning
    assert re.fullmatch(
        r"resume=auto: skipping .*step_00000004: model\.safetensors has .*", skipped[0].getMessage()
    )
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4, 5, 6]
    code, err, _ = _run(tmp_path, capsys, "train.max_steps=8", f"train.resume={newest}")
    assert code == 4 and "cannot resume from" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_command_exits_with_the_code_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    args = [f"run_dir={tmp_path / 'run'}", *TINY, "train.lr=-1"]
    done = subprocess.run(
        [sys.executable, "-m", "sparse_llm.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "error: config key 'train.lr': must be > 0, got -1.0"
    # --debug through main in-process: the exit status is main's SystemExit (the process boundary
    # is tested above). main sets HYDRA_FULL_ERROR=1: set here first, so that monkeypatch undoes it
    # (a delenv of an absent variable records nothing, and later commands would show tracebacks).
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setattr(sys, "argv", ["sparse_llm.train", *args, "--debug"])
    with pytest.raises(SystemExit) as debug:
        main()
    err = capsys.readouterr().err
    assert debug.value.code == 2 and "Traceback" in err
    assert err.strip().splitlines()[-1] == "error: config key 'train.lr': must be > 0, got -1.0"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_binary_file_is_all_the_command_says(tmp_path):
    """No parser's log lines or traceback before the one line (datasets logs its own errors)."""
    path, words = write_bad_file(tmp_path, "jsonl_binary")
    cmd = [sys.executable, "-m", "sparse_llm.train", f"run_dir={tmp_path / 'run'}", *TINY, "data=files"]
    done = subprocess.run(
        [*cmd, f"data.paths=[{path}]"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert (done.returncode, done.stderr) == (3, f"error: data.paths: {path} {words} (a binary file?)\n")
    assert not (tmp_path / "run").exists()


def test_warnings_are_log_lines(caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        _setup_logging()
        warnings.warn("something to know", UserWarning, stacklevel=1)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("py.warnings", "UserWarning: something to know")
    ]


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_run_directory_is_never_overwritten_by_another_run(tmp_path, capsys):
    """The same run_dir without train.resume: refused before anything is written, in one line that
    gives the ways on; train.overwrite=true moves the earlier run aside, whole, and starts anew."""
    first = ("train.max_steps=2", "train.checkpoint_every=1", "train.log_every=1")
    assert _run(tmp_path, capsys, *first)[0] == 0
    run_dir = tmp_path / "run"
    before = _files(run_dir)
    code, err, _ = _run(tmp_path, capsys, "train.max_steps=3", "train.log_every=1")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        f"error: run_dir {run_dir} already holds a run: 2 checkpoints (up to step_00000002), "
        "metrics.jsonl (2 records), export/. Continue it with train.resume=auto, start a new run with "
        "another run_dir, or replace it with train.overwrite=true"
    ), err
    assert _files(run_dir) == before
    code, err, _ = _run(tmp_path, capsys, "train.max_steps=3", "train.log_every=1", "train.overwrite=true")
    assert code == 0, err
    (aside,) = tmp_path.glob("run.replaced-*")
    assert _files(aside) == before
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]
    log = (run_dir / "train.log").read_text()
    assert f"the run that was in {run_dir} moved to {aside}" in log
    # A run to its end (its export included) logs this package's lines only; the console of a run in
    # its own process: tests/training/test_preemption.py.
    assert all(re.match(r"\[[^]]+\]\[sparse_llm[.\w]*\]\[", line) for line in log.splitlines()), log


def test_resume_refuses_another_model_and_lists_the_other_changed_settings(tmp_path, capsys, caplog):
    assert _run(tmp_path, capsys, "train.max_steps=2", "train.log_every=1")[0] == 0
    run_dir = tmp_path / "run"
    config = (run_dir / "config.yaml").read_text()
    code, err, _ = _run(
        tmp_path, capsys, "train.max_steps=4", "train.resume=auto", "model.num_hidden_layers=2"
    )
    assert code == 4 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err == (
        f"error: cannot resume from {run_dir}/checkpoints/step_00000002: its model differs from the "
        "configured one: model.num_hidden_layers 1 in the checkpoint, 2 configured. Resume with the "
        "checkpoint's model settings, or start a new run with another run_dir\n"
    )
    assert (run_dir / "config.yaml").read_text() == config  # the refused run wrote nothing
    with caplog.at_level(logging.INFO, logger="sparse_llm"):
        code, err, _ = _run(
            tmp_path, capsys, "train.max_steps=4", "train.log_every=1", "train.resume=auto", "train.lr=0.002"
        )
    assert code == 0, err
    changed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: settings")]
    assert changed == [
        "resume: settings that differ from the checkpoint's (this run's apply): "
        "train.max_steps 2 -> 4, train.lr 0.001 -> 0.002"
    ]
    assert changed[0] in (run_dir / "train.log").read_text()


def test_resume_auto_starts_anew_without_a_checkpoint_but_never_over_damaged_ones(tmp_path, capsys):
    """A run that stopped before its first checkpoint left records only: resume=auto makes them
    again. Checkpoints of which none verifies are not replaced by a fresh start: exit 4."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    code, err, _ = _run(tmp_path, capsys, "train.max_steps=2", "train.log_every=1", "train.resume=auto")
    assert code == 0, err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[0]["loss"] != 9.0
    weights = run_dir / "checkpoints" / "step_00000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, err, _ = _run(tmp_path, capsys, "train.max_steps=4", "train.resume=auto")
    assert code == 4 and err.count("\n") == 1, err
    assert "none of the 1 checkpoints" in err and "verifies" in err
    assert len(weights.read_bytes()) == 100
