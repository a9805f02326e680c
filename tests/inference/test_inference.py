"""Inference (CPU): generation through our KV-cache decoder matches transformers and full recompute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_run_config
from transformers import AutoModelForCausalLM

from benchmarks.inference import main as inference_benchmark
from sparse_llm.config import to_yaml
from sparse_llm.generate import greedy_note
from sparse_llm.generate import main as generate_main
from sparse_llm.inference import (
    Generator,
    SamplingParams,
    choose_ffn_plan,
    compile_prefill,
    filter_logits,
    generate_ids,
    load_model,
    measure_ffn_impls,
)
from sparse_llm.inference.decode import why_not_graph
from sparse_llm.model import FFNPlan, build_model
from sparse_llm.model.hf_export import export_hf
from sparse_llm.model.kv_cache import KVCache
from sparse_llm.model.rope import rope_tables
from sparse_llm.training.trainer import Trainer

PROMPTS = ["def main():\n    return", "import os\n", "class Foo(object):\n    def __init__(self"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A 2-step training run with its checkpoint, config.yaml and HF export."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = tiny_run_config(
        run_dir,
        max_documents=100,
        global_batch_size=2,
        max_steps=2,
        lr=1e-2,
        warmup_steps=1,
        eval_batches=1,
        export=True,
    )
    trainer = Trainer(cfg, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))  # as sparse_llm.train writes it
    trainer.fit()
    return run_dir


@pytest.fixture(scope="module")
def loaded(run_dir):
    return load_model(run_dir / "export", device="cpu")


def encode(loaded, texts):
    return [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def test_greedy_matches_transformers_generate(run_dir, loaded):
    hf = AutoModelForCausalLM.from_pretrained(run_dir / "export").eval()
    for ids in encode(loaded, PROMPTS):
        ours = generate_ids(loaded.model, [ids], greedy(12), loaded.eos_token_ids).tokens[0]
        out = hf.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=12, pad_token_id=loaded.eos_token_ids[0]
        )
        theirs = out[0, len(ids) :].tolist()
        if loaded.eos_token_ids[0] in theirs:
            theirs = theirs[: theirs.index(loaded.eos_token_ids[0]) + 1]
        assert ours == theirs


def test_kv_cache_decode_logits_equal_full_recompute(loaded):
    model = loaded.model
    ids = torch.tensor(encode(loaded, PROMPTS[:1]))
    full = model(ids).logits
    cache = KVCache(model.config, 1, ids.shape[1], "cpu", torch.float32)
    split = 4
    chunks = [model(ids[:, :split], cache=cache).logits]
    chunks.append(model(ids[:, split : split + 3], cache=cache).logits)  # a chunk after cached columns
    for t in range(split + 3, ids.shape[1]):
        chunks.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-5, atol=1e-5)


def test_left_padded_rows_decode_as_unpadded(loaded):
    model = loaded.model
    ids = encode(loaded, PROMPTS[:1])[0]
    pad = 5
    cache = KVCache(model.config, 2, len(ids) + pad + 1, "cpu", torch.float32)
    batch = torch.tensor([[0] * pad + ids, ids + ids[:pad]])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(batch, cache=cache, position_ids=positions, attention_mask=mask).logits
    full = model(torch.tensor([[*ids, 7]])).logits
    torch.testing.assert_close(logits[0, pad:], full[0, :-1], rtol=1e-5, atol=1e-5)
    step = model(
        torch.tensor([[7], [7]]),
        cache=cache,
        position_ids=torch.tensor([[len(ids)], [len(ids) + pad]]),
        attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1),
    ).logits
    torch.testing.assert_close(step[0, 0], full[0, -1], rtol=1e-5, atol=1e-5)


def test_batched_generation_with_different_lengths_equals_one_by_one(loaded):
    prompts = encode(loaded, PROMPTS)
    assert len({len(p) for p in prompts}) == len(prompts)
    batched = generate_ids(loaded.model, prompts, greedy(10), loaded.eos_token_ids)
    for i, ids in enumerate(prompts):
        alone = generate_ids(loaded.model, [ids], greedy(10), loaded.eos_token_ids)
        assert batched.tokens[i] == alone.tokens[0]
        assert batched.finish_reasons[i] == alone.finish_reasons[0]


def test_compiled_prefill_gives_the_same_tokens(loaded):
    # backend="eager" checks that dynamo traces the cached forward (KV cache writes, padding
    # mask, the cache length update) without a C++ compiler; inductor runs on the GPU benchmark.
    prompts = encode(loaded, PROMPTS)
    eager = generate_ids(loaded.model, prompts, greedy(10), loaded.eos_token_ids)
    forward = compile_prefill(loaded.model, backend="eager")
    compiled = generate_ids(loaded.model, prompts, greedy(10), loaded.eos_token_ids, prefill_forward=forward)
    assert compiled.tokens == eager.tokens and compiled.finish_reasons == eager.finish_reasons


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_prefill_fills_the_kv_cache_like_eager(loaded, backend):
    """Under compile the cache write is a custom op with a declared mutation (see KVCache.update):
    the cache it leaves equals eager's, and Inductor writes it in place (no whole-cache copy); so
    is o_proj's add into the residual stream (ops.linear_add_)."""
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
        from torch._inductor.utils import run_and_get_code
    model, cfg = loaded.model, loaded.model.config
    ids = torch.tensor([encode(loaded, PROMPTS[:1])[0][:8]] * 2)
    caches = [KVCache(cfg, 2, 64, "cpu", torch.float32) for _ in range(2)]
    with torch.no_grad():
        eager = model(ids, cache=caches[0], last_logits_only=True).logits
        compiled = compile_prefill(model, backend=backend)
        if backend == "inductor":
            out, code = run_and_get_code(compiled, ids, cache=caches[1], last_logits_only=True)
            assert "kv_cache_write.default(" in "\n".join(code)
            assert "linear_add_.default(" in "\n".join(code)  # o_proj adds into the stream in place
            assert "empty_strided_cpu((2, 2, 64, 2, 16)" not in "\n".join(code)  # no cache-sized buffer
        else:
            out = compiled(ids, cache=caches[1], last_logits_only=True)
    torch.testing.assert_close(out.logits, eager, rtol=1e-5, atol=1e-5)
    assert caches[1].length == caches[0].length == ids.shape[1]
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-5, atol=1e-5)


