"""The static-shape decode step (sparse_llm.inference.decode) against the eager decode: the same
logits, cache and tokens on CPU (uncaptured); captured in CUDA graphs on a GPU (`gpu` marker)."""

from __future__ import annotations

import pytest
import torch
from ffn_patterns import needs_hopper

from sparse_llm.config import ModelConfig
from sparse_llm.inference import SamplingParams, StaticDecoder, decode, generate_ids, resolve_decode_mode
from sparse_llm.inference.decode import EOS_CHECK_EVERY, decode_step, why_not_graph
from sparse_llm.inference.generate import eager_decode_from, left_pad
from sparse_llm.inference.sampling import filter_logits, sample_next
from sparse_llm.model import FFNPlan, KVCache, build_model
from sparse_llm.model.kv_cache import ColumnWriteCache
from sparse_llm.ops.ffn.inference import DECODE_MAX_ROWS
from sparse_llm.ops.ffn.select import FFNSelection
from sparse_llm.ops.kv_cache_write import write_kv

# Prompts of three lengths: the batch is left-padded, each row has its own positions and mask.
PROMPTS = [[5, 9, 13, 2, 7, 31, 8], [11, 4], [3, 17, 23, 29]]


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32):
    cfg = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        initializer_range=0.2,  # peaked logits: no near ties for rounding to flip
    )
    torch.manual_seed(0)
    return build_model(cfg).to(device=device, dtype=dtype).eval()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, **kw)


SAMPLINGS = [
    greedy(40),
    SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, stop_at_eos=False),
    SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.8, top_k=20, seed=3),
]


@torch.no_grad()
def test_decode_step_logits_and_cache_equal_the_eager_decode():
    """Step by step on padded prompts: model.decode_step (the whole cache under a device-side key
    mask, writes at device-side columns) gives the logits of forward(cache=...) over the filled
    columns with a growing mask, and writes the same cache columns."""
    model = tiny_model()
    cfg, batch = model.config, len(PROMPTS)
    width = max(map(len, PROMPTS))
    lengths = torch.tensor([len(p) for p in PROMPTS])
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.arange(width)[None] >= (width - lengths)[:, None]
    positions = (torch.arange(width)[None] - (width - lengths)[:, None]).clamp(min=0)
    steps = 6
    eager_cache = KVCache(cfg, batch, width + steps, "cpu", torch.float32)
    static_cache = KVCache(cfg, batch, 256, "cpu", torch.float32)
    logits = model(ids, cache=eager_cache, position_ids=positions, attention_mask=mask).logits[:, -1]
    static_cache.k[:, :, :width] = eager_cache.k[:, :, :width]
    static_cache.v[:, :, :width] = eager_cache.v[:, :, :width]
    static_cache.k[:, :, width:] = 5.0  # stale values of an earlier batch: masked out
    static_cache.v[:, :, width:] = -5.0
    first_columns = width - lengths
    for step in range(steps):
        token = logits.argmax(-1)
        pos, col = lengths + step, torch.full((batch,), width + step)
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.bool)], dim=1)
        logits = model(
            token[:, None], cache=eager_cache, position_ids=pos[:, None], attention_mask=mask
        ).logits
        logits = logits[:, -1]
        static = model.decode_step(token, static_cache, pos, col, first_columns)
        torch.testing.assert_close(static, logits, rtol=1e-5, atol=1e-5)
        # The write is the same arithmetic: layer 0's columns (from the same embeddings) are equal
        # bit for bit; later layers' inputs went through attentions of different shapes.
        new = slice(width + step, width + step + 1)
        for cache in ("k", "v"):
            static_kv, eager_kv = (
                getattr(static_cache, cache)[:, :, new],
                getattr(eager_cache, cache)[:, :, new],
            )
            assert torch.equal(static_kv[0], eager_kv[0])
            torch.testing.assert_close(static_kv, eager_kv, rtol=1e-5, atol=1e-5)
    assert (static_cache.k[:, :, width + steps :] == 5.0).all()  # nothing written past the column


