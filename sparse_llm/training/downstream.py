"""Downstream task accuracy during training: `eval.downstream` runs lm-evaluation-harness tasks on
the model being trained (the evaluation `sparse-llm-eval` runs: sparse_llm.eval) every
`eval.downstream.every` steps and after the last, and logs downstream/<task>/<metric> with that
step's record (metrics.jsonl, wandb; the run's downstream.png plots them over tokens). The
results also go to <run_dir>/eval/<step>.json and .md, as the command writes them.

The model scores with its evaluation-phase FFN under the run's autocast, as the validation loss
does. The evaluation leaves the training's random state as it found it (lm-eval seeds the global
generators), so a run with downstream evaluation trains on the same numbers as one without.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from sparse_llm.config import ConfigError, DownstreamEvalConfig
from sparse_llm.training.callbacks import Callback


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Python's, NumPy's and torch's global random states (the CPU's and `device`'s) restored on exit."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


class DownstreamEvalCallback(Callback):
    """lm-eval tasks on the trainer's model at the steps `cfg` names; the tasks are checked and
    their data fetched when the callback is made, before the run starts."""

    def __init__(self, cfg: DownstreamEvalConfig, max_steps: int) -> None:
        from sparse_llm.eval import harness

        self.cfg = cfg
        self.max_steps = max_steps
        try:
            harness.require_lm_eval()
            self.tasks = harness.expand_tasks(cfg.tasks)
            self.manager = harness.task_manager(self.tasks)
            harness.check_tasks(self.tasks, self.manager)
            harness.fetch_task_data(self.tasks, self.manager)
        except (ImportError, ValueError) as err:
            raise ConfigError(f"config key 'eval.downstream.tasks': {err}") from None

    def due(self, step: int) -> bool:
        return step == self.max_steps or (self.cfg.every > 0 and step % self.cfg.every == 0)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if not self.due(step):
            return
        from sparse_llm.eval import harness
        from sparse_llm.eval.lm import SparseLM
        from sparse_llm.eval.results import LOG_PREFIX, EvalTarget, log_metrics, write_result

        model = trainer.model
        lm = SparseLM(
            model,
            trainer.tokenizer,
            (trainer.tokenizer.eos_token_id,),
            batch_size=self.cfg.batch_size,
            autocast=trainer.accelerator.autocast,
            progress=False,
        )
        was_training = model.training
        model.eval()
        try:
            with preserved_rng(trainer.device):
                record = harness.evaluate(
                    lm, self.tasks, self.manager, limit=self.cfg.limit, num_fewshot=self.cfg.num_fewshot
                )
        finally:
            model.train(was_training)
        record["tokens_seen"] = trainer.tokens_seen
        if trainer.accelerator.mixed_precision != "no":  # the weights' dtype is not what computed
            record["dtype"] += f" weights, {trainer.accelerator.mixed_precision} autocast"
        write_result(EvalTarget(trainer.run_dir, "training", trainer.run_dir, step), record)
        metrics.update(log_metrics(record))
        metrics[f"{LOG_PREFIX}/seconds"] = record["seconds"]