def test_loaded_rope_tables_are_the_float32_tables_rounded_once(run_dir):
    """The tables are not in the checkpoint: a bf16 load recomputes them in float32 and rounds them
    once, as the rotary casts them (never angles from rounded frequencies)."""
    model = load_model(run_dir, "cpu", "bfloat16").model
    cfg = model.config
    assert model.lm_head.weight.dtype == torch.bfloat16
    cos, sin = rope_tables(
        cfg.hidden_size // cfg.num_attention_heads, cfg.rope_theta, cfg.max_position_embeddings
    )
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.cos_table, cos.bfloat16()) and torch.equal(rotary.sin_table, sin.bfloat16())


def test_eos_stops_each_sequence(loaded):
    prompts = encode(loaded, PROMPTS[:2])
    free = generate_ids(loaded.model, prompts, greedy(10), eos_token_ids=())
    assert free.finish_reasons == ["length", "length"]
    assert all(len(t) == 10 for t in free.tokens)
    # Declare row 0's third new token the EOS: row 0 stops there, row 1 goes on as before.
    eos = free.tokens[0][2]
    stop = free.tokens[0].index(eos)
    out = generate_ids(loaded.model, prompts, greedy(10), eos_token_ids=(eos,))
    assert out.tokens[0] == free.tokens[0][: stop + 1] and out.finish_reasons[0] == "eos"
    row1 = free.tokens[1]
    expected = row1[: row1.index(eos) + 1] if eos in row1 else row1
    assert out.tokens[1] == expected
    # stop_at_eos=False ignores it.
    no_stop = generate_ids(
        loaded.model, prompts, SamplingParams(max_new_tokens=10, stop_at_eos=False), eos_token_ids=(eos,)
    )
    assert no_stop.tokens == free.tokens


