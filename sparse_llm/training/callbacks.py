"""User hooks into the training loop, and the built-in ones: dead-unit re-initialisation and the
downstream task evaluation.

Config entries under `callbacks:` name a Callback subclass and its arguments:

    callbacks:
      - _target_: my_pkg.hooks.SaveSamples
        every: 500

Callbacks run on every data-parallel rank (a callback that writes files should check the
rank itself). The trainer object they receive exposes: `model` (the unwrapped
SparseLlamaForCausalLM), `optimizer` (torch AdamW), `cfg` (RunConfig), `step` (completed
optimizer steps), `sparsity` (SparsityMonitor), `run_dir` (Path), `reinit_generator`
(torch.Generator seeded identically on all ranks) and `l1_controller` (the L1Controller of a
target sparsity, else None).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparse_llm.config import ConfigError, DownstreamEvalConfig, RunConfig
from sparse_llm.metric_keys import layer_metric
from sparse_llm.sparsity.reinit import reinit_dead_units


class Callback:
    """Base class: override the hooks you need; all default to doing nothing."""

    def on_train_start(self, trainer: Any) -> None:
        pass

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """After optimizer step `step` (1-based); add entries to `metrics` to have them logged."""

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        pass

    def on_checkpoint(self, trainer: Any, step: int, path: Path) -> None:
        pass

    def on_train_end(self, trainer: Any) -> None:
        pass


class CallbackList(Callback):
    """Dispatches every hook to its callbacks, in order."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_train_start(self, trainer: Any) -> None:
        for callback in self.callbacks:
            callback.on_train_start(trainer)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_step_end(trainer, step, metrics)

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_eval(trainer, step, metrics)

    def on_checkpoint(self, trainer: Any, step: int, path: Path) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint(trainer, step, path)

    def on_train_end(self, trainer: Any) -> None:
        for callback in self.callbacks:
            callback.on_train_end(trainer)


class DeadUnitReinitCallback(Callback):
    """Every `every` steps, re-initialise the units the sparsity monitor reports dead.

    Runs on all ranks: the dead mask is global (reduced over ranks) and the draws come from
    the trainer's identically seeded generator, so replicas stay identical (FSDP2 shards: the
    shards of what a single process would hold).
    """

    def __init__(self, every: int, reset_up_down: bool = False) -> None:
        if every <= 0:
            raise ValueError(f"DeadUnitReinitCallback: every must be > 0, got {every}")
        self.every = every
        self.reset_up_down = reset_up_down

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if step % self.every:
            return
        dead = trainer.sparsity.dead_mask()
        revived = reinit_dead_units(
            trainer.model,
            trainer.optimizer,
            dead,
            std=trainer.model.config.initializer_range,
            reset_up_down=self.reset_up_down,
            generator=trainer.reinit_generator,
        )
        trainer.sparsity.reset_units(dead)
        if revived and trainer.l1_controller is not None:  # the controller holds through the burst
            trainer.l1_controller.reinit_revived_units(step)
        metrics["reinit/revived"] = float(revived)
        for layer, count in enumerate(dead.sum(-1).tolist()):
            metrics[layer_metric("reinit/revived", layer, dead.shape[0])] = float(count)


class DownstreamEvalCallback(Callback):
    """`eval.downstream`: lm-evaluation-harness tasks on the model being trained (the evaluation
    `sparse-llm-eval` runs, sparse_llm.eval) every `cfg.every` steps and after the last. The model
    scores with its evaluation-phase FFN under the run's autocast, as the validation loss does; the
    metrics join the step's record (downstream/<task>/<metric>; `every` is a multiple of
    train.log_every, so that step is logged) and the results go to <run_dir>/eval/<step>.json and
    .md. The tasks are checked and their data fetched when the callback is made, before the run."""

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
        from sparse_llm.eval.lm import SparseLM  # imports lm-eval
        from sparse_llm.eval.results import EvalTarget, log_metrics, write_result

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


def default_callbacks(cfg: RunConfig) -> list[Callback]:
    """The built-in callbacks the config switches on: dead-unit reinit, downstream evaluation."""
    callbacks: list[Callback] = []
    reinit = cfg.sparsity.reinit
    if reinit.enabled:
        callbacks.append(DeadUnitReinitCallback(every=reinit.every, reset_up_down=reinit.reset_up_down))
    if cfg.eval.downstream.tasks:
        callbacks.append(DownstreamEvalCallback(cfg.eval.downstream, cfg.train.max_steps))
    return callbacks


def build_callbacks(entries: list[Any]) -> list[Callback]:
    """Instantiate `callbacks:` config entries; errors name the entry (`callbacks[i]`) and its target."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    callbacks: list[Callback] = []
    for i, entry in enumerate(entries):
        key = f"callbacks[{i}]"
        if not isinstance(entry, Mapping) or "_target_" not in entry:
            raise ConfigError(f"config key '{key}': expected a mapping with a _target_ key, got {entry!r}")
        target = entry["_target_"]
        try:
            callback = instantiate(entry)
        except InstantiationException as err:
            # Hydra's own message hides the cause (a missing module, a wrong argument) behind
            # "set HYDRA_FULL_ERROR"; report the cause itself.
            cause = err.__cause__ or err
            reason = " ".join(f"{type(cause).__name__}: {cause}".split())
            raise ConfigError(f"config key '{key}': cannot instantiate {target!r}: {reason}") from err
        if not isinstance(callback, Callback):
            raise ConfigError(
                f"config key '{key}': {target!r} gave a {type(callback).__name__}, "
                f"not a sparse_llm.training.callbacks.Callback"
            )
        callbacks.append(callback)
    return callbacks
