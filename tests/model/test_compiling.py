"""compile_model: one graph per call for a model whose sparse training FFN returns records of
data-dependent length (plain torch.compile breaks the graph at every layer there)."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model
from sparse_llm.model.compiling import compile_model


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=128,
        ffn_impl="reference",  # the reference training op: the same data-dependent record sizes as the CUDA op
    )
    return build_model(cfg)


def _loss_and_grads(forward, model, ids):
    out = forward(ids[:, :-1], labels=ids[:, 1:], with_stats=True)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.ffn_stats.nnz_per_token, grads


def test_compile_model_captures_the_sparse_training_ffn_in_one_graph():
    torch._dynamo.reset()
    model = _model()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    counter = CompileCounterWithBackend("inductor")
    compiled = compile_model(model, backend=counter)
    eager = _loss_and_grads(model, model, ids)
    for _ in range(2):  # the second call reuses the graph
        loss, nnz, grads = _loss_and_grads(compiled, model, ids)
    assert counter.frame_count == 1
    torch.testing.assert_close(loss, eager[0])
    assert torch.equal(nnz, eager[1])
    for got, want in zip(grads, eager[2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch._dynamo.config.capture_dynamic_output_shape_ops  # scoped to the calls


def test_plain_torch_compile_breaks_the_graph_at_each_sparse_layer():
    """Why compile_model exists: without the flag every FFN layer ends a graph."""
    torch._dynamo.reset()
    model = _model()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    counter = CompileCounterWithBackend("eager")
    torch.compile(model, backend=counter)(ids[:, :-1], labels=ids[:, 1:], with_stats=True)
    assert counter.frame_count > 1