def test_checkpoint_loads_like_export(run_dir, loaded):
    step_dir = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    from_ckpt = load_model(step_dir, device="cpu")
    from_run = load_model(run_dir, device="cpu")
    assert from_ckpt.source == from_run.source == "checkpoint" and from_run.path == step_dir
    assert from_ckpt.eos_token_ids == loaded.eos_token_ids
    assert from_ckpt.model.config.vocab_size == loaded.model.config.vocab_size
    for (name, a), b in zip(
        loaded.model.state_dict().items(), from_ckpt.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    prompts = encode(loaded, PROMPTS)
    assert encode(from_ckpt, PROMPTS) == prompts
    a = generate_ids(loaded.model, prompts, greedy(8), loaded.eos_token_ids)
    b = generate_ids(from_ckpt.model, prompts, greedy(8), from_ckpt.eos_token_ids)
    assert a.tokens == b.tokens


def test_sampling_is_reproducible_and_respects_top_p(loaded):
    prompts = encode(loaded, PROMPTS)
    hot = SamplingParams(max_new_tokens=12, temperature=1.5, seed=1, stop_at_eos=False)
    a = generate_ids(loaded.model, prompts, hot).tokens
    assert generate_ids(loaded.model, prompts, hot).tokens == a
    other = SamplingParams(max_new_tokens=12, temperature=1.5, seed=2, stop_at_eos=False)
    assert generate_ids(loaded.model, prompts, other).tokens != a
    # A nucleus this small holds only the most likely token: sampling is greedy decoding.
    tiny_p = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=3, stop_at_eos=False)
    greedy_tokens = generate_ids(loaded.model, prompts, SamplingParams(12, stop_at_eos=False)).tokens
    assert generate_ids(loaded.model, prompts, tiny_p).tokens == greedy_tokens


def test_top_p_and_top_k_filters():
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw))[0].tolist()
    assert kept(top_p=0.5) == [True, False, False]
    assert kept(top_p=0.8) == [True, True, False]
    assert kept(top_p=0.95) == [True, True, True]
    assert kept(top_k=2) == [True, True, False]
    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.8)
    g = torch.Generator().manual_seed(0)
    from sparse_llm.inference import sample_next

    draws = sample_next(logits.expand(2000, 3), params, g)
    assert set(draws.tolist()) == {0, 1}


