"""eval.downstream: lm-eval tasks during training, logged with the step's record; config errors
before the run starts."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
from hydra import compose, initialize_config_dir
from tiny import tiny_run_config

from sparse_llm.analysis.runs import read_metrics
from sparse_llm.config import CONFIG_DIR, ConfigError, load_config, to_yaml
from sparse_llm.training.trainer import Trainer

OFFLINE = {"tasks": ["offline"], "every": 2, "limit": 4}


def downstream_config(run_dir, downstream, **train):
    """The tiny run with eval.downstream set (validated as a whole, as a composed config is)."""
    cfg = tiny_run_config(run_dir, max_steps=4, sparsity={"plots": True}, **train)
    raw = dataclasses.asdict(cfg)
    raw["eval"]["downstream"].update(downstream)
    return load_config(raw)


def test_in_loop_evaluation_logs_its_keys_and_changes_no_training_number(tmp_path):
    pytest.importorskip("lm_eval")
    run_dir = tmp_path / "with"
    Trainer(downstream_config(run_dir, OFFLINE), run_dir).fit()
    records = read_metrics(run_dir)
    keys = {r["step"]: {k for k in r if k.startswith("downstream/")} for r in records}
    expected = {
        "downstream/python_completion/acc",
        "downstream/python_completion/acc_norm",
        "downstream/python_perplexity/bits_per_byte",
        "downstream/python_perplexity/byte_perplexity",
        "downstream/python_perplexity/word_perplexity",
        "downstream/seconds",
    }
    assert keys == {1: set(), 2: expected, 3: set(), 4: expected}
    for step in (2, 4):
        record = json.loads((run_dir / "eval" / f"{step}.json").read_text())
        logged = next(r for r in records if r["step"] == step)
        assert record["step"] == step and record["tokens_seen"] == logged["tokens_seen"]
        assert (
            record["tasks"]["python_completion"]["metrics"]["acc"]
            == logged["downstream/python_completion/acc"]
        )
        assert record["tasks"]["python_completion"]["samples"] == 4
    assert (run_dir / "downstream.png").stat().st_size > 0

    # The same run without the evaluation trains identically.
    plain = tmp_path / "without"
    cfg = downstream_config(plain, {"tasks": []})
    cfg.sparsity.plots = False  # its figures are not compared (matplotlib: ~2 s)
    Trainer(cfg, plain).fit()
    assert [training_numbers(r) for r in records] == [training_numbers(r) for r in read_metrics(plain)]


def test_the_evaluation_leaves_the_global_random_state_as_it_found_it():
    """lm-eval seeds Python's, NumPy's and torch's generators; harness.evaluate's context undoes it."""
    import random

    import numpy as np
    import torch

    from sparse_llm.eval.harness import preserved_rng

    def seed(value: int) -> None:
        torch.manual_seed(value)
        random.seed(value)
        np.random.seed(value)

    def draws() -> tuple:
        return torch.rand(3), random.random(), np.random.rand()

    seed(7)
    expected = draws()
    seed(7)
    with preserved_rng(torch.device("cpu")):
        seed(1234)
        draws()
    after = draws()
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]


def training_numbers(record):
    """A logged record without the downstream keys and the measurements of time and memory."""
    skip = ("downstream/", "tokens_per_s", "elapsed_s", "gc_s", "mfu", "peak_mem_gib", "data/")
    return {k: v for k, v in record.items() if not k.startswith(skip)}


@pytest.mark.parametrize(
    ("downstream", "train", "world_size", "message"),
    [
        (
            {"every": 3},
            {"log_every": 2},
            1,
            "'eval.downstream.every': 3 is not a multiple of train.log_every=2",
        ),
        ({}, {}, 2, "'eval.downstream.tasks': in-loop downstream evaluation runs in a single process"),
    ],
)
def test_config_errors_name_their_key(tmp_path, downstream, train, world_size, message):
    cfg = tiny_run_config(tmp_path, max_steps=4, global_batch_size=4, micro_batch_size=2, **train)
    raw = dataclasses.asdict(cfg)
    raw["eval"]["downstream"].update({**OFFLINE, **downstream})
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("the lm-eval check comes first without it")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(raw, world_size=world_size)


def test_without_lm_eval_the_config_says_what_to_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"eval\.downstream\.tasks.*pip install 'sparse-llm\[eval\]'"):
        downstream_config(tmp_path, OFFLINE)


def test_an_unknown_task_fails_before_the_run_directory_exists(tmp_path, no_lm_eval_index):
    pytest.importorskip("lm_eval")
    run_dir = tmp_path / "run"
    cfg = downstream_config(run_dir, {"tasks": ["python_completion", "no_such_task"]})
    with pytest.raises(
        ConfigError, match=r"'eval\.downstream\.tasks': unknown lm-eval task\(s\) no_such_task"
    ):
        Trainer(cfg, run_dir)
    assert not run_dir.exists()


@pytest.mark.parametrize("preset", ["paper", "quick", "offline"])
def test_eval_presets_compose_and_validate(preset):
    pytest.importorskip("lm_eval")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = load_config(compose("config", overrides=[f"eval={preset}"]))
    assert cfg.eval.name == preset and cfg.eval.downstream.tasks
    assert f"name: {preset}" in to_yaml(cfg)
    if preset == "paper":
        assert cfg.eval.downstream.tasks == [
            "arc_easy",
            "arc_challenge",
            "hellaswag",
            "piqa",
            "winogrande",
            "openbookqa",
            "boolq",
        ]
