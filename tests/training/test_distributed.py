"""Data parallelism on CPU: 2 processes (gloo) against 1, for the same global batch.

The 2-process runs are launched once per session (_launch, _run_ranks: torchrun's environment, the
second rank forked from the first after the imports), each rank running this file as a script (the
`__main__` block at the bottom): one launch runs every part (FSDP2 sharded checkpoints, reinit on
shards, the data-parallel trainer, the trainer under FSDP2) in one process group, as each costs more
to start (interpreters importing torch) than to run. Each rank records its losses, batches, dead-unit
counters and final weights and AdamW moments (gathered from FSDP2 shards), and the tests compare
them with a single-process run made in the pytest process.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny import TINY_MODEL, tiny_run_config
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from sparse_llm.config import ModelConfig, RunConfig
from sparse_llm.data import RankSlice, TokenStream, load_tokenizer
from sparse_llm.model import SparseLlamaForCausalLM, build_model
from sparse_llm.sparsity import reinit_dead_units
from sparse_llm.training.callbacks import Callback
from sparse_llm.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 6  # reinit (every 2 steps) and evaluation (every 4) on both sides of the kill at 4
KILL_AT = 4
SIGNAL_AT = 2  # rank 1 alone gets SIGTERM when step 2 ends: step 3 carries it, read after step 4
STOPPED_AFTER = SIGNAL_AT + 2  # every rank stops there (a step's scalars are read one step late)
DEAD_ROWS = 8  # gate rows zeroed at the start: dead units that reinit must revive identically
MOMENTS = ("exp_avg", "exp_avg_sq")
TINY_LAYERS, TINY_UNITS = TINY_MODEL["num_hidden_layers"], TINY_MODEL["intermediate_size"]
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; the gradient all-reduce changes the summation order


def run_config(run_dir: Path, **train_overrides) -> RunConfig:
    train = dict(
        global_batch_size=8,
        micro_batch_size=2,  # 1 process: 4 micro-batches per step; 2 processes: 2 each
        max_steps=MAX_STEPS,
        eval_every=4,
        eval_batches=3,  # odd: one rank pads its evaluation with a weightless forward
        checkpoint_every=KILL_AT,
        keep_last=4,
    )
    return tiny_run_config(
        run_dir, sparsity=dict(reinit=dict(enabled=True, every=2)), **{**train, **train_overrides}
    )


def target_run_config(run_dir: Path) -> RunConfig:
    """run_config with per-layer L1 coefficients following a target L0 (sparsity.target_l0)."""
    cfg = run_config(run_dir, eval_every=0, checkpoint_every=0)
    cfg.sparsity.target_l0 = 20.0
    cfg.sparsity.controller.per_layer = True
    return cfg


class SimulatedKill(Exception):
    pass


@torch.no_grad()
def zero_gate_rows(model: SparseLlamaForCausalLM) -> None:
    """Zero DEAD_ROWS gate rows per layer, spread over the units and so over both FSDP2 shards:
    with ReLU their units never fire and get no gradient, so they stay dead until reinit."""
    for layer in model.model.layers:
        weight = layer.mlp.gate_proj.weight
        rows = torch.zeros(weight.shape, dtype=torch.bool)
        rows[:: weight.shape[0] // DEAD_ROWS] = True
        if isinstance(weight, DTensor):
            rows = distribute_tensor(rows, weight.device_mesh, weight.placements)
        weight.masked_fill_(rows, 0)


def gathered_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Full copies of the model's weights and AdamW moments (by parameter name), gathered from the
    shards of an FSDP2 model: a collective there, called by every rank."""

    def full(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()

    moments = {
        f"{name}.{key}": full(optimizer.state[param][key])
        for name, param in model.named_parameters()
        for key in MOMENTS
        if param in optimizer.state
    }
    return {"model": {k: full(v) for k, v in model.state_dict().items()}, "optimizer": moments}


class Recorder(Callback):
    """What each rank saw: step metrics, its batches, the dead-unit counters after every step.

    Zeroes gate rows at the start (zero_gate_rows) for reinit to revive."""

    def __init__(self, kill_at: int = 0) -> None:
        self.kill_at = kill_at
        self.steps: list[dict[str, float]] = []
        self.batches: list[torch.Tensor] = []
        self.trackers: list[torch.Tensor] = []

    def on_train_start(self, trainer) -> None:
        if trainer.step == 0:
            zero_gate_rows(trainer.model)
        stream = trainer.train_stream
        next_batch = stream.next_batch

        def recording(batch_size):
            batch = next_batch(batch_size)
            self.batches.append(batch.clone())
            return batch

        stream.next_batch = recording

    def on_step_end(self, trainer, step, metrics) -> None:
        keep = ("ce", "l1", "loss", "grad_norm", "lr", "reinit/revived", "sparsity/mean", "dead/mean")
        kept = {k: v for k, v in metrics.items() if k in keep or k.startswith("l1_coeff")}
        self.steps.append({"step": step, **kept})
        self.trackers.append(trainer.sparsity.tracker.tokens_since_fired.clone())

    def on_eval(self, trainer, step, metrics) -> None:
        self.steps[-1]["val_loss"] = metrics["val_loss"]

    def on_checkpoint(self, trainer, step, path) -> None:
        if step == self.kill_at:
            raise SimulatedKill

    def result(self, trainer: Trainer) -> dict:
        return {
            "steps": self.steps,
            "batches": self.batches,
            "trackers": self.trackers,
            **gathered_state(trainer.model, trainer.optimizer),
            "data_state": json.dumps(trainer.train_stream.state_dict(), sort_keys=True),
            "parallel": trainer.parallel_setup,
            # Whether accelerate still takes its FSDP2 paths (no_sync, clipping) after `prepare`.
            "fsdp2_after_prepare": trainer.accelerator.is_fsdp2,
        }


def record_run(cfg: RunConfig, kill_at: int = 0) -> dict:
    recorder = Recorder(kill_at)
    trainer = Trainer(cfg, Path(cfg.run_dir), [recorder])
    trainer.fit()
    return recorder.result(trainer)


def record_killed_and_resumed(run_dir: Path, config: Callable[..., RunConfig] = run_config) -> dict:
    """Train until the checkpoint at KILL_AT, 'crash', then resume=auto in a fresh trainer."""
    with pytest.raises(SimulatedKill):
        record_run(config(run_dir), kill_at=KILL_AT)
    return record_run(config(run_dir, resume="auto"))


def record_preempted_and_resumed(run_dir: Path, config: Callable[..., RunConfig]) -> dict:
    """Train until a real SIGTERM to rank 1's process stops every rank with a checkpoint, then
    resume=auto in a fresh trainer; the step all ranks stopped after, and the resumed run."""
    from callback_targets import SignalAt

    from sparse_llm.training.preemption import TrainingPreempted

    trainer = Trainer(config(run_dir), run_dir, [Recorder(), SignalAt(SIGNAL_AT, "SIGTERM", rank=1)])
    with pytest.raises(TrainingPreempted) as stopped:
        trainer.fit()
    return {"stopped_after": stopped.value.step, **record_run(config(run_dir, resume="auto"))}


def _worker(out: Path) -> None:
    rank = int(os.environ["RANK"])
    results = {
        "straight": record_run(run_config(out / "straight")),
        "resumed": record_killed_and_resumed(out / "resumed"),
        "target": record_run(target_run_config(out / "target")),
    }
    torch.save(results, out / f"rank{rank}.pt")


def byte_model_config(run_dir: Path) -> ModelConfig:
    """The tiny model over 256 token ids, for the runs below that feed it random ids."""
    cfg = run_config(run_dir).model
    cfg.vocab_size = 256
    return cfg


def new_model(cfg: ModelConfig, shard: bool) -> tuple[SparseLlamaForCausalLM, torch.optim.AdamW]:
    """The same initial weights on every call; with `shard`, FSDP2 (torch fully_shard) per layer."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = build_model(cfg)
    if shard:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> float:
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(seed))
    loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _fsdp2_worker(out: Path) -> None:
    """FSDP2 (torch fully_shard, gloo): sharded checkpoint save, load into fresh shards, continue.

    accelerate does not enable FSDP on CPU, so this drives the checkpoint functions the trainer
    uses on a model sharded by torch directly.
    """
    import torch.distributed as dist

    from sparse_llm.training import checkpoint as ckpt_io

    cfg = byte_model_config(out)
    model, optimizer = new_model(cfg, shard=True)
    assert ckpt_io.is_sharded(model)
    for seed in range(2):
        train_step(model, optimizer, seed + 10 * dist.get_rank())
    ckpt_io.save_sharded_state(out / "sharded", model, optimizer)
    full = ckpt_io.full_model_state(model)
    if dist.get_rank() == 0:
        torch.save(full, out / "full.pt")
    fresh, fresh_optimizer = new_model(cfg, shard=True)
    ckpt_io.load_sharded_state(out / "sharded", fresh, fresh_optimizer)
    losses = [
        train_step(m, o, 100 + dist.get_rank()) for m, o in ((model, optimizer), (fresh, fresh_optimizer))
    ]
    torch.save(losses, out / f"losses{dist.get_rank()}.pt")


def reinit_mask() -> torch.Tensor:
    """A known [layers, H] dead mask with units on both FSDP2 shards of H = 64 and at their edges."""
    dead = torch.zeros(TINY_LAYERS, TINY_UNITS, dtype=torch.bool)
    dead[0, [3, 40, 63]] = True
    dead[1, [0, 31, 32]] = True
    return dead


def reinit_from(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    return reinit_dead_units(
        model,
        optimizer,
        reinit_mask(),
        std=0.02,
        reset_up_down=True,
        generator=torch.Generator().manual_seed(7),
    )


def _fsdp2_reinit_worker(out: Path) -> None:
    """Dead-unit reinit on FSDP2 shards (torch fully_shard, gloo) with a known mask, after two steps
    made the AdamW moments non-zero: the full state before and after, for a 1-process replay."""
    import torch.distributed as dist

    model, optimizer = new_model(byte_model_config(out), shard=True)
    for seed in range(2):
        train_step(model, optimizer, seed + 10 * dist.get_rank())
    before = gathered_state(model, optimizer)
    revived = reinit_from(model, optimizer)
    after = gathered_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save({"before": before, "after": after, "revived": revived}, out / "reinit.pt")


def fsdp2_run_config(run_dir: Path, **train_overrides) -> RunConfig:
    """run_config with an export, its reinit re-drawing up rows and down columns too (the columns
    cross the dim-0 shards of down_proj)."""
    cfg = run_config(run_dir, **{"export": True, **train_overrides})
    cfg.sparsity.reinit.reset_up_down = True
    return cfg


def _force_accelerate_fsdp2() -> None:
    """Make the trainer's Accelerator take its FSDP2 path on CPU (gloo).

    accelerate turns FSDP on for GPUs only. Here the environment `accelerate launch --config_file
    configs/accelerate/fsdp2.yaml` would set is set by hand, and the state is switched to FSDP after
    construction, so that `prepare` runs accelerate's own FSDP2 code (fully_shard per DecoderLayer,
    optimizer parameter swap, mixed-precision policy) and the trainer its sharded paths.
    """
    import accelerate
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import sparse_llm.training.trainer as trainer_module

    fsdp = load_config_from_file(str(REPO / "configs" / "accelerate" / "fsdp2.yaml")).fsdp_config
    os.environ.update(
        ACCELERATE_USE_FSDP="true",
        FSDP_VERSION=str(fsdp["fsdp_version"]),
        FSDP_AUTO_WRAP_POLICY=fsdp["fsdp_auto_wrap_policy"],
        FSDP_TRANSFORMER_CLS_TO_WRAP=fsdp["fsdp_transformer_layer_cls_to_wrap"],
        FSDP_RESHARD_AFTER_FORWARD=str(fsdp["fsdp_reshard_after_forward"]).lower(),
        FSDP_STATE_DICT_TYPE=fsdp["fsdp_state_dict_type"],
        FSDP_CPU_RAM_EFFICIENT_LOADING=str(fsdp["fsdp_cpu_ram_efficient_loading"]).lower(),
        FSDP_OFFLOAD_PARAMS=str(fsdp["fsdp_offload_params"]).lower(),
        FSDP_ACTIVATION_CHECKPOINTING=str(fsdp["fsdp_activation_checkpointing"]).lower(),
    )

    class CPUFSDP2Accelerator(accelerate.Accelerator):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            plugin = FullyShardedDataParallelPlugin()
            if self.state.mixed_precision != "no":
                plugin.set_mixed_precision(self.state.mixed_precision)  # as AcceleratorState does on GPU
            self.state.distributed_type = DistributedType.FSDP
            # And in the process's shared state, which `prepare` copies back into the accelerator's
            # (the optimizer wrapper builds a fresh state): as accelerate does for GPUs, so that
            # after `prepare` no_sync and the clipping take their FSDP2 paths here too.
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.state.fsdp_plugin = plugin
            assert self.is_fsdp2

    trainer_module.Accelerator = CPUFSDP2Accelerator


def _trainer_fsdp2_worker(out: Path) -> None:
    """The Trainer under FSDP2: an uninterrupted run, a killed and resumed one, one stopped by a
    SIGTERM to rank 1 and resumed, and a bf16 run."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # the data-parallel part's state: FSDP2 starts afresh
    _force_accelerate_fsdp2()
    rank = int(os.environ["RANK"])
    results = {"straight": record_run(fsdp2_run_config(out / "straight"))}
    results["resumed"] = record_killed_and_resumed(out / "resumed", fsdp2_run_config)
    results["preempted"] = record_preempted_and_resumed(out / "preempted", fsdp2_run_config)
    # Prefetch (1 layer ahead by default) moves only when the all-gathers run: the same steps as
    # FSDP2's own order (0) and as 2 layers ahead, bitwise.
    results["own_order"] = record_run(
        fsdp2_run_config(out / "own_order", fsdp_prefetch=0, max_steps=3, export=False)
    )
    results["prefetch"] = record_run(
        fsdp2_run_config(out / "prefetch", fsdp_prefetch=2, max_steps=3, export=False)
    )
    AcceleratorState._reset_state()  # a new mixed precision needs a fresh accelerate state
    results["bf16"] = record_run(fsdp2_run_config(out / "bf16", precision="bf16", max_steps=2, export=False))
    torch.save(results, out / f"fsdp2_rank{rank}.pt")