def test_generator_text_api_and_ffn_selection(run_dir, caplog):
    gen = Generator.from_pretrained(
        run_dir / "export", device="cpu", prefill_ffn="fastest", decode_ffn="reference"
    )
    # On CPU the kernels cannot run: fastest is dense without timing, and the plan says why.
    assert gen.ffn == {"prefill": "dense", "decode": "reference"} and gen.ffn_measurement is None
    assert "tensors are on cpu" in gen.ffn_plan.prefill.reason
    assert gen.model.ffn_plan.impl("decode") == "reference"
    assert gen.loaded.model.ffn_plan.impl("decode") == "dense"  # the loaded model is not changed
    assert gen.model.lm_head.weight is gen.loaded.model.lm_head.weight  # weights shared, not copied
    out = gen.generate(PROMPTS[:2], max_new_tokens=6)
    assert len(out.texts) == 2 and all(len(t) <= 6 for t in out.tokens)
    dense = Generator(gen.loaded, "dense", "dense").generate(PROMPTS[:2], max_new_tokens=6)
    assert dense.tokens == out.tokens
    compiled = Generator(gen.loaded, "dense", "dense", compile=True)  # Inductor on CPU
    assert compiled.generate(PROMPTS[:2], max_new_tokens=6).tokens == out.tokens
    with caplog.at_level("INFO", logger="sparse_llm.inference.calibrate"):
        measured = measure_ffn_impls(gen.model, 2, 16, candidates=("dense", "reference"), reps=1)
    # Prefill over all 2 x 16 tokens; decode at each batch of DECODE_BATCHES up to the 2 rows.
    assert [(t.phase, t.batch, t.tokens, t.timed) for t in measured.timings] == [
        ("prefill", 2, 32, "eager"),
        ("decode", 1, 1, "eager"),  # no CUDA graphs on a CPU
        ("decode", 2, 2, "eager"),
    ]
    for phase in ("prefill", "decode"):  # the faster on average, relative to dense
        rows = [t for t in measured.timings if t.phase == phase]
        ratio = sum(t.ms["reference"] / t.ms["dense"] for t in rows) / len(rows)
        assert measured.choice[phase] == ("reference" if ratio < 1 else "dense")
    logged = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("fastest: prefill FFN at batch 2 (32 tokens") for m in logged) == 1
    assert sum(m.startswith("fastest: decode FFN at batch") for m in logged) == 2
    assert f"fastest: the decode FFN is {measured.choice['decode']}" in logged
    table = measured.markdown().splitlines()
    assert table[0].startswith("| phase | batch |") and len(table) == 2 + 3


def test_generator_decode_mode_is_fixed_when_built(loaded):
    """On CPU the default decode is eager (CUDA graphs need a GPU), `static` runs the graphs' step
    uncaptured with the same tokens, greedy and seeded, and `graph` fails at build."""
    gen = Generator(loaded, "dense", "dense")
    assert gen.decode == "eager" and "CUDA device" in gen.decode_reason and gen.decoder is None
    static = Generator(loaded, "dense", "dense", decode="static")
    assert static.decode == "static" and static.decoder is not None
    for sampling in (dict(max_new_tokens=20), dict(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=4)):
        assert static.generate(PROMPTS, **sampling).tokens == gen.generate(PROMPTS, **sampling).tokens
    with pytest.raises(ValueError, match="decode='graph' cannot run"):
        Generator(loaded, "dense", "dense", decode="graph")