def test_column_write_lands_at_each_rows_column():
    """Rows write at different device-side columns; the values are write_kv's, nothing else moves."""
    layers, batch, max_len, heads, head_dim = 2, 3, 16, 2, 8
    cache = KVCache.from_tensors(*(torch.zeros(layers, batch, max_len, heads, head_dim) for _ in "kv"))
    k, v = torch.randn(batch, 1, heads, head_dim), torch.randn(batch, 1, heads, head_dim)
    cos, sin = torch.rand(batch, 1, 1, head_dim), torch.rand(batch, 1, 1, head_dim)
    columns = torch.tensor([3, 0, 15])
    k_all, v_all = ColumnWriteCache(cache, columns, torch.zeros_like(columns)).update(1, k, v, cos, sin)
    assert k_all.shape == v_all.shape == (batch, heads, max_len, head_dim)  # the whole cache
    want_k, want_v = torch.zeros(1, batch, 1, heads, head_dim), torch.zeros(1, batch, 1, heads, head_dim)
    write_kv(want_k, want_v, 0, 0, k, v, cos, sin)
    for row, col in enumerate(columns.tolist()):
        assert torch.equal(cache.k[1, row, col], want_k[0, row, 0])
        assert torch.equal(cache.v[1, row, col], v[row, 0])
    assert int((cache.k != 0).any(-1).any(-1).sum()) == batch and not cache.k[0].any()


@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "seeded", "seeded_top_p_top_k"])
def test_static_generation_equals_eager(params):
    model = tiny_model()
    decoder = StaticDecoder(model, capture=False)
    free = generate_ids(model, PROMPTS, params)
    assert generate_ids(model, PROMPTS, params, decoder=decoder).tokens == free.tokens
    # An EOS that row 0 samples at its third token: row 0 stops there, the others go on or stop at
    # their own; the same in both paths. (The seeded run does not stop at EOS: same tokens.)
    eos = (free.tokens[0][2],)
    eager = generate_ids(model, PROMPTS, params, eos)
    static = generate_ids(model, PROMPTS, params, eos, decoder=decoder)
    assert static.tokens == eager.tokens and static.finish_reasons == eager.finish_reasons
    if params.stop_at_eos:
        row0 = free.tokens[0]
        assert eager.finish_reasons[0] == "eos" and eager.tokens[0] == row0[: row0.index(eos[0]) + 1]
    # A single prompt, then the batch again (its slot is reused).
    for prompts in (PROMPTS[1:2], PROMPTS):
        assert generate_ids(model, prompts, params, eos, decoder=decoder).tokens == (
            generate_ids(model, prompts, params, eos).tokens
        )
    assert set(decoder.slots) == {(3, 256), (1, 256)}


def test_compiled_static_step_equals_eager():
    """The step's forward through Inductor (`compile=True`, fullgraph: the KV write and the FFN
    are ops it traces) gives the eager decode's greedy tokens."""
    model = tiny_model()
    decoder = StaticDecoder(model, capture=False, compile=True)
    assert generate_ids(model, PROMPTS, greedy(6), decoder=decoder).tokens == (
        generate_ids(model, PROMPTS, greedy(6)).tokens
    )


def test_every_row_stopping_early_ends_the_static_loop():
    """All rows sample an EOS early: the loop stops at its next check (every EOS_CHECK_EVERY
    steps), not after max_new_tokens; the trimmed tokens equal the eager decode's."""
    model = tiny_model()
    params = greedy(4 * EOS_CHECK_EVERY)
    free = generate_ids(model, PROMPTS, params)
    eos = tuple({row[1] for row in free.tokens})  # every row's second token is an EOS
    eager = generate_ids(model, PROMPTS, params, eos)
    assert eager.finish_reasons == ["eos"] * 3
    decoder = StaticDecoder(model, capture=False)
    padded = left_pad(PROMPTS, torch.device("cpu"))

    def prefill(cache: KVCache) -> torch.Tensor:
        out = model(padded.ids, cache=cache, position_ids=padded.positions, attention_mask=padded.mask)
        return out.logits[:, -1]

    table = decoder.generate(prefill, padded.lengths, padded.width, params, torch.tensor(eos))
    assert table.shape == (3, EOS_CHECK_EVERY)
    assert generate_ids(model, PROMPTS, params, eos, decoder=decoder).tokens == eager.tokens


