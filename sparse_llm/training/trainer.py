"""The train loop: build everything from a validated config, then step, evaluate, log, checkpoint.

Components live in their own modules (model, data, optim, checkpoint, metrics, sparsity,
callbacks); this file only wires them together in the order data flows.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from sparse_llm.config import (
    ConfigError,
    RunConfig,
    SettingChange,
    compare_with_checkpoint,
    resolve_config,
    to_plain,
)
from sparse_llm.data import RankSlice, TokenStream, load_tokenizer, validation_batches
from sparse_llm.data.prefetch import BatchPrefetcher
from sparse_llm.model import FFNStats, build_model
from sparse_llm.model.compiling import compile_model, compiled_graphs
from sparse_llm.model.llama import DecoderLayer
from sparse_llm.model.state import load_model_state
from sparse_llm.ops import KernelsUnavailable
from sparse_llm.run_files import (
    CHECKPOINTS_DIR,
    EXPORT_DIR,
    latest_checkpoint,
    list_checkpoints,
    move_aside,
    previous_run,
)
from sparse_llm.sparsity import L1Controller, SparsityMonitor, l1_coefficient, l1_penalty
from sparse_llm.training import checkpoint as ckpt_io
from sparse_llm.training.callbacks import Callback, CallbackList, default_callbacks
from sparse_llm.training.determinism import set_determinism
from sparse_llm.training.dtensor_leak import fix_dtensor_op_schema_leak
from sparse_llm.training.ffn_fallback import DensityFallback
from sparse_llm.training.ffn_summary import describe_ffn
from sparse_llm.training.garbage import ScheduledCollection
from sparse_llm.training.hot_units import HotUnits
from sparse_llm.training.metrics import MetricsLogger, peak_flops, peak_memory_gib
from sparse_llm.training.optim import build_optimizer, build_scheduler
from sparse_llm.training.preemption import StopSignals, TrainingPreempted
from sparse_llm.training.step_scalars import ScalarsInFlight, StepReadings, StepScalars, step_vector

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the run stops without writing a checkpoint."""


class RunDirInUse(ConfigError):
    """run_dir holds another run, and this one neither resumes it nor replaces it."""


def _is_within(path: Path, directory: Path) -> bool:
    return path.expanduser().resolve().is_relative_to(directory.expanduser().resolve())


