"""Preemption as a scheduler does it: a real signal to a `python -m sparse_llm.train` process, which
stops after the step in flight with a checkpoint (exit 75) that `train.resume=auto` continues
bitwise; a second signal ends it at once. The signals come from a callback at a known step
(callback_targets.SignalAt) or from outside, as a scheduler sends them. A fresh interpreter costs
seconds of imports, so only what needs the process boundary runs in one (the exit status, the
console and its log, the second signal that ends the process); the other runs go through the
command's entry point in this process (tests/in_process.py), where the trainer installs its
handlers in the same way (pytest-xdist runs the tests in the main thread)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from in_process import run_module
from tiny import TINY_CLI_OVERRIDES

from sparse_llm.training.preemption import EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
# The tiny command-line run, 6 steps, every step logged, a checkpoint only at the end.
RUN = [o for o in TINY_CLI_OVERRIDES if not o.startswith("train.max_steps=")]
RUN += [f"train.max_steps={STEPS}", "train.log_every=1", "train.checkpoint_every=0", "train.export=false"]
COMPARED = ("loss", "ce", "l1", "lr", "grad_norm", "tokens_seen", "sparsity/mean", "dead/mean")


def _env() -> dict[str, str]:
    paths = (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH"))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "sparse_llm.train", f"run_dir={run_dir}", *RUN, *overrides]


def _start(run_dir: Path, *overrides: str, cwd: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen(
        _command(run_dir, *overrides),
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _signal_at(step: int, name: str, times: int = 1) -> str:
    return f"callbacks=[{{_target_:callback_targets.SignalAt,step:{step},signal:{name},times:{times}}}]"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def _stop_line(done: subprocess.CompletedProcess) -> str:
    logged = [line.split(" - ", 1)[1] for line in done.stderr.splitlines() if " - " in line]
    return logged[-1]


@pytest.mark.slow
def test_sigterm_stops_after_the_step_with_a_checkpoint_that_resumes_bitwise(tmp_path):
    """The stopped process is also the test of the console: what a run logs (the run directory,
    absolute, the FFN in words, the held-out losses, the stop) is on the console and in train.log,
    other libraries' INFO lines are not, and the last line is the run directory."""
    run_dir = tmp_path / "preempted"
    evaluated = "train.eval_every=1"
    # A relative run_dir (from the process's directory): the log and the last line name it absolute.
    proc = _start(Path(run_dir.name), _signal_at(3, "SIGTERM"), evaluated, cwd=tmp_path)
    assert run_module(_command(tmp_path / "straight", evaluated)).returncode == 0  # while the process runs
    stopped = _wait(proc)
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr and "error" not in stopped.stderr
    checkpoint = Path(run_dir.name) / "checkpoints" / "step_00000003"  # as the command named the run
    stop = (
        f"SIGTERM: stopped after step 3 of {STEPS}, checkpoint {checkpoint}; continue with train.resume=auto"
    )
    assert _stop_line(stopped) == stop
    assert stopped.stdout.splitlines()[-1] == f"run_dir: {run_dir}"
    assert _checkpoints(run_dir) == ["step_00000003"] and [r["step"] for r in _records(run_dir)] == [1, 2, 3]
    logged = [line for line in stopped.stderr.splitlines() if line.startswith("[")]
    assert all(re.match(r"\[[^]]+\]\[sparse_llm[.\w]*\]\[", line) for line in logged), logged
    messages = [line.split(" - ", 1)[1] for line in logged]
    assert messages[:2] == [
        f"run directory: {run_dir}",
        "FFN: dense (asked for); the sparse kernels need a Hopper GPU",
    ]
    evaluations = [re.fullmatch(r"step (\d): val_loss \d+\.\d{4}", m) for m in messages[2:-1]]
    assert [m.group(1) for m in evaluations] == ["1", "2", "3"], messages
    assert messages[-1] == stop
    # The console's log is train.log, the stop included; the run made no export (it did not end).
    assert (run_dir / "train.log").read_text().splitlines() == logged
    assert run_module(_command(run_dir, evaluated, "train.resume=auto")).returncode == 0
    a, b = _records(tmp_path / "straight"), _records(run_dir)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra[key] == rb[key], (ra["step"], key)
    last = f"checkpoints/step_{STEPS:08d}/model.safetensors"
    assert (run_dir / last).read_bytes() == (tmp_path / "straight" / last).read_bytes()


def _stop_logged(run_dir: Path) -> str:
    """The last message of a run's train.log (an in-process run's log, as on its console)."""
    return (run_dir / "train.log").read_text().splitlines()[-1].split(" - ", 1)[1]


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGINT"])
def test_slurm_s_early_signal_and_ctrl_c_stop_the_same_way(tmp_path, capsys, name):
    run_dir = tmp_path / name
    assert run_module(_command(run_dir, _signal_at(2, name))).returncode == EXIT_PREEMPTED
    assert "Traceback" not in capsys.readouterr().err
    assert _stop_logged(run_dir).startswith(f"{name}: stopped after step 2 of {STEPS}, checkpoint ")
    assert _checkpoints(run_dir) == ["step_00000002"]


@pytest.mark.slow
def test_a_second_signal_ends_the_process_at_once(tmp_path):
    # Two signals at the end of step 2: the process ends by the second, before the step is logged.
    done = _wait(_start(tmp_path / "twice", _signal_at(2, "SIGTERM", times=2)))
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == "SIGTERM again: stopping at once, without a checkpoint"
    assert _checkpoints(tmp_path / "twice") == []
    assert [r["step"] for r in _records(tmp_path / "twice")] == [1]


def test_a_sigterm_from_outside_checkpoints_the_last_step(tmp_path, capsys):
    """As a scheduler sends it: whenever it comes, the step in flight ends and is checkpointed. The
    signal comes from another thread, at no particular point of a step; Python runs the handler in
    the main thread, as for a signal from another process."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    run_over = threading.Event()

    def terminate_after_step_2() -> None:
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            if run_over.wait(0.05):
                return  # the run ended before step 2 was logged: the assertions below say so
        os.kill(os.getpid(), signal.SIGTERM)

    # A SIGTERM outside the run (should the sender be late) is recorded here, not this process's end.
    late: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
    sender = threading.Thread(target=terminate_after_step_2)
    sender.start()
    try:
        code = run_module(_command(run_dir, "train.max_steps=400")).returncode
    finally:
        run_over.set()
        sender.join()
        signal.signal(signal.SIGTERM, previous)
    assert not late
    assert code == EXIT_PREEMPTED
    step = _records(run_dir)[-1]["step"]
    assert _checkpoints(run_dir) == [f"step_{step:08d}"]
    assert re.fullmatch(rf"SIGTERM: stopped after step {step} of 400, checkpoint .*", _stop_logged(run_dir))
    assert capsys.readouterr().out.splitlines()[-1] == f"run_dir: {run_dir}"