def test_decode_from_a_prefilled_cache_repeats_the_generation():
    """Both decode loops from a cache the caller prefilled (what the inference benchmark times):
    `eager_decode_from` and `DecodeSlot.decode` give generate_ids' tokens, and again when run a
    second time from the same prefill (the cache rewound to the prompt's columns)."""
    model = tiny_model()
    params = greedy(6)
    padded = left_pad(PROMPTS, torch.device("cpu"))
    want = torch.tensor(generate_ids(model, PROMPTS, params).tokens)

    def prefill(cache: KVCache) -> torch.Tensor:
        out = model(padded.ids, cache=cache, position_ids=padded.positions, attention_mask=padded.mask)
        return out.logits[:, -1]

    cache = KVCache(model.config, len(PROMPTS), padded.width + 6, "cpu", torch.float32)
    logits = prefill(cache)
    for _ in range(2):
        cache.length = padded.width
        assert torch.equal(eager_decode_from(model, logits, cache, params, padded.lengths), want)
    slot = StaticDecoder(model, capture=False).slot(len(PROMPTS), padded.width + 6, 0)
    slot.step_for(params)
    first = prefill(slot.state.prefill_cache()).argmax(-1)
    no_eos = torch.empty(0, dtype=torch.long)
    for _ in range(2):
        assert torch.equal(slot.decode(first, padded.lengths, padded.width, params, no_eos), want)


def test_a_capture_warms_up_from_a_reset_state(monkeypatch):
    """A capture runs warm-up steps on the slot's buffers. After a batch that decoded up to the
    cache's last column they must start over at column 0, not write past the cache. (Capture
    itself needs a GPU: a stand-in runs the warm-up steps and then the step.)"""

    class WarmUpOnly:
        def __init__(self, step, memory, generator) -> None:
            for _ in range(decode.WARMUP_STEPS):
                step()
            self.step = step

        def __call__(self) -> None:
            self.step()

    monkeypatch.setattr(decode, "DecodeGraph", WarmUpOnly)
    model = tiny_model()
    decoder = StaticDecoder(model, capture=False)
    padded = left_pad(PROMPTS, torch.device("cpu"))
    steps = decode.CACHE_LEN_MULTIPLE - padded.width  # the last step writes the last column
    decoder.slot(len(PROMPTS), padded.width + steps, 0).graph_memory = "memory"  # as on a GPU
    for params in (greedy(steps, stop_at_eos=False), SAMPLINGS[1]):  # the second captures anew
        params = SamplingParams(**{**params.__dict__, "max_new_tokens": steps})
        assert generate_ids(model, PROMPTS, params, decoder=decoder).tokens == (
            generate_ids(model, PROMPTS, params).tokens
        )
    assert len(decoder.slots[(3, decode.CACHE_LEN_MULTIPLE)].steps) == 2


def test_slots_share_one_cache_memory():
    model = tiny_model()
    decoder = StaticDecoder(model, capture=False)
    a = decoder.slot(3, 100, 1)
    b = decoder.slot(1, 300, 1)
    assert a.state.cache.k.shape[1:3] == (3, 256) and b.state.cache.k.shape[1:3] == (1, 512)
    assert a.state.cache.k.is_contiguous() and b.state.cache.k.is_contiguous()
    assert a.state.cache.k.data_ptr() == b.state.cache.k.data_ptr()
    assert decoder.slot(3, 200, 1) is a and decoder.slot(3, 200, 9) is not a  # more EOS ids
    big = decoder.slot(8, 600, 1)  # needs more memory: it grows and drops the older slots
    assert list(decoder.slots) == [(8, 768)] and big.state.cache.k.shape[1:3] == (8, 768)