# The parts of the launch, in their order (the trainer under FSDP2 last: it switches accelerate to
# FSDP for the rest of the process), each writing into its own folder of the launch's.
PARTS = {
    "fsdp2": _fsdp2_worker,
    "fsdp2_reinit": _fsdp2_reinit_worker,
    "ddp": _worker,
    "trainer_fsdp2": _trainer_fsdp2_worker,
}


def _run_parts(out: Path) -> None:
    """Every part in one gloo process group (accelerate's trainer runs in it too)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))  # not 30: a peer died
    for name, part in PARTS.items():
        (out / name).mkdir(exist_ok=True)
        part(out / name)
        dist.barrier()
    dist.destroy_process_group()


def _run_ranks(out: Path) -> None:
    """The launch's two ranks, as torchrun starts them (its environment: rank, world size, the
    rendezvous address), from one fresh interpreter: it imports everything once (torch, the package,
    TorchDynamo, which each rank's first optimizer would import), then forks rank 1 and is rank 0:
    one interpreter's imports (~9 s of a core) fewer than two. A rank that fails ends the other
    (rank 1 waits at most the process group's timeout for a rank 0 that died)."""
    import torch._dynamo  # noqa: F401  (before the fork: both ranks have it)

    child = os.fork()
    rank = 1 if child == 0 else 0
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    if child == 0:  # rank 1 never returns to the caller: its status is rank 0's to read
        code = 0
        try:
            _run_parts(out)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        _run_parts(out)
    except BaseException:
        os.kill(child, signal.SIGKILL)
        raise
    _, status = os.waitpid(child, 0)
    if status != 0:
        sys.exit(f"rank 1 failed: exit status {os.waitstatus_to_exitcode(status)}")


def _run_one_rank(out: Path) -> None:
    """The trainer under FSDP2 in a process group of one (`accelerate launch --num_processes 1`
    keeps FSDP2's DTensor parameters): an uninterrupted run, and one killed after its checkpoint and
    resumed."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    _force_accelerate_fsdp2()
    results = {
        "straight": record_run(fsdp2_run_config(out / "straight")),
        "resumed": record_killed_and_resumed(out / "resumed", fsdp2_run_config),
    }
    torch.save(results, out / "fsdp2_one_rank.pt")
    dist.destroy_process_group()


def _launch(script_args: list[str], timeout: float = 600, world_size: int = 2) -> None:
    """This file as a script (_run_ranks, or _run_one_rank for one rank), with torchrun's environment
    for `world_size` ranks on this host."""
    with socket.socket() as sock:  # a free port for the ranks' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, str(Path(__file__).resolve()), *script_args]
    # The script imports the tests' shared helpers (tiny.py) from tests/.
    # And this checkout's package first, whatever an installed copy points at.
    paths = (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH"))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        # One rank's own; _run_ranks sets each of its two ranks' after the fork.
        **({"RANK": "0", "LOCAL_RANK": "0"} if world_size == 1 else {}),
    }
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """The one 2-process launch: a folder per part of PARTS."""
    out = tmp_path_factory.mktemp("two_processes")
    _launch([str(out)])
    return out


@pytest.fixture(scope="module")
def two_procs(launched) -> tuple[Path, list[dict]]:
    out = launched / "ddp"
    return out, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def one_proc(tmp_path_factory) -> dict:
    return record_run(run_config(tmp_path_factory.mktemp("single")))


# ---- fast: the row split itself ----------------------------------------------------------------


def test_rank_slices_partition_the_global_stream():
    cfg = run_config(Path("unused")).data
    tok = load_tokenizer(cfg.tokenizer)
    whole = TokenStream(cfg, tok, 16, "train")
    ranks = [RankSlice(TokenStream(cfg, tok, 16, "train"), r, 3) for r in range(3)]
    for _ in range(5):
        parts = [s.next_batch(2) for s in ranks]
        assert torch.equal(torch.cat(parts), whole.next_batch(6))
        states = [s.state_dict() for s in ranks]
        assert all(state == whole.state_dict() for state in states)
    # A rank resumed from the (rank-independent) state continues with its own rows.
    resumed = RankSlice(TokenStream(cfg, tok, 16, "train"), 1, 3)
    resumed.load_state_dict(ranks[0].state_dict())
    assert torch.equal(resumed.next_batch(2), ranks[1].next_batch(2))
    with pytest.raises(ValueError, match="world size"):
        RankSlice(TokenStream(cfg, tok, 16, "train"), 3, 3)


@pytest.mark.parametrize("name, kind", [("ddp", "MULTI_GPU"), ("fsdp2", "FSDP")])
def test_accelerate_configs_load(name, kind):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(REPO / "configs" / "accelerate" / f"{name}.yaml"))
    assert config.distributed_type.name == kind
    assert config.machine_rank == 0 and config.num_machines == 1


# ---- 2 processes against 1 ---------------------------------------------------------------------


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL["atol"] + TOL["rtol"] * abs(b)


@pytest.mark.slow
def test_two_processes_match_one_process(two_procs, one_proc):
    _, ranks = two_procs
    for rank in ranks:
        straight = rank["straight"]
        assert straight["parallel"] == {"mode": "ddp"}
        assert [r["step"] for r in straight["steps"]] == list(range(1, MAX_STEPS + 1))
        for r2, r1 in zip(straight["steps"], one_proc["steps"], strict=True):
            for key in ("ce", "l1", "loss", "grad_norm", "val_loss", "sparsity/mean"):
                if key in r1:
                    assert _close(r2[key], r1[key]), (r1["step"], key, r2[key], r1[key])
        for name, tensor in one_proc["model"].items():
            torch.testing.assert_close(straight["model"][name], tensor, **TOL, msg=name)


@pytest.mark.slow
def test_l1_controller_gives_every_rank_the_single_process_coefficients(two_procs, tmp_path):
    """Every rank computes the coefficients from the all-reduced L0: bit-identical on both ranks
    every step, and those of a single-process run (up to the summation order of the gradients)."""
    _, (rank0, rank1) = two_procs
    single = record_run(target_run_config(tmp_path))["steps"]
    a, b = rank0["target"]["steps"], rank1["target"]["steps"]
    assert a == b
    keys = ("l1_coeff", "l1_coeff/layer_00", "l1_coeff/layer_01")
    assert [r["step"] for r in a] == [r["step"] for r in single] == list(range(1, MAX_STEPS + 1))
    # It adapted every step from the third (a step's L0 sets lambda from the step after next).
    assert len({r["l1_coeff"] for r in a}) == MAX_STEPS - 1
    assert a[0]["l1_coeff"] == single[0]["l1_coeff"]
    for r2, r1 in zip(a, single, strict=True):
        for key in (*keys, "loss", "ce"):
            assert _close(r2[key], r1[key]), (r1["step"], key, r2[key], r1[key])


@pytest.mark.slow
def test_ranks_together_consume_exactly_the_single_process_tokens(two_procs, one_proc):
    _, ranks = two_procs
    per_rank = [rank["straight"]["batches"] for rank in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == len(one_proc["batches"]) // 2
    # Micro-step m of the 2-process run covers global rows [4m, 4m + 4): rank 0 the first two.
    global_rows = torch.cat([torch.cat(pair) for pair in zip(*per_rank, strict=True)])
    assert torch.equal(global_rows, torch.cat(one_proc["batches"]))
    # Same data position (and counters) on both ranks and in the single-process run.
    assert ranks[0]["straight"]["data_state"] == ranks[1]["straight"]["data_state"] == one_proc["data_state"]


@pytest.mark.slow
def test_dead_units_and_replicas_identical_across_ranks(two_procs, one_proc):
    _, (rank0, rank1) = two_procs
    for run in ("straight", "resumed"):
        a, b = rank0[run], rank1[run]
        assert a["steps"] == b["steps"]  # metrics are reduced over ranks: bitwise identical
        for ta, tb in zip(a["trackers"], b["trackers"], strict=True):
            assert torch.equal(ta, tb)
        for name, tensor in a["model"].items():
            assert torch.equal(tensor, b["model"][name]), (run, name)
    revived = [r.get("reinit/revived", 0.0) for r in rank0["straight"]["steps"]]
    assert revived[1] >= 2 * DEAD_ROWS  # the zeroed gate rows were dead after one step, and revived
    # The tracker counts the same tokens as the single-process run.
    assert torch.equal(rank0["straight"]["trackers"][0], one_proc["trackers"][0])


@pytest.mark.slow
def test_resume_under_two_processes_reproduces_the_uninterrupted_run(two_procs):
    out, ranks = two_procs
    for rank in ranks:
        straight, resumed = rank["straight"], rank["resumed"]
        # The resumed trainer recorded steps KILL_AT + 1 .. MAX_STEPS.
        assert [r["step"] for r in resumed["steps"]] == list(range(KILL_AT + 1, MAX_STEPS + 1))
        assert resumed["steps"] == straight["steps"][KILL_AT:]
        assert resumed["batches"] == [] or all(
            torch.equal(x, y)
            for x, y in zip(resumed["batches"], straight["batches"][-len(resumed["batches"]) :], strict=True)
        )
        for name, tensor in straight["model"].items():
            assert torch.equal(tensor, resumed["model"][name]), name
        assert resumed["data_state"] == straight["data_state"]
    logged = [
        json.loads(line)["step"] for line in (out / "resumed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert logged == list(range(1, MAX_STEPS + 1))


@pytest.mark.slow
def test_two_process_checkpoint_resumes_on_one_process(two_procs, tmp_path):
    out, ranks = two_procs
    source = out / "straight" / "checkpoints" / f"step_{KILL_AT:08d}"
    shutil.copytree(source, tmp_path / "checkpoints" / source.name)
    resumed = record_run(run_config(tmp_path, resume="auto"))
    straight = ranks[0]["straight"]
    for r1, r2 in zip(resumed["steps"], straight["steps"][KILL_AT:], strict=True):
        for key in ("ce", "l1", "loss", "val_loss"):
            if key in r2:
                assert _close(r1[key], r2[key]), (r2["step"], key)
    assert resumed["data_state"] == straight["data_state"]


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_resumes_exactly_and_consolidates(launched):
    from sparse_llm.model import state as model_state
    from sparse_llm.training import checkpoint as ckpt_io

    out = launched / "fsdp2"
    for rank in range(2):
        before, after = torch.load(out / f"losses{rank}.pt", weights_only=True)
        assert before == after  # the reloaded shards continue bitwise like the originals
    assert sorted(p.name for p in (out / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    full = torch.load(out / "full.pt", weights_only=True)
    consolidated = ckpt_io.consolidate_sharded(out)  # one process, no process group
    assert full.keys() == consolidated.keys()
    for name, tensor in full.items():
        assert torch.equal(tensor, consolidated[name]), name
    # The consolidated state loads into a plain (unsharded) model: what the HF export needs.
    model_state.load_model_state(build_model(byte_model_config(out)), consolidated)


@pytest.mark.slow
def test_reinit_on_fsdp2_shards_is_bitwise_the_single_process_reinit(launched, tmp_path):
    """Reinit with a known mask on FSDP2 shards, against the same reinit of the same (gathered)
    state in one process: weights and AdamW moments bitwise equal, as every rank draws the full
    rows from the same generator and only copies its part of them (no arithmetic differs)."""
    sharded = torch.load(launched / "fsdp2_reinit" / "reinit.pt", weights_only=True)
    before, after = sharded["before"], sharded["after"]
    model, optimizer = new_model(byte_model_config(tmp_path), shard=False)
    model.load_state_dict(before["model"])
    for name, param in model.named_parameters():
        optimizer.state[param] = {key: before["optimizer"][f"{name}.{key}"].clone() for key in MOMENTS}
    assert reinit_from(model, optimizer) == sharded["revived"] == reinit_mask().sum()
    single = gathered_state(model, optimizer)
    for part in ("model", "optimizer"):
        assert single[part].keys() == after[part].keys()
        for name, tensor in single[part].items():
            assert torch.equal(after[part][name], tensor), (part, name)
    # The reinit did write on both shards: the re-drawn gate rows of layer 1 straddle them, and
    # the moments of the (live) units it re-drew were reset.
    gate = "model.layers.1.mlp.gate_proj.weight"
    changed = (after["model"][gate] != before["model"][gate]).all(-1).nonzero().squeeze(1)
    assert changed.tolist() == [0, 31, 32]
    for key in MOMENTS:
        assert (before["optimizer"][f"{gate}.{key}"][changed] != 0).any()
        assert (after["optimizer"][f"{gate}.{key}"][changed] == 0).all()


@pytest.mark.slow
def test_trainer_under_fsdp2_matches_one_process_resumes_and_exports(launched, tmp_path):
    """The trainer's FSDP2 path end to end on CPU (see _force_accelerate_fsdp2): sharded weights,
    losses, dead-unit reinit, weights and AdamW moments equal to a single-process run, sharded
    checkpoints that resume bitwise after a kill and after a SIGTERM to one rank, an export
    gathered from the shards, and an fp32 loss under the bf16 policy."""
    from safetensors.torch import load_file

    out = launched / "trainer_fsdp2"
    single = record_run(fsdp2_run_config(tmp_path / "single"))
    ranks = [torch.load(out / f"fsdp2_rank{r}.pt", weights_only=True) for r in range(2)]
    assert single["parallel"] == {"mode": "single"}
    for rank in ranks:
        straight, resumed = rank["straight"], rank["resumed"]
        # What run_info.json records: the launcher's setting (configs/accelerate/fsdp2.yaml keeps
        # each layer's gathered parameters for its backward).
        assert straight["parallel"] == {"mode": "fsdp2", "reshard_after_forward": False, "prefetch": 1}
        assert straight["fsdp2_after_prepare"] and resumed["fsdp2_after_prepare"]
        assert rank["bf16"]["fsdp2_after_prepare"]
        assert [r["step"] for r in straight["steps"]] == list(range(1, MAX_STEPS + 1))
        for r2, r1 in zip(straight["steps"], single["steps"], strict=True):
            for key in ("ce", "l1", "loss", "val_loss"):
                if key in r1:
                    assert _close(r2[key], r1[key]), (r1["step"], key, r2[key], r1[key])
            # A pre-activation within round-off of 0 may fire in one run and not the other: one
            # unit on one token moves the sparsity by 1 / (256 tokens x 64 units x 2 layers).
            assert abs(r2["sparsity/mean"] - r1["sparsity/mean"]) <= 2 / (256 * 64 * 2), r1["step"]
            # The gradients agree to ~1e-7, but torch's fp32 norm of them is itself off by a few
            # 1e-5 (relative, against fp64) on CPU, differently for whole and sharded tensors.
            assert abs(r2["grad_norm"] - r1["grad_norm"]) <= 1e-4 * r1["grad_norm"], r1["step"]
        # The same units revived at the same steps (the zeroed gate rows at step 2, on both shards).
        revived = [r.get("reinit/revived") for r in straight["steps"]]
        assert revived == [r.get("reinit/revived") for r in single["steps"]]
        assert revived[1] >= 2 * DEAD_ROWS
        # Weights and moments to fp32 round-off (the sharded gradient reduction sums in another
        # order), amplified in the moments where a unit fired in one run only (see the sparsity):
        # up to 2e-3 of a moment's largest value here. A row re-drawn wrongly would be off by
        # about its own size.
        for name, tensor in single["model"].items():
            torch.testing.assert_close(straight["model"][name], tensor, **TOL, msg=name)
        for name, tensor in single["optimizer"].items():
            scale = tensor.abs().max().item()
            torch.testing.assert_close(
                straight["optimizer"][name], tensor, rtol=0, atol=1e-2 * scale, msg=name
            )
        for part in ("model", "optimizer"):
            assert straight[part].keys() == single[part].keys() == resumed[part].keys()
            for name, tensor in straight[part].items():
                assert torch.equal(resumed[part][name], tensor), (part, name)
        assert resumed["steps"] == straight["steps"][KILL_AT:]
        # SIGTERM to one rank: both stopped after the same step, wrote one sharded checkpoint, and
        # resumed bitwise.
        preempted = rank["preempted"]
        assert preempted["stopped_after"] == STOPPED_AFTER
        assert preempted["steps"] == straight["steps"][STOPPED_AFTER:]
        for part in ("model", "optimizer"):
            for name, tensor in straight[part].items():
                assert torch.equal(preempted[part][name], tensor), ("preempted", part, name)
        assert preempted["data_state"] == straight["data_state"]
        # (its last step also holds the run's final evaluation, which the longer run makes later)
        first_steps = [{k: v for k, v in r.items() if k != "val_loss"} for r in straight["steps"][:3]]
        for order in ("own_order", "prefetch"):
            steps = [{k: v for k, v in r.items() if k != "val_loss"} for r in rank[order]["steps"]]
            assert steps == first_steps, order
        assert resumed["data_state"] == straight["data_state"] == single["data_state"]
        # bf16 compute, but the loss stays fp32: accelerate's default policy casts the model's
        # outputs to bf16, whose spacing at a loss in [4, 16) is 2^-5 or more (2^-7 after the mean
        # over 2 micro-batches and 2 ranks).
        ces = [r["ce"] for r in rank["bf16"]["steps"]]
        assert all(4 <= ce < 16 and (ce * 2**8) % 1 != 0 for ce in ces), ces
    step_dir = out / "straight" / "checkpoints" / f"step_{MAX_STEPS:08d}"
    assert sorted(p.name for p in (step_dir / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (step_dir / "model.safetensors").exists()
    stopped = out / "preempted" / "checkpoints" / f"step_{STOPPED_AFTER:08d}" / "sharded"
    assert sorted(p.name for p in stopped.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    exported = load_file(out / "straight" / "export" / "model.safetensors")
    reference = load_file(tmp_path / "single" / "export" / "model.safetensors")
    assert exported.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, **TOL, msg=name)
    resumed_export = load_file(out / "resumed" / "export" / "model.safetensors")
    for name, tensor in exported.items():
        assert torch.equal(resumed_export[name], tensor), name
    # The sharded checkpoint resumes in one process without FSDP2 (DCP loads the shards whole):
    # the steps of the uninterrupted 2-process run, to the round-off of one process against two.
    source = out / "straight" / "checkpoints" / f"step_{KILL_AT:08d}"
    shutil.copytree(source, tmp_path / "one_process" / "checkpoints" / source.name)
    resumed_alone = record_run(fsdp2_run_config(tmp_path / "one_process", resume="auto"))
    straight = ranks[0]["straight"]
    for r1, r2 in zip(resumed_alone["steps"], straight["steps"][KILL_AT:], strict=True):
        for key in ("ce", "l1", "loss", "val_loss"):
            if key in r2:
                assert _close(r1[key], r2[key]), (r2["step"], key, r1[key], r2[key])
    assert resumed_alone["data_state"] == straight["data_state"]


@pytest.mark.slow
def test_trainer_under_fsdp2_on_one_process_checkpoints_and_resumes(tmp_path):
    """FSDP2 on one process (DTensor parameters, a group of one) writes sharded checkpoints and
    resumes them bitwise; its steps are the plain single-process run's to round-off. (Its checkpoint
    once took the unsharded path and failed on the DTensors.)"""
    _launch([str(tmp_path)], world_size=1)
    runs = torch.load(tmp_path / "fsdp2_one_rank.pt", weights_only=True)
    straight, resumed = runs["straight"], runs["resumed"]
    step_dir = tmp_path / "resumed" / "checkpoints" / f"step_{MAX_STEPS:08d}"
    assert sorted(p.name for p in (step_dir / "sharded").glob("*.distcp")) == ["__0_0.distcp"]
    assert resumed["steps"] == straight["steps"][KILL_AT:]
    for part in ("model", "optimizer"):
        for name, tensor in straight[part].items():
            assert torch.equal(resumed[part][name], tensor), (part, name)
    single = record_run(fsdp2_run_config(tmp_path / "single"))
    for r1, r2 in zip(straight["steps"], single["steps"], strict=True):
        for key in ("ce", "l1", "loss", "val_loss"):
            if key in r2:
                assert _close(r1[key], r2[key]), (r2["step"], key, r1[key], r2[key])
    for name, tensor in single["model"].items():
        torch.testing.assert_close(straight["model"][name], tensor, **TOL, msg=name)


if __name__ == "__main__":
    if os.environ["WORLD_SIZE"] == "1":
        _run_one_rank(Path(sys.argv[1]))
    else:
        _run_ranks(Path(sys.argv[1]))
    # Rank 0 ends as rank 1 does, without the interpreter's teardown (~2 s of a core after torch,
    # accelerate and a process group): everything the tests read is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
