"""training/dtensor_leak.py: the Python key equals the installed torch's C++ one on every pairing of
argument kinds and on what an FSDP2 step builds, and steps with the Python key train the same
weights. (Run by hand under torch 2.10-2.12 too: the key matches 2.11's and 2.12's helper, not
2.10's, which the fix then leaves alone.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparse_llm.training import dtensor_leak

# 2.10's helper keys strategy arguments differently; the fix leaves that release alone.
matching_release = pytest.mark.skipif(
    dtensor_leak.torch_release() < (2, 11), reason="the Python key is 2.11's and later releases'"
)

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request):
    """A process group of this process alone (FSDP2 on that device: gloo on CPU, NCCL on a GPU)."""
    backend = "nccl" if request.param == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield torch.device(request.param)
    finally:
        dist.destroy_process_group()


def sharded_model(device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(3)))
    model.to(device)
    for block in model:
        fully_shard(block)
    return fully_shard(model)


def train(model: nn.Module, steps: int) -> list[torch.Tensor]:
    """The trainer's optimizer step as on a GPU: fused AdamW in two groups, a clipped gradient."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    device = decay[0].device
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(device)
        model(x).square().mean().backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


@matching_release
def test_python_key_is_torchs_key_on_the_schemas_of_fsdp2_steps(device, monkeypatch):
    import torch.distributed.tensor._op_schema as op_schema

    torch_post_init = op_schema._DTensor_OpSchema_post_init
    seen = []

    def recording(schema) -> None:
        torch_post_init(schema)
        seen.append((schema, schema._comparison_key))

    monkeypatch.setattr(op_schema, "_DTensor_OpSchema_post_init", recording)
    train(sharded_model(device), steps=3)
    for schema, key in seen:
        assert dtensor_leak.comparison_key(schema) == key, schema.op
    # Among them: the optimizer's and clip_grad_norm_'s list ops, and strategy schemas.
    ops = {str(schema.op) for schema, _ in seen}
    assert any("_fused_adamw_" in op for op in ops) and any("_foreach_norm" in op for op in ops), ops
    assert any(isinstance(arg, op_schema.OpStrategy) for schema, _ in seen for arg in schema.args_schema)


@matching_release
def test_a_model_trained_with_the_python_key_is_bitwise_the_same(device, monkeypatch):
    import torch.distributed.tensor._op_schema as op_schema
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    # Each run fills DTensor's sharding caches afresh: the second with Python keys.
    _clear_sharding_prop_cache()
    before = train(sharded_model(device), steps=3)
    # Forced on whatever torch runs here; the module's bindings come back after the test.
    for name in ("_DTensor_OpSchema_post_init", "_DTensor_OpSchema_recompute_comparison_key"):
        monkeypatch.setattr(op_schema, name, getattr(op_schema, name))
    monkeypatch.setattr(dtensor_leak, "torch_leaks", lambda: True)
    assert dtensor_leak.fix_dtensor_op_schema_leak()
    assert op_schema._DTensor_OpSchema_post_init is dtensor_leak._set_comparison_key
    _clear_sharding_prop_cache()
    after = train(sharded_model(device), steps=3)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


@matching_release
def test_python_key_is_torchs_key_on_every_pairing_of_argument_kinds():
    assert dtensor_leak.key_matches_torch()


def test_the_releases_that_leak():
    assert not dtensor_leak.torch_leaks("2.9.1")
    assert dtensor_leak.torch_leaks("2.10.0") and dtensor_leak.torch_leaks("2.11.0+cu130")
    assert dtensor_leak.torch_leaks("2.12.0")
    assert not dtensor_leak.torch_leaks("2.13.0+cpu") and not dtensor_leak.torch_leaks("3.0.0")