def test_sample_next_draws_what_multinomial_draws():
    """sample_next replaced torch.multinomial (two host syncs) by the race multinomial draws one
    sample with: the same tokens, and the generator left in the same state."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50),
    ):
        for seed in range(5):
            ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            probs = filter_logits(logits / params.temperature, params.top_k, params.top_p).softmax(-1)
            want = torch.multinomial(probs, 1, generator=theirs).squeeze(-1)
            assert torch.equal(sample_next(logits, params, ours), want)
            assert torch.equal(ours.get_state(), theirs.get_state())


def test_decode_mode_is_resolved_once_with_a_reason():
    model = tiny_model()
    assert resolve_decode_mode(model, "auto") == (
        "eager",
        "CUDA graphs need a CUDA device; the model is on cpu",
    )
    assert resolve_decode_mode(model, "static")[0] == "static"
    assert resolve_decode_mode(model, "eager")[0] == "eager"
    with pytest.raises(ValueError, match="decode='graph' cannot run: CUDA graphs need a CUDA device"):
        resolve_decode_mode(model, "graph")
    with pytest.raises(ValueError, match="decode must be one of"):
        resolve_decode_mode(model, "compiled")
    with pytest.raises(ValueError, match="cannot capture"):
        StaticDecoder(model, capture=True)
    with pytest.raises(ValueError, match="another model"):
        generate_ids(model, PROMPTS, greedy(2), decoder=StaticDecoder(tiny_model(), capture=False))


def test_the_kernels_decode_ffn_is_capturable_on_its_decode_path(monkeypatch):
    """The kernels' decode FFN reads nothing on the host where its decode kernel takes the rows
    (ops.ffn.inference.decode_kernel_fits; elsewhere the TwELL kernels read their heavy-row count):
    capturable there, per batch."""
    dense = FFNSelection("dense", "dense was asked for")
    model = tiny_model().with_ffn_plan(FFNPlan(dense, dense, dense, FFNSelection("cuda", None)))
    max_dim = 64
    monkeypatch.setattr(decode, "decode_kernel_fits", lambda rows, dim: rows <= 4 and dim <= max_dim)
    on_cpu = "CUDA graphs need a CUDA device; the model is on cpu"
    assert why_not_graph(model) == why_not_graph(model, 4) == on_cpu
    assert why_not_graph(model, 5).startswith("the 'cuda' decode FFN reads on the host at batch 5")
    max_dim = 32
    assert "reads on the host at hidden size 64" in why_not_graph(model)
    with pytest.raises(ValueError, match="decode='graph' cannot run: the 'cuda' decode FFN"):
        resolve_decode_mode(model, "graph")


# --------------------------------------------------------------------------------------------
# GPU: the step captured in CUDA graphs.


def _cuda_model():
    return tiny_model("cuda", torch.bfloat16)


@pytest.mark.gpu
@torch.no_grad()
def test_captured_step_replays_new_inputs_like_the_uncaptured_step():
    """One graph, captured once, replayed on two different batches loaded into its buffers: the
    tokens, finished flags and cache equal those of the same step run uncaptured."""
    model = _cuda_model()
    results = {}
    for capture in (False, True):
        decoder = StaticDecoder(model, capture=capture)
        slot = decoder.slot(3, 64, 1)
        step = slot.step_for(greedy(8))
        runs = []
        for shift in (0, 11):  # two batches: other tokens, lengths and prefills
            prompts = [[(t + shift) % 97 for t in p] for p in PROMPTS]
            lengths = torch.tensor([len(p) for p in prompts], device="cuda")
            width = 7
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
            cols = torch.arange(width, device="cuda")[None]
            mask = cols >= (width - lengths)[:, None]
            logits = model(
                ids,
                cache=slot.state.prefill_cache(),
                position_ids=(cols - (width - lengths)[:, None]).clamp(min=0),
                attention_mask=mask,
                last_logits_only=True,
            ).logits[:, -1]
            slot.state.load(logits.argmax(-1), lengths, width, torch.tensor([5], device="cuda"))
            tokens = []
            for _ in range(6):
                step()
                tokens.append(slot.state.tokens.clone())
            runs.append((torch.stack(tokens), slot.state.finished.clone(), slot.state.cache.k.clone()))
        results[capture] = runs
    for (tokens, finished, k), (tokens_g, finished_g, k_g) in zip(results[False], results[True], strict=True):
        assert torch.equal(tokens_g, tokens) and torch.equal(finished_g, finished)
        torch.testing.assert_close(k_g[:, :, :13], k[:, :, :13])


@pytest.mark.gpu
@torch.no_grad()
def test_captured_decode_step_logits_equal_the_eager_forward():
    """model.decode_step captured alone, replayed on new tokens and positions: its logits are the
    forward(cache=...) logits (bf16: the attention kernels differ)."""
    model = _cuda_model()
    cfg = model.config
    batch, width = 2, 5
    ids = torch.randint(
        0, 97, (batch, width), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    eager_cache = KVCache(cfg, batch, width + 4, "cuda", torch.bfloat16)
    static_cache = KVCache(cfg, batch, 256, "cuda", torch.bfloat16)
    model(ids, cache=eager_cache)
    static_cache.k[:, :, :width] = eager_cache.k[:, :, :width]
    static_cache.v[:, :, :width] = eager_cache.v[:, :, :width]
    tokens = torch.zeros(batch, dtype=torch.long, device="cuda")
    # Warm-up (outside the capture) at the first decode column, which the first replay rewrites.
    positions, columns = torch.full_like(tokens, width), torch.full_like(tokens, width)
    first = torch.zeros_like(tokens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model.decode_step(tokens, static_cache, positions, columns, first)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model.decode_step(tokens, static_cache, positions, columns, first)
    for step, new in enumerate(([3, 7], [11, 2], [40, 41])):
        tokens.copy_(torch.tensor(new))
        positions.fill_(width + step)
        columns.fill_(width + step)
        graph.replay()
        want = model(tokens[:, None], cache=eager_cache).logits[:, -1].float()
        # bf16 logits through two attention kernels (the step's by column bounds, SDPA here): a
        # logit may differ by a bf16 step of its magnitude; allowed two at the largest logit's.
        atol = 2 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()
        torch.testing.assert_close(logits.float(), want, rtol=0, atol=atol)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "seeded", "seeded_top_p_top_k"])
def test_graph_generation_equals_eager_generation(params):
    # Greedy in bf16 (peaked logits: the two attention kernels' roundings cannot flip an argmax);
    # sampling in fp32, where the race between near-equal p / q is not decided by bf16 rounding.
    model = tiny_model("cuda", torch.bfloat16 if params.greedy else torch.float32)
    decoder = StaticDecoder(model, capture=True)
    free = generate_ids(model, PROMPTS, params)
    eos = (free.tokens[0][2],)
    for prompts in (PROMPTS, PROMPTS[1:2], PROMPTS):
        eager = generate_ids(model, prompts, params, eos)
        graph = generate_ids(model, prompts, params, eos, decoder=decoder)
        assert graph.tokens == eager.tokens and graph.finish_reasons == eager.finish_reasons
    # Captured once per slot and sampling setting, then replayed: the batch of 3 reused its graph.
    assert {key: len(slot.steps) for key, slot in decoder.slots.items()} == {(3, 256): 1, (1, 256): 1}


@pytest.mark.gpu
@torch.no_grad()
def test_static_step_never_syncs_with_the_host():
    """The uncaptured static step under torch's sync debug mode: any host sync would raise."""
    model = _cuda_model()
    decoder = StaticDecoder(model, capture=False)
    slot = decoder.slot(3, 64, 1)
    lengths = torch.tensor([7, 2, 4], device="cuda")
    slot.state.load(torch.tensor([1, 2, 3], device="cuda"), lengths, 7, torch.tensor([5], device="cuda"))
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.8, top_k=20, seed=1)
    for params in (greedy(8), sampled):  # one-time setup (an extension load, cuBLAS) first
        decode_step(model.decode_step, slot.state, params, slot.generator_for(params))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for params in (greedy(8), sampled):
            for _ in range(3):
                decode_step(model.decode_step, slot.state, params, slot.generator_for(params))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_sample_next_on_cuda_draws_what_multinomial_draws():
    logits = torch.randn(6, 300, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
    params = SamplingParams(temperature=1.0)
    for seed in range(5):
        ours, theirs = (torch.Generator("cuda").manual_seed(seed) for _ in range(2))
        want = torch.multinomial(logits.softmax(-1), 1, generator=theirs).squeeze(-1)
        assert torch.equal(sample_next(logits, params, ours), want)


@pytest.mark.gpu
def test_compiled_graph_generation_equals_uncompiled():
    """Inductor's step captured in graphs (fp32: its fused norms round otherwise in bf16)."""
    model = tiny_model("cuda", torch.float32)
    params = greedy(12)
    plain = generate_ids(model, PROMPTS, params, decoder=StaticDecoder(model, capture=True))
    compiled = StaticDecoder(model, capture=True, compile=True)
    assert generate_ids(model, PROMPTS, params, decoder=compiled).tokens == plain.tokens


@pytest.mark.gpu
def test_graph_mode_is_the_cuda_default_for_a_dense_decode():
    model = _cuda_model()
    assert resolve_decode_mode(model, "auto") == ("graph", None)


@needs_hopper
@pytest.mark.gpu
def test_kernels_decode_ffn_in_graphs_equals_eager():
    """The kernels' decode FFN, where the ops front can capture it: greedy tokens with graphs equal
    the eager decode's with the same FFN; a batch above its row limit runs the step uncaptured."""
    model = _cuda_model()
    sparse = model.with_ffn_plan(FFNPlan.resolve("cuda", model.config, "cuda", torch.bfloat16))
    if why_not_graph(sparse) is not None:
        pytest.skip(why_not_graph(sparse))
    decoder = StaticDecoder(sparse, capture=True)
    params = greedy(24)
    rows = DECODE_MAX_ROWS
    captured = {}
    for prompts in (PROMPTS, [PROMPTS[i % 3] for i in range(rows + 1)]):
        eager = generate_ids(sparse, prompts, params)
        assert generate_ids(sparse, prompts, params, decoder=decoder).tokens == eager.tokens
        # After each batch: the larger one's cache memory replaces the first's (its slot dropped).
        captured |= {key[0]: slot.graph_memory is not None for key, slot in decoder.slots.items()}
    assert captured == {3: True, rows + 1: False}


@needs_hopper
@pytest.mark.gpu
def test_compiled_step_with_the_kernels_ffn_above_one_row():
    """Inductor's step with the kernels' in-place decode FFN at 8 rows (a [B, 1, D] residual stream
    that the op mutates, where Inductor's scheduler once failed) compiles, is captured, and its
    first step gives every row the token the uncompiled graph gives (peaked logits: bf16 rounding
    of the fused norms does not flip them)."""
    model = _cuda_model()
    sparse = model.with_ffn_plan(FFNPlan.resolve("cuda", model.config, "cuda", torch.bfloat16))
    if why_not_graph(sparse, 8) is not None:
        pytest.skip(why_not_graph(sparse, 8))
    prompts = [PROMPTS[i % 3] for i in range(8)]
    plain = generate_ids(sparse, prompts, greedy(2), decoder=StaticDecoder(sparse, capture=True))
    compiled = generate_ids(
        sparse, prompts, greedy(2), decoder=StaticDecoder(sparse, capture=True, compile=True)
    )
    assert [row[1] for row in compiled.tokens] == [row[1] for row in plain.tokens]


@pytest.mark.gpu
def test_captures_after_every_graph_of_the_decoder_was_dropped():
    """Issue 51: the decoder's graphs are all dropped (its cache memory grows for a larger batch;
    a slot is made anew for more EOS ids) and it captures again, seeded and not: the pool it
    captures into is still live (`CaptureMemory` holds it), the tokens are the eager decode's. (The
    old failure needed the pool to keep a block from a capture: in a fresh process, the first
    capture's cuBLAS workspace; the fresh-process fuzz, tests/inference/test_generation_fuzz.py,
    runs that order.)"""
    model = tiny_model("cuda", torch.float32)
    decoder = StaticDecoder(model, capture=True)
    seeded = SamplingParams(max_new_tokens=12, temperature=0.8, seed=0)
    unseeded = SamplingParams(max_new_tokens=12, temperature=0.8)
    for prompts, eos in (
        (PROMPTS[1:2], ()),
        ([PROMPTS[1]] * 8, ()),  # more memory: every slot (and graph) dropped
        ([PROMPTS[1]] * 8, (1, 2, 3, 4, 5)),  # more EOS ids than the slot holds: made anew
        ([PROMPTS[0]] * 16, ()),
    ):
        for params in (greedy(12), seeded):
            want = generate_ids(model, prompts, params, eos)
            assert generate_ids(model, prompts, params, eos, decoder=decoder).tokens == want.tokens
        out = generate_ids(model, prompts, unseeded, eos, decoder=decoder)  # the default generator
        assert all(1 <= len(row) <= 12 for row in out.tokens)
    assert list(decoder.slots) == [(16, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("capture", [True, False], ids=["graph", "static"])
@torch.no_grad()
def test_seeded_calls_repeat_the_step_logits_bit_for_bit(capture):
    """Issue 51: two identical seeded calls on one slot give the same logits at every step, bit for
    bit (a sampled token flipped only ~190 steps in on the 1b model: compare logits, not tokens).
    The 1b's attention shapes and the fuzz case's batch: 11 rows of one 581-token prompt, 261 new
    tokens, a 1024-column cache; the second call's cache holds the first's columns past the prompt."""
    cfg = ModelConfig(
        vocab_size=512, hidden_size=2048, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=16, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    batch, width, params = 11, 581, SamplingParams(max_new_tokens=261, temperature=1.3, top_k=40, seed=1)
    seen = torch.empty(batch, cfg.vocab_size, device="cuda", dtype=torch.bfloat16)

    def forward(*args):
        logits = model.decode_step(*args)
        seen.copy_(logits)  # inside the graph: each replay's logits
        return logits

    decoder = StaticDecoder(model, capture=capture)
    slot = decoder.slot(batch, width + params.max_new_tokens, 0)
    slot.forward = forward  # before the step is made (captured)
    prompt = torch.randint(0, cfg.vocab_size, (1, width), device="cuda").expand(batch, width)
    lengths = torch.full((batch,), width, device="cuda")
    calls = []
    for _ in range(2):
        step = slot.step_for(params)
        generator = slot.generator_for(params)
        last = model(prompt, cache=slot.state.prefill_cache(), last_logits_only=True).logits[:, -1]
        slot.state.load(sample_next(last, params, generator), lengths, width, lengths[:0])
        logits = []
        for _ in range(params.max_new_tokens - 1):
            step()
            logits.append(seen.clone())
        calls.append(torch.stack(logits))
    differs = (calls[0] != calls[1]).flatten(1).any(-1).nonzero().flatten().tolist()
    assert not differs, f"the calls' logits part at step {differs[0] + 1} (column {width + differs[0]})"