def _reopen_log_files(run_dir: Path) -> None:
    """Close the log's file handlers that wrote into `run_dir` (Hydra's job log, train.log), whose
    files were moved aside with the run they belong to: each reopens its path on its next record."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and _is_within(Path(handler.baseFilename), run_dir):
            handler.close()


def _select_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'train.device': cuda was asked for but no CUDA device is visible")
    return name


def fsdp2_mixed_precision():
    """FSDP2's bf16 policy: bf16 compute, fp32 gradient reduction, outputs left as computed.

    accelerate's default for mixed_precision="bf16" also reduces gradients in bf16 and casts the
    model's outputs to bf16, which would round the (fp32) loss that is logged and back-propagated
    to 3 significant digits.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def set_fsdp2_prefetch(model: torch.nn.Module, ahead: int) -> None:
    """Explicit FSDP2 prefetch: each decoder layer all-gathers the next `ahead` layers' weights
    when its forward starts, and the previous `ahead` layers' when its backward starts. By default
    FSDP2 issues a layer's all-gather when the host reaches that layer, which a host read inside
    the previous layer's forward (the sparse training op's record sizes) delays."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + ahead])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - ahead) : i][::-1])


def parallel_setup(accelerator: Accelerator, fsdp_prefetch: int) -> dict[str, Any]:
    """How the model is spread over the processes, as accelerate set it up from the launcher's
    config and arguments (not the run's config; run_info.json records it): `fsdp2` with whether
    each layer's gathered parameters are freed after its forward and the prefetch depth, `ddp`,
    `single`, or another of accelerate's modes by its name."""
    if accelerator.is_fsdp2:
        return {
            "mode": "fsdp2",
            "reshard_after_forward": bool(accelerator.state.fsdp_plugin.reshard_after_forward),
            "prefetch": fsdp_prefetch,
        }
    kind = accelerator.distributed_type
    if kind == DistributedType.NO:
        return {"mode": "single"}
    return {"mode": "ddp" if kind.name.startswith("MULTI_") else kind.name.lower()}


class Trainer:
    """One training run: its model, data, optimizer, sparsity control, checkpoints and logs.

    Under FSDP2 on torch 2.11-2.12 building one also patches torch for the rest of the process
    (training/dtensor_leak.py: DTensor's operator keys computed in Python, where torch's leak)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, callbacks: list[Callback] | None = None) -> None:
        t = cfg.train
        device = _select_device(t.device)
        precision = t.precision if t.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
        self.accelerator = Accelerator(
            cpu=device == "cpu", mixed_precision="bf16" if precision == "bf16" else "no"
        )
        self.world_size = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        # A run directory belongs to one run: another run's files there are never overwritten
        # unless train.overwrite says so (then they are moved aside when the directory is made).
        self._replace_previous_run = self._check_run_dir(cfg, run_dir)
        # Data first: a bad path or tokenizer fails here, before a model is allocated. The config
        # is then resolved (the vocabulary from the tokenizer) and validated as a whole; the
        # trainer never changes it after this.
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        cfg = resolve_config(cfg, tokenizer_vocab=len(self.tokenizer), world_size=self.world_size)
        self.cfg = cfg
        self.run_dir = run_dir
        # The checkpoint train.resume names, checked against this config before anything is built.
        self._resume_changes: list[SettingChange] = []
        self.resume_from = self._checkpoint_to_resume()
        self.device = self.accelerator.device
        self.accum_steps = t.global_batch_size // (t.micro_batch_size * self.world_size)
        self.tokens_per_step = t.global_batch_size * t.seq_len
        # Every rank reads the same global stream and takes its own rows of each global
        # micro-batch, so a step sees the same global batch for any number of processes and the
        # data state is the same on every rank (see RankSlice).
        # With data.prefetch, a background thread reads (and tokenizes) the next batches while the
        # GPU works.
        self.train_stream: RankSlice | BatchPrefetcher = RankSlice(
            TokenStream(cfg.data, self.tokenizer, t.seq_len, "train"), self.rank, self.world_size
        )
        prefetch = cfg.data.prefetch
        if prefetch is None:
            prefetch = 2 if self.device.type == "cuda" else 0
        if prefetch > 0:
            self.train_stream = BatchPrefetcher(
                self.train_stream, t.micro_batch_size, prefetch, pin_memory=self.device.type == "cuda"
            )
        # The held-out batches are those of a single-process run, dealt round-robin to the ranks.
        all_val = validation_batches(cfg.data, self.tokenizer, t.seq_len, t.micro_batch_size, t.eval_batches)
        self.val_batches = all_val[self.rank :: self.world_size]
        # Forwards of a wrapped model can be collective: every rank runs the same number, padding
        # with weightless repeats.
        self._val_forwards = math.ceil(len(all_val) / self.world_size)
        self._val_pad = all_val[0] if all_val else None

        set_determinism(t.deterministic)
        torch.manual_seed(t.seed)
        try:
            model = build_model(
                cfg.model,
                device=self.device,
                compute_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
                activation_checkpointing=t.activation_checkpointing,
                recompute_norms=t.recompute_norms,
                # Bitwise-reproducible steps keep the FFN op's host read (model/ffn.py, FFNPlan).
                ffn_sync_free=not t.deterministic,
            )
        except KernelsUnavailable as err:
            raise ConfigError(f"config key 'model.ffn_impl': {err}") from None
        optimizer = build_optimizer(model, t, fused=self.device.type == "cuda")
        self.scheduler = build_scheduler(optimizer, t)
        # `model` and `optimizer` are the plain objects (what callbacks and checkpoints see);
        # the prepared ones may be wrapped for data parallelism and mixed precision.
        self.model, self.optimizer = model, optimizer
        if self.accelerator.is_fsdp2:
            fix_dtensor_op_schema_leak()  # FSDP2's objects piling up a step on torch 2.11-2.12
        if self.accelerator.is_fsdp2 and precision == "bf16":
            self.accelerator.state.fsdp_plugin.mixed_precision_policy = fsdp2_mixed_precision()
        self.parallel_setup = parallel_setup(self.accelerator, t.fsdp_prefetch)
        self.prepared_model, self.prepared_optimizer = self.accelerator.prepare(model, optimizer)
        if self.parallel_setup["mode"] == "fsdp2" and t.fsdp_prefetch > 0:
            set_fsdp2_prefetch(self.prepared_model, t.fsdp_prefetch)
        if t.compile:  # each decoder layer and the head, in place (model/compiling.py)
            compile_model(self.prepared_model)
        # FSDP2 (configs/accelerate/fsdp2.yaml): DTensor parameters, sharded checkpoints; on one
        # process too (`accelerate launch --num_processes 1` keeps FSDP2's DTensors).
        self.sharded = ckpt_io.is_sharded(self.model)

        self.sparsity = SparsityMonitor(
            num_layers=cfg.model.num_hidden_layers,
            num_units=cfg.model.intermediate_size,
            dead_window_tokens=cfg.sparsity.dead_window_tokens or self.tokens_per_step,
        )
        # With a sparsity target, lambda follows the measured L0 (the same on every rank).
        self.l1_controller = (
            L1Controller(cfg.sparsity, cfg.model.num_hidden_layers, cfg.model.intermediate_size)
            if cfg.sparsity.resolved_target_l0(cfg.model.intermediate_size) is not None
            else None
        )
        # Identically seeded on every rank, so dead-unit reinit keeps data-parallel replicas equal
        # (under FSDP2: every rank draws the rows a single process would, and keeps its shard).
        self.reinit_generator = torch.Generator().manual_seed(t.seed + 1)
        self.callbacks = CallbackList(default_callbacks(cfg) + list(callbacks or []))
        # Each step's scalars reach the host one step late (training/step_scalars.py).
        self.step_readings = StepReadings()
        # Per-layer fallback of a sparse training FFN to dense while a layer is too dense to gain
        # (every layer dense at the start; a resumed run takes the checkpoint's flags).
        self.ffn_fallback = (
            DensityFallback(model, cfg.model.ffn_dense_above)
            if model.ffn_plan.impl("train") != "dense"
            else None
        )
        # The units each layer's sparse training op computes as a dense block (model.ffn_hot_share;
        # chosen from the fire counts every few steps; a resumed run takes the checkpoint's). Off
        # where the training FFN is dense (`auto` without the kernels): the same config runs anywhere.
        self.hot_units = None
        if cfg.model.ffn_hot_share is not None:
            if self.ffn_fallback is None:
                logger.info("model.ffn_hot_share is set but the training FFN is dense: no hot units")
            else:
                self.hot_units = HotUnits(model, cfg.model.ffn_hot_share)
                logger.info(
                    "hot units: each layer's units firing on >= %g of a step's tokens run as a dense "
                    "block in its sparse training FFN, chosen every %d steps",
                    self.hot_units.share,
                    self.hot_units.refresh_steps,
                )
        self.state = ckpt_io.TrainingState(
            model=model,
            optimizer=optimizer,
            scheduler=self.scheduler,
            data=self.train_stream,
            sparsity=self.sparsity,
            reinit_generator=self.reinit_generator,
            device=self.device,
            sharded=self.sharded,
            l1_controller=self.l1_controller,
            step_readings=self.step_readings,
            config=to_plain(cfg),
        )
        self.step = 0
        self.tokens_seen = 0
        self._resumed = False
        # SIGTERM, SIGUSR1, SIGINT while `fit` runs: stop after the step in flight, with a
        # checkpoint (training/preemption.py). Every rank's request rides on the step's all-reduce.
        self.stop_signals = StopSignals()
        self._stop_agreed = False
        # Everything the run needs has been checked (config, tokenizer, data, the FFN): only now
        # does the run directory appear, or the run it held move aside (train.overwrite).
        self._moved_to: Path | None = None  # logged when `fit` starts, into the run's train.log
        if self._replace_previous_run and self.accelerator.is_main_process:
            self._moved_to = move_aside(run_dir)
            _reopen_log_files(run_dir)
        self.accelerator.wait_for_everyone()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.logger = MetricsLogger(
            run_dir, cfg.logger.wandb, asdict(cfg), enabled=self.accelerator.is_main_process
        )
        self.flops_per_token = self.model.flops_per_token(t.seq_len)
        self.peak_flops = peak_flops(self.device)

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    # ----------------------------------------------------------------------------------------
    def fit(self) -> None:
        """Train to train.max_steps, then evaluate, export and plot. On SIGTERM, SIGUSR1 or SIGINT:
        stop after the step in flight with a checkpoint and raise TrainingPreempted."""
        t = self.cfg.train
        with self.stop_signals:
            self._maybe_resume()
            if self.accelerator.is_main_process:
                logger.info(
                    "FFN: %s", describe_ffn(self.model.ffn_plan, self.cfg.model.ffn_impl, self.device)
                )
            self.callbacks.on_train_start(self)
            # Python's garbage collected at the same steps on every rank (training/garbage.py).
            garbage = ScheduledCollection(t.gc_every)
            main = self.accelerator.is_main_process
            bar = tqdm(
                total=t.max_steps,
                initial=self.step,
                unit="step",
                disable=not (main and t.progress),
                dynamic_ncols=True,
            )
            try:
                with garbage:
                    self._loop(bar, garbage)
            except TrainingPreempted:
                bar.close()
                self.logger.finish()
                raise
            finally:
                self.close()
            bar.close()
            self._finish()

    def close(self) -> None:
        """Stop the data prefetch thread (if any); `fit` calls it, a caller that only runs
        `train_step` (a benchmark) calls it when done."""
        if isinstance(self.train_stream, BatchPrefetcher):
            self.train_stream.close()

    def _loop(self, bar: tqdm, garbage: ScheduledCollection) -> None:
        t = self.cfg.train
        loop_start = window_start = time.perf_counter()
        window_tokens, first_step = 0, self.step + 1
        # Graphs compiled before and during the first step are the run's first compile; any later
        # one is a recompile (a variant first taken: a layer's fallback path, evaluation).
        graphs_at_start = graphs_after_first = compiled_graphs()
        while self.step < t.max_steps:
            record = self.train_step()
            self.step += 1
            self.tokens_seen += self.tokens_per_step
            window_tokens += self.tokens_per_step
            bar.update(1)
            garbage.after_step(self.step)
            if self.step == first_step:
                graphs_after_first = compiled_graphs()
            is_last = self.step == t.max_steps
            # A run's first step is logged too: its time holds the first compile.
            if self.step % t.log_every == 0 or is_last or self.step == 1:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                record.update(self.step_metrics())
                record.update(self._throughput(window_tokens, now - window_start))
                record["elapsed_s"] = (
                    now - loop_start
                )  # since the loop began (evaluations, checkpoints included)
                record["gc_s"] = garbage.take_seconds()  # of the window's time
                record.update(self.sparsity.summary())
                if self.ffn_fallback is not None:
                    record.update(self.ffn_fallback.metrics())
                if self.hot_units is not None:
                    record.update(self.hot_units.metrics())
                # Steps whose sparse op rebuilt a record (this rank's), by size and layer.
                record.update(self.model.ffn_capacity_overflows())
                window_start, window_tokens = time.perf_counter(), 0
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            self.callbacks.on_step_end(self, self.step, record)
            if (t.eval_every > 0 and self.step % t.eval_every == 0) or is_last:
                evaluation = self.evaluate()
                record.update(evaluation)
                self.callbacks.on_eval(self, self.step, evaluation)
                logger.info("step %d: val_loss %.4f", self.step, evaluation["val_loss"])
            if any(key in record for key in ("tokens_per_s", "val_loss", "reinit/revived")):
                record.update(self.step_metrics())
                if t.compile:
                    record["compile/graphs"] = float(compiled_graphs() - graphs_at_start)
                    record["compile/recompiles"] = float(compiled_graphs() - graphs_after_first)
                self.logger.log(self.step, record)
            saved = None
            if (t.checkpoint_every > 0 and self.step % t.checkpoint_every == 0) or is_last:
                saved = self.save_checkpoint()
                self.callbacks.on_checkpoint(self, self.step, saved)
            if not is_last and self._stop_requested():
                self._stop(saved)

    def _stop_requested(self) -> bool:
        """Whether to stop after this step: in one process, a signal received by now; with several,
        one that some rank had received by this step's all-reduce (the same answer on every rank)."""
        return self.stop_signals.requested if self.world_size == 1 else self._stop_agreed

    def _stop(self, saved: Path | None) -> None:
        """Checkpoint this step (unless `saved` is its checkpoint already), say so, raise."""
        if saved is None:
            saved = self.save_checkpoint()
            self.callbacks.on_checkpoint(self, self.step, saved)
        signal_name = self.stop_signals.name if self.stop_signals.requested else "a signal to another rank"
        message = (
            f"{signal_name}: stopped after step {self.step} of {self.cfg.train.max_steps}, checkpoint "
            f"{saved}; continue with train.resume=auto"
        )
        if self.accelerator.is_main_process:
            logger.info("%s", message)
        raise TrainingPreempted(message, self.step, saved)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `train.global_batch_size` sequences: the forward of every
        micro-batch with the L1 term and the sparsity statistics, backward, gradient clipping,
        AdamW, the scheduler; then the previous step's scalars act (the divergence check, the L1
        controller and the FFN fallback from its L0: training/step_scalars.py). The step the run
        takes and the benchmarks time. Returns what the host knows of it without waiting for the
        GPU (lambda, the learning rate, tokens); `step_metrics()` waits for its loss."""
        t = self.cfg.train
        control = self.l1_controller
        if control is None:
            coeff = l1_coefficient(self.cfg.sparsity, self.step)
        else:
            coeff = control.coefficient(self.step)
        # Per-layer coefficients: the penalty term is the mean over layers of lambda_i x L1_i.
        layer_coeffs = None
        if control is not None and control.per_layer and coeff > 0:
            # From page-locked memory: a copy from pageable memory would wait for the GPU.
            layer_coeffs = torch.tensor(
                control.coefficients(self.step), dtype=torch.float32, pin_memory=self.device.type == "cuda"
            ).to(self.device, non_blocking=True)
        ce_sum = torch.zeros((), device=self.device)
        l1_sum = torch.zeros((), device=self.device)
        penalty_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum_steps):
            batch = self.train_stream.next_batch(t.micro_batch_size).to(self.device, non_blocking=True)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            last = micro == self.accum_steps - 1
            # Gradients are all-reduced once, on the last micro-batch of the step.
            sync = contextlib.nullcontext() if last else self.accelerator.no_sync(self.prepared_model)
            with sync, self.accelerator.autocast():
                out = self.prepared_model(inputs, labels=labels, with_stats=True)
                l1 = l1_penalty(out.ffn_stats)
                if layer_coeffs is not None:
                    penalty = l1_penalty(out.ffn_stats, layer_coeffs)
                    penalty_sum += penalty.detach()
                    loss = out.loss + penalty
                else:
                    loss = out.loss + coeff * l1 if coeff > 0 else out.loss
                self.accelerator.backward(loss / self.accum_steps)
            self.sparsity.update(FFNStats(*(s.detach() for s in out.ffn_stats)))
            ce_sum += out.loss.detach()
            l1_sum += l1.detach()
        # A stop signal this rank has received (training/preemption.py), for every rank to see.
        stop = torch.zeros((), device=self.device)
        if self.stop_signals.requested:
            stop.fill_(1.0)
        # One all-reduce per step for the scalars (penalty_sum: per-layer lambdas only; stop: > 0
        # when any rank was signalled); they reach the host one step late, with the L0.
        scalars = self.accelerator.reduce(
            torch.stack((ce_sum, l1_sum, penalty_sum, stop)) / self.accum_steps, reduction="mean"
        )
        grad_norm = None
        if t.grad_clip > 0:
            grad_norm = self.accelerator.clip_grad_norm_(self.prepared_model.parameters(), t.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.prepared_optimizer.step()
        self.scheduler.step()
        self.prepared_optimizer.zero_grad(set_to_none=True)
        self.sparsity.end_step(self._all_reduce_sum)
        if self.hot_units is not None and self.hot_units.due(self.step + 1):  # this step's number
            self.hot_units.choose(*self.sparsity.last_step_fire_counts())
        record: dict[str, Any] = {
            "l1_coeff": coeff,  # the one this step used; per layer: their mean
            "lr": lr,
            "tokens_seen": self.tokens_seen + self.tokens_per_step,
        }
        if control is not None:
            record.update(control.metrics(self.step))
        vector = step_vector(scalars, grad_norm, self.sparsity.last_step_l0_tensor())
        previous = self.step_readings.push(
            ScalarsInFlight(self.step, vector, coeff, layer_coeffs is not None)
        )
        if previous is not None:
            self._act_on(previous)
        return record

    def step_metrics(self) -> dict[str, float]:
        """The last step's loss, cross-entropy, L1 and gradient norm: waits for them (a host sync;
        the loop asks on logging steps only). Raises TrainingDiverged if they are not finite."""
        last = self._checked(self.step_readings.latest())
        return {
            "loss": last.loss,
            "ce": last.ce,
            "l1": last.l1,
            "grad_norm": last.grad_norm,
        }

    def _checked(self, scalars: StepScalars) -> StepScalars:
        diverged = scalars.diverged(clipping=self.cfg.train.grad_clip > 0)
        if diverged is not None:
            problem, hint = diverged
            raise TrainingDiverged(
                f"{problem}; stopping without a checkpoint. Last good checkpoint: "
                f"{latest_checkpoint(self.checkpoint_root) or 'none'}. {hint}".rstrip()
            )
        return scalars

    def _act_on(self, scalars: StepScalars) -> None:
        """What the host does with a step's scalars, one step after it (training/step_scalars.py):
        the divergence check, the stop agreement, the L1 controller's next lambda (from step
        `scalars.step + 2` on), the dense fallback's paths."""
        self._checked(scalars)
        self._stop_agreed = scalars.stop
        if self.l1_controller is not None:
            self.l1_controller.update(scalars.l0_per_layer, scalars.step)
        if self.ffn_fallback is not None:
            self.ffn_fallback.observe(scalars.l0_per_layer)

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return self.accelerator.reduce(tensor.to(self.device), reduction="sum")

    def _throughput(self, tokens: int, seconds: float) -> dict[str, float]:
        tokens_per_s = tokens / max(seconds, 1e-9)
        out = {"tokens_per_s": tokens_per_s, "peak_mem_gib": peak_memory_gib(self.device)}
        if self.peak_flops:
            out["mfu"] = self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size)
        for key, value in self.train_stream.counters.items():
            out[f"data/{key}"] = value
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.prepared_model.eval()
        total = torch.zeros((), device=self.device)
        for i in range(self._val_forwards):
            real = i < len(self.val_batches)
            batch = (self.val_batches[i] if real else self._val_pad).to(self.device)
            with self.accelerator.autocast():
                loss = self.prepared_model(batch[:, :-1], labels=batch[:, 1:]).loss.float()
            if real:
                total += loss
        self.prepared_model.train()
        if self.world_size == 1:
            val = (total / max(1, len(self.val_batches))).item()
        else:
            count = torch.tensor(float(len(self.val_batches)), device=self.device)
            sums = self.accelerator.reduce(torch.stack((total, count)), reduction="sum")
            val = (sums[0] / sums[1].clamp(min=1)).item()
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}

    # ----------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        self._checked(self.step_readings.latest())  # never a checkpoint of a diverged step
        return ckpt_io.save_training_state(
            self.checkpoint_root,
            self.state,
            self.step,
            self.tokens_seen,
            self.world_size,
            self.cfg.train.keep_last,
            self.accelerator,
        )

    def _check_run_dir(self, cfg: RunConfig, run_dir: Path) -> bool:
        """Whether `run_dir` holds another run that this one replaces (train.overwrite); raises
        RunDirInUse when it holds one that this run would neither continue nor replace."""
        t = cfg.train
        if t.resume == "auto" and not t.overwrite:
            return False  # continues the run there, if any
        if t.resume != "none" and not t.overwrite and _is_within(Path(t.resume), run_dir):
            return False  # continues from one of its checkpoints
        found = self._on_main(lambda: previous_run(run_dir))
        if found is None:
            return False
        if t.overwrite:
            return True
        raise RunDirInUse(
            f"run_dir {run_dir} already holds a run: {found}. Continue it with train.resume=auto, "
            f"start a new run with another run_dir, or replace it with train.overwrite=true (its files "
            f"are then moved to {run_dir.name}.replaced-<date>_<time> next to it)"
        )

    def _on_main(self, compute: Any) -> Any:
        """`compute()` on the main process, its value given to every rank (a collective)."""
        value = compute() if self.accelerator.is_main_process else None
        if self.world_size > 1:
            from accelerate.utils import broadcast_object_list

            value = broadcast_object_list([value])[0]
        return value

    def _checkpoint_to_resume(self) -> Path | None:
        """The checkpoint train.resume names (auto: the newest under checkpoints/ that verifies;
        None: start from scratch), chosen on the main process for every rank. A checkpoint whose
        model differs from the configured one is a CheckpointError naming the settings; every other
        setting that differs from the checkpoint's is logged."""

        def find() -> tuple[str | None, dict | None, str | None]:
            t = self.cfg.train
            if t.resume == "none" or (t.overwrite and t.resume == "auto"):
                return None, None, None  # overwrite: the run there is moved aside
            try:
                path = ckpt_io.checkpoint_to_resume(self.checkpoint_root, t.resume)
            except ckpt_io.CheckpointError as err:
                return None, None, str(err)
            if path is None:
                damaged = list_checkpoints(self.checkpoint_root)
                if damaged:
                    return (
                        None,
                        None,
                        (
                            f"resume=auto: none of the {len(damaged)} checkpoints in {self.checkpoint_root} "
                            "verifies (each is named above); restore one, or start a new run with another "
                            "run_dir"
                        ),
                    )
                return None, None, None
            return str(path), ckpt_io.recorded_config(path), None

        path, recorded, error = self._on_main(find)
        if error is not None:
            raise ckpt_io.CheckpointError(error)
        if path is None:
            return None
        if recorded is not None:
            architecture, others = compare_with_checkpoint(recorded, self.cfg)
            if architecture:
                changes = ", ".join(
                    f"{c.key} {c.recorded!r} in the checkpoint, {c.configured!r} configured"
                    for c in architecture
                )
                raise ckpt_io.CheckpointError(
                    f"cannot resume from {path}: its model differs from the configured one: {changes}. "
                    "Resume with the checkpoint's model settings, or start a new run with another run_dir"
                )
            self._resume_changes = others  # logged when the run resumes, into its train.log
        return Path(path)

    def _maybe_resume(self) -> None:
        if self._resumed:
            return
        self._resumed = True
        if self.accelerator.is_main_process:
            if self._moved_to is not None:
                logger.info(
                    "train.overwrite: the run that was in %s moved to %s", self.run_dir, self._moved_to
                )
            ckpt_io.remove_stale_temporaries(self.checkpoint_root)
        if self.cfg.train.resume == "none":
            return
        path = self.resume_from
        if path is None:
            if self.accelerator.is_main_process:
                logger.info("resume=auto: no checkpoint in %s, starting from scratch", self.checkpoint_root)
            # Records of a run that stopped before its first checkpoint: this run makes them again.
            self.logger.truncate_after(0)
            return
        ckpt = ckpt_io.restore_training_state(path, self.state)
        saved_world = ckpt.state["world_size"]
        if saved_world != self.world_size and self.accelerator.is_main_process:
            # Weights, optimizer, tracker and data position are global: only the split of each
            # global batch over processes changes.
            logger.info("resumed a run of %d processes on %d", saved_world, self.world_size)
        self.step = ckpt.step
        self.tokens_seen = int(ckpt.state["tokens_seen"])
        self.logger.truncate_after(self.step)
        if self.accelerator.is_main_process:
            logger.info("resumed from %s at step %d", path, self.step)
            if self._resume_changes:
                logger.info(
                    "resume: settings that differ from the checkpoint's (this run's apply): %s",
                    ", ".join(c.describe() for c in self._resume_changes),
                )

    def _finish(self) -> None:
        self.callbacks.on_train_end(self)
        full_state = None
        if self.sharded and self.cfg.train.export:
            full_state = ckpt_io.full_model_state(self.model)  # collective; full on rank 0
        if self.accelerator.is_main_process:
            if self.cfg.train.export:
                from sparse_llm.model.hf_export import export_hf

                model = self.model
                if full_state is not None:
                    model = build_model(self.cfg.model, ffn="dense")
                    load_model_state(model, full_state)
                export_hf(model, self.tokenizer, self.run_dir / EXPORT_DIR)
            self.sparsity.save_histograms(self.run_dir)
            if self.cfg.sparsity.plots:
                from sparse_llm.analysis.plots import plot_run

                plot_run(self.run_dir)
        self.logger.finish()
        self.accelerator.wait_for_everyone()
