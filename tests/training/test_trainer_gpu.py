"""The trainer's own loop on a GPU: between logging steps it never waits for the GPU."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from ffn_patterns import needs_hopper
from tiny import tiny_run_config

from sparse_llm.training import trainer as trainer_module
from sparse_llm.training.callbacks import Callback
from sparse_llm.training.hot_units import HotUnits
from sparse_llm.training.trainer import Trainer

LOG_EVERY = 10
# A model the kernels run, sparse from step 3 (step 1's L0 acts after step 2) and never back.
KERNEL_MODEL = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_impl="cuda",
    ffn_dense_above=1.0,
)


class SyncsRaise(Callback):
    """Steps `first`..LOG_EVERY - 1 (1-based) run under set_sync_debug_mode("error"): any
    synchronising CUDA call (a tensor read on the host, a blocking copy) raises."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.checked: list[int] = []

    def on_step_end(self, trainer, step, metrics) -> None:
        if self.first <= step < LOG_EVERY:
            self.checked.append(step)
        if step == self.first - 1:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        if step == LOG_EVERY - 1:  # the next step logs: it syncs to time and read the scalars
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_steps_between_logging_steps_never_wait_on_the_gpu(tmp_path: Path, compile: bool):
    """With the kernels' FFN (the capacity path), the L1 controller, the dense fallback and
    gradient clipping all on, and the data prefetched into page-locked memory, the loop's steps
    between two logging steps make no synchronising CUDA call, while the controller still adapts
    (from the scalars read one step late) and the logged steps still carry their loss."""
    cfg = tiny_run_config(
        tmp_path / "run",
        model=KERNEL_MODEL,
        sparsity=dict(l1_coeff=1e-3, target_l0=40.0, l1_warmup_end=0),
        prefetch=2,
        seq_len=128,
        global_batch_size=8,
        micro_batch_size=4,
        max_steps=LOG_EVERY,
        log_every=LOG_EVERY,
        grad_clip=1.0,
        compile=compile,
    )
    guard = SyncsRaise(first=5)  # steps 3-4: the capacities settle, the regions compile
    trainer = Trainer(cfg, Path(cfg.run_dir), [guard])
    try:
        trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.checked == list(range(5, LOG_EVERY))
    assert trainer.model.ffn_dense_fallback() == [False, False]  # the steps checked ran sparse
    last = trainer.step_metrics()
    assert torch.isfinite(torch.tensor([last["loss"], last["grad_norm"]])).all()
    assert trainer.l1_controller.state_dict()["integral"] != [1e-3]  # it adapted


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_run_with_hot_units_trains_like_one_without(tmp_path: Path, compile: bool, monkeypatch):
    """model.ffn_hot_share on the kernels (the capacity path), eager and compiled: the units are
    chosen every 2 steps (sizes multiples of 64) and the last loss is the run without hot units' to
    within the drift of bf16 rounding over 8 steps."""
    monkeypatch.setattr(trainer_module, "HotUnits", functools.partial(HotUnits, refresh_steps=2))
    losses = {}
    for share in (None, 0.02):
        cfg = tiny_run_config(
            tmp_path / f"run_{share}",
            model={**KERNEL_MODEL, "ffn_hot_share": share},
            sparsity=dict(l1_coeff=1e-3, l1_warmup_end=0),
            seq_len=128,
            global_batch_size=8,
            micro_batch_size=4,
            max_steps=8,
            log_every=1,
            compile=compile,
        )
        trainer = Trainer(cfg, Path(cfg.run_dir))
        trainer.fit()
        if share is not None:
            sizes = [0 if hot is None else hot.numel() for hot in trainer.model.ffn_hot_units()]
            assert all(n % 64 == 0 for n in sizes) and sum(sizes) > 0, sizes
        losses[share] = trainer.step_metrics()["loss"]
    assert abs(losses[0.02] - losses[None]) <= 2e-2 * abs(losses[None]), losses
