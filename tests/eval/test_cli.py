"""sparse-llm-eval as a user runs it: results files in the run directory, the comparison table and
plot, and every failure one line on stderr (exit 2) before a model is loaded."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from tiny import train_default_model

from sparse_llm.analysis.runs import read_metrics
from sparse_llm.eval.cli import main


def err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "offline"], "no such model directory"),  # the model path is made up
        ([], "name the tasks"),
    ],
)
def test_usage_errors_are_one_line_exit_2(tmp_path, capsys, argv, message):
    assert main([str(tmp_path / "no_run"), *argv]) == 2
    assert message in err_line(capsys)


def test_without_lm_eval_one_clear_line(default_run, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    assert main([str(default_run), "--tasks", "offline"]) == 2
    assert "pip install 'sparse-llm[eval]'" in err_line(capsys)


def test_unknown_task_is_named_before_any_evaluation(default_run, capsys, tmp_path, no_lm_eval_index):
    pytest.importorskip("lm_eval")
    export = shutil.copytree(default_run / "export", tmp_path / "export")  # outside any run
    assert main([str(export), "--tasks", "python_completion,no_such_task"]) == 2
    assert "unknown lm-eval task(s) no_such_task" in err_line(capsys)
    assert not (export / "eval").exists()


def test_the_early_unknown_task_check_finds_lm_evals_own_names():
    """task_manager's check before lm-eval's index (no config names the task) would turn a real
    task into an unknown one if it missed its name in lm-eval's configs: a task, a group, a tag."""
    pytest.importorskip("lm_eval")
    from sparse_llm.eval.harness import _written_in_lm_eval_configs

    assert all(_written_in_lm_eval_configs([name]) for name in ("arc_easy", "mmlu", "ai2_arc"))
    assert not _written_in_lm_eval_configs(["no_such_task", "python_completion"])


def test_task_data_that_cannot_be_read_fails_before_any_model_loads(default_run, capsys, monkeypatch):
    """What a machine without the hub sees for hub tasks: one line, nothing written."""
    pytest.importorskip("lm_eval")
    import sparse_llm.eval.tasks as shipped

    def unreachable(file, **_):
        raise FileNotFoundError(f"no {file} (offline)")

    monkeypatch.setattr(shipped, "load_jsonl", unreachable)
    before = sorted((default_run / "eval").glob("*")) if (default_run / "eval").exists() else []
    assert main([str(default_run), "--tasks", "python_perplexity"]) == 2
    assert "cannot load the data of task(s) python_perplexity: no python_perplexity.jsonl" in err_line(capsys)
    assert (sorted((default_run / "eval").glob("*")) if (default_run / "eval").exists() else []) == before


def test_a_damaged_model_is_exit_4_before_any_model_is_evaluated(default_run, capsys, tmp_path):
    good = shutil.copytree(default_run / "export", tmp_path / "good")
    damaged = shutil.copytree(default_run / "export", tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main([str(good), str(damaged), "--tasks", "python_completion"]) == 4
    assert err_line(capsys).startswith(f"error: {weights} has ")
    assert not (good / "eval").exists()


def test_compare_needs_results(default_run, capsys, tmp_path):
    export = shutil.copytree(default_run / "export", tmp_path / "export")
    assert main(["--compare", str(export), "--out", str(tmp_path)]) == 2
    assert "no downstream results" in err_line(capsys)


def test_evaluates_a_run_and_files_its_results_by_step(default_run, capsys):
    pytest.importorskip("lm_eval")
    assert main([str(default_run), "--tasks", "offline", "--limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "| python_completion | acc |" in out and "| python_perplexity | bits_per_byte |" in out
    record = json.loads((default_run / "eval" / "4.json").read_text())  # the latest checkpoint: step 4
    assert record["source"] == "checkpoint" and record["step"] == 4
    assert {t: r["samples"] for t, r in record["tasks"].items()} == {
        "python_completion": 4,
        "python_perplexity": 4,
    }
    assert 0 <= record["tasks"]["python_completion"]["metrics"]["acc"] <= 1
    assert (default_run / "eval" / "4.md").read_text().count("| python_") == 5  # 2 + 3 metrics

    # The run's export is the same step: a second task set joins the file, the first stays.
    assert main([str(default_run / "export"), "--tasks", "python_completion", "--limit", "6"]) == 0
    record = json.loads((default_run / "eval" / "4.json").read_text())
    assert record["source"] == "export"
    assert {t: r["samples"] for t, r in record["tasks"].items()} == {
        "python_completion": 6,
        "python_perplexity": 4,
    }


def test_compare_a_sparse_run_with_its_dense_twin(default_run, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    dense = train_default_model(tmp_path / "dense", l1_coeff=0.0)
    out = tmp_path / "cmp"
    argv = ["--compare", str(default_run), str(dense), "--tasks", "python_completion", "--limit", "5"]
    assert main([*argv, "--out", str(out)]) == 0
    table = (out / "downstream_compare.md").read_text()
    assert table in capsys.readouterr().out
    header, _, *rows = table.splitlines()
    assert header == f"| task | metric | {default_run.name} | dense |"
    cells = {row.split(" | ")[0].lstrip("| "): row.strip("| ").split(" | ")[2:] for row in rows if row}
    assert set(cells) >= {"python_completion", "sparsity", "L0", "step"}
    for column, run in enumerate((default_run, dense)):
        last = [r for r in read_metrics(run) if "l0/mean" in r][-1]
        assert cells["L0"][column] == f"{last['l0/mean']:.1f}"
        assert cells["sparsity"][column] == f"{last['sparsity/mean']:.2%}"
        evaluated = json.loads((run / "eval" / "4.json").read_text())["tasks"]["python_completion"]
        assert cells["python_completion"][column] == f"{evaluated['metrics']['acc_norm']:.4f}"
    summary = json.loads((out / "downstream_compare.json").read_text())
    assert [r["label"] for r in summary["runs"]] == [default_run.name, "dense"]
    png = out / "downstream_compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
