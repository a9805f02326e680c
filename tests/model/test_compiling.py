"""compile_model: each decoder layer and the head compiled as regions, the sparse training FFN's
records of data-dependent length captured in them (plain torch.compile breaks the graph at every
layer there), and a layer's FFN path changing without recompiling."""

from __future__ import annotations

import contextvars
import itertools

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model
from sparse_llm.model.compiling import compile_model, compiled_graphs

LAYERS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        vocab_size=128,
        ffn_impl="reference",  # the reference training op: the same data-dependent record sizes as the CUDA op
    )
    return build_model(cfg)


def _loss_and_grads(forward, model, ids):
    out = forward(ids[:, :-1], labels=ids[:, 1:], with_stats=True)
    (out.loss + 1e-2 * out.ffn_stats.l1.mean()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.ffn_stats.nnz_per_token, grads


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    for g, w in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_compile_model_captures_the_sparse_training_ffn_in_one_graph_per_region():
    torch._dynamo.reset()
    model = _model()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    eager = _loss_and_grads(model, model, ids)
    counter = CompileCounterWithBackend("inductor")
    compiled = compile_model(model, backend=counter)
    context_size = []
    for _ in range(3):  # the later calls reuse the graphs
        _assert_same(_loss_and_grads(compiled, model, ids), eager)
        context_size.append(len(contextvars.copy_context()))
    assert counter.frame_count == 2  # one graph shared by every layer, one for the head
    assert not torch._dynamo.config.capture_dynamic_output_shape_ops  # scoped to the calls
    # a config patch made per call added a ContextVar for good each time (the context grew a step)
    assert context_size[1] == context_size[2]


def test_fallback_flips_compile_each_variant_once_and_change_no_loss():
    """Every layer's training FFN flipped between the sparse op and the dense fallback (which
    recomputes in the backward), in many patterns: the compiled graphs are bounded by the variants
    (sparse layer, dense layer, head), not by the flips, and every step equals the uncompiled
    model's on the same weights."""
    torch._dynamo.reset()
    model, reference = _model(), _model()  # same seed: the same weights
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(2))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = compile_model(model, backend=counter)
    before = compiled_graphs()
    patterns = list(itertools.product([False, True], repeat=LAYERS))
    for flags in patterns + patterns[::-1]:
        model.set_ffn_dense_fallback(flags)
        reference.set_ffn_dense_fallback(flags)
        _assert_same(_loss_and_grads(compiled, model, ids), _loss_and_grads(reference, reference, ids))
    assert counter.frame_count == 3
    assert compiled_graphs() - before == 3
    with torch.no_grad():  # evaluation: one more variant of each region
        compiled(ids[:, :-1], labels=ids[:, 1:])
    assert counter.frame_count == 5


def test_plain_torch_compile_breaks_the_graph_at_each_sparse_layer():
    """Why compile_model sets capture_dynamic_output_shape_ops: without it every FFN layer ends a
    graph."""
    torch._dynamo.reset()
    model = _model()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    counter = CompileCounterWithBackend("eager")
    torch.compile(model, backend=counter)(ids[:, :-1], labels=ids[:, 1:], with_stats=True)
    assert counter.frame_count > 1
