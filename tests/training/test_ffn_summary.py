"""The run log's FFN line, in words."""

from __future__ import annotations

import torch

from sparse_llm.config import ModelConfig
from sparse_llm.model import FFNPlan
from sparse_llm.ops.ffn.select import FFNSelection
from sparse_llm.training.ffn_summary import describe_ffn

CPU = torch.device("cpu")


def plan(requested: str) -> FFNPlan:
    return FFNPlan.resolve(requested, ModelConfig(), CPU, torch.float32)


def test_what_was_asked_for_and_what_would_run_the_kernels():
    assert (
        describe_ffn(plan("dense"), "dense", CPU) == "dense (asked for); the sparse kernels need a Hopper GPU"
    )
    assert describe_ffn(plan("reference"), "reference", CPU) == (
        "the sparse ops' PyTorch reference (asked for); the sparse kernels need a Hopper GPU"
    )


def test_auto_says_why_not_the_kernels():
    assert describe_ffn(plan("auto"), "auto", CPU) == (
        "dense (model.ffn_impl=auto chose it: tensors are on cpu, the kernels need a CUDA (Hopper) GPU)"
    )


def test_phases_are_named_only_where_they_differ():
    kernels, dense = FFNSelection("cuda", None), FFNSelection("dense", "the kernels take bfloat16")
    assert describe_ffn(FFNPlan(kernels, kernels, dense, dense), "auto", CPU) == (
        "training and evaluation: the sparse CUDA kernels (model.ffn_impl=auto chose it); "
        "prefill and decode: dense (model.ffn_impl=auto chose it: the kernels take bfloat16)"
    )