def test_clear_errors_before_compute(run_dir, loaded, tmp_path):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        load_model(tmp_path / "missing", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither an export"):
        load_model(tmp_path / "empty", device="cpu")
    broken = tmp_path / "broken_export"
    broken.mkdir()
    (broken / "config.json").write_text((run_dir / "export" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        load_model(broken, device="cpu")
    orphan = tmp_path / "orphan" / "checkpoints" / "step_00000002"
    orphan.parent.mkdir(parents=True)
    step_dir = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    orphan.mkdir()
    for name in ("model.safetensors", "trainer_state.json"):
        (orphan / name).write_bytes((step_dir / name).read_bytes())
    # A checkpoint records its run's config: it loads without the run's config.yaml ...
    assert load_model(orphan, device="cpu").model.config == load_model(step_dir, device="cpu").model.config
    # ... where one written before it did needs that file.
    manifest = json.loads((orphan / "trainer_state.json").read_text())
    del manifest["config"]
    (orphan / "trainer_state.json").write_text(json.dumps(manifest))
    with pytest.raises(FileNotFoundError, match=r"config\.yaml"):
        load_model(orphan, device="cpu")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate_ids(loaded.model, [[1] * 2040], greedy(16))
    with pytest.raises(ValueError, match="empty"):
        generate_ids(loaded.model, [[1, 2], []], greedy(4))
    with pytest.raises(ValueError, match="vocabulary"):
        generate_ids(loaded.model, [[loaded.model.config.vocab_size]], greedy(4))
    with pytest.raises(ValueError, match="decode_ffn must be one of"):
        choose_ffn_plan(loaded.model, "dense", "sparse")
    with pytest.raises(ValueError, match="prefill_ffn=cuda cannot run"):
        choose_ffn_plan(loaded.model, "cuda", "dense")
    with pytest.raises(ValueError, match="dtype"):
        load_model(run_dir / "export", device="cpu", dtype="int8")


def test_generate_command(run_dir, capsys):
    # In-process through main(argv): what the command prints and returns, without a fresh
    # interpreter per call (the exit code of a console script is main's return value).
    cmd = [str(run_dir / "export"), "--prompt", "def f():", "--prompt", "x"]
    assert generate_main([*cmd, "--max-new-tokens", "5", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["outputs"]) == 2 and result["ffn"] == {"prefill": "dense", "decode": "dense"}
    assert result["decode"] == "eager" and result["decode_reason"]  # no CUDA graphs on a CPU
    static = [*cmd, "--max-new-tokens", "5", "--device", "cpu", "--json", "--decode", "static"]
    assert generate_main(static) == 0
    static_result = json.loads(capsys.readouterr().out)
    assert static_result["decode"] == "static"  # asked for, so taken (an eager rerun would match too)
    assert static_result["outputs"] == result["outputs"]  # the same greedy tokens
    assert generate_main([*cmd, "--top-p", "2"]) == 2 and "top_p" in capsys.readouterr().err


def test_blank_greedy_output_gets_a_note_on_sampling():
    note = greedy_note(["\n\n\n", "x = 1"], temperature=0.0)
    assert note is not None and "1 of 2 prompts" in note and "--temperature 0.7 --top-k 40" in note
    assert greedy_note(["x = 1"], temperature=0.0) is None
    assert greedy_note(["\n"], temperature=0.7) is None  # sampling was asked for: its output stands


def test_benchmark_script_tiny(tmp_path):
    out = tmp_path / "bench"
    argv = ["--tiny", "--sparsify-steps", "3", "--compile", "--compile-backend", "eager", "--out", str(out)]
    assert inference_benchmark(argv) == 0  # in-process: the script's main, one interpreter fewer
    result = json.loads((out / "inference_benchmark.json").read_text())
    assert {"device", "commit", "date", "sparsity", "results"} <= set(result)
    impls = {r["impl"] for r in result["results"]}
    assert impls == {"dense", "reference"}  # cuda is replaced by its reference on CPU
    for r in result["results"]:
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["prefill_compiled_tokens_per_s"] > 0 and r["prefill_compiled_vs_dense"] > 0
        assert r["compiled_vs_eager_max_logit_diff"] < 1e-4  # fp32 on CPU: the same arithmetic
    sweep = result["decode_sweep"]
    assert sweep["modes"] == ["static", "eager"] and sweep["copy_bandwidth_gbs"] is None  # CPU
    assert {(r["impl"], r["batch"], r["context"], r["mode"]) for r in sweep["rows"]} == {
        (impl, batch, context, mode)
        for impl in ("dense", "reference")
        for batch in (1, 2)
        for context in (16, 48)
        for mode in ("static", "eager")
    }
    for r in sweep["rows"]:
        assert r["tokens_per_s"] > 0 and r["gb_per_s"] > 0 and r["vs_eager"] > 0
        parts = r["bytes_per_step"]
        assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    text = (out / "inference_benchmark.md").read_text()
    assert text.startswith("# Inference benchmark") and "## Decode steps" in text


@pytest.mark.gpu
def test_cuda_ffn_generation_matches_dense_on_bf16(tmp_path):
    from sparse_llm.config import ModelConfig
    from sparse_llm.data import load_tokenizer

    tokenizer = load_tokenizer("embedded")
    cfg = ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        initializer_range=0.2,  # peaked logits: bf16 rounding cannot flip a near tie
    )
    torch.manual_seed(0)
    export_hf(build_model(cfg), tokenizer, tmp_path / "export")
    loaded = load_model(tmp_path / "export", device="cuda", dtype="bfloat16")
    prompts = encode(loaded, PROMPTS)
    sparse_model = loaded.model.with_ffn_plan(
        FFNPlan.resolve("cuda", loaded.model.config, "cuda", torch.bfloat16)
    )
    dense = generate_ids(loaded.model, prompts, greedy(8), ())
    cuda = generate_ids(sparse_model, prompts, greedy(8), ())
    assert cuda.tokens == dense.tokens
    ids = torch.tensor(prompts[:1], device="cuda")
    with torch.no_grad():  # the sparse FFN serves no-grad forwards (the eval phase here)
        sparse_logits = sparse_model(ids).logits.float()
        dense_logits = loaded.model(ids).logits.float()
    torch.testing.assert_close(sparse_logits, dense_logits, rtol=0.05, atol=0.05)
    gen = Generator(loaded, "fastest", "fastest")
    assert gen.ffn_measurement is not None and set(gen.ffn.values()) <= {"dense", "cuda"}
    # The decode mode follows the decode FFN: graphs where it can be captured, else eager and why.
    assert (gen.decode == "graph") == (why_not_graph(gen.model) is None)
    cuda_decode = Generator(loaded, "dense", "cuda")
    assert cuda_decode.decode == ("eager" if cuda_decode.decode_reason else "graph")
    decoded = generate_ids(cuda_decode.model, prompts, greedy(8), (), decoder=cuda_decode.decoder)
    assert decoded.tokens == dense.tokens


def test_kv_write_rejects_bad_shapes_before_writing():
    from sparse_llm.ops.kv_cache_write import write_kv

    cache = torch.zeros(1, 2, 8, 2, 16)
    k = torch.ones(2, 4, 2, 16)
    cos, sin = torch.ones(4, 1, 16), torch.zeros(4, 1, 16)
    with pytest.raises(ValueError, match="exceed the cache"):
        write_kv(cache, cache.clone(), 0, 6, k, k, cos, sin)
    with pytest.raises(ValueError, match="matching the cache"):
        write_kv(cache, cache.clone(), 0, 0, k[:1], k[:1], cos, sin)
    assert not cache.any()


def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def test_a_damaged_model_is_one_line_naming_the_file_and_exit_4(run_dir, tmp_path, capsys):
    """Each way a model's files go bad is a DamagedModel naming the file, before any tensor is
    read; sparse-llm-generate says it in one line with exit code 4."""
    from sparse_llm import generate
    from sparse_llm.inference.loading import DamagedModel

    step_dir = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    cases = {}
    export = _copy(run_dir / "export", tmp_path / "truncated")
    weights = export / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    cases[export] = rf"{weights} has \d+ bytes where its header describes \d+ \(truncated\?\)"
    export = _copy(run_dir / "export", tmp_path / "bad_json")
    (export / "config.json").write_text('{"model_type": "llama" "hidden_size": 32}')
    cases[export] = rf"{export / 'config.json'} is not valid JSON \(Expecting ',' delimiter"
    export = _copy(run_dir / "export", tmp_path / "other_model")
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    cases[export] = (
        rf"{export / 'model.safetensors'} does not hold the model its config.json describes: 9 missing: model.layers.2"
    )
    run_copy = _copy(run_dir, tmp_path / "run")  # a checkpoint whose weights changed after writing
    weights = run_copy / "checkpoints" / step_dir.name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    cases[weights.parent] = rf"{weights.parent}: model.safetensors does not match its recorded SHA-256"
    cases[run_copy] = cases[weights.parent]  # the run directory's latest checkpoint is that one
    for path, message in cases.items():
        with pytest.raises(DamagedModel, match=message):
            load_model(path, device="cpu")
        assert generate.main([str(path), "--prompt", "x", "--device", "cpu"]) == 4
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
