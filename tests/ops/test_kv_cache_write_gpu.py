"""GPU tests of the fused KV-cache write (kernels/kv_cache.cu): RoPE(k) and v land in the right
columns, equal to the PyTorch write within one bf16 rounding, and nothing else is touched."""

import pytest
import torch
from ffn_patterns import needs_hopper

from sparse_llm.model.rope import RotaryEmbedding
from sparse_llm.ops.kv_cache_write import write_kv, write_kv_columns
from sparse_llm.ops.rotary import apply_rotary

pytestmark = pytest.mark.gpu


@needs_hopper
@pytest.mark.parametrize("per_row_positions", [False, True])
@pytest.mark.parametrize(
    ("batch", "tokens", "heads", "head_dim", "start"), [(3, 5, 2, 16, 0), (2, 37, 4, 64, 11)]
)
def test_fused_write_matches_pytorch(per_row_positions, batch, tokens, heads, head_dim, start):
    layers, layer, max_len = 3, 1, 64
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    k, v = (
        torch.randn(batch, tokens, heads, head_dim, generator=gen, device="cuda").bfloat16() for _ in range(2)
    )
    rope = RotaryEmbedding(head_dim, 1e4, max_len).cuda()
    if per_row_positions:
        positions = torch.randint(0, max_len, (batch, tokens), generator=gen, device="cuda")
        cos, sin = rope(tokens, torch.bfloat16, positions)
    else:
        cos, sin = rope(tokens, torch.bfloat16)
    shape = (layers, batch, max_len, heads, head_dim)
    k_cache = torch.full(shape, 7.0, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.full(shape, 7.0, device="cuda", dtype=torch.bfloat16)
    write_kv(k_cache, v_cache, layer, start, k, v, cos, sin)

    want_k = apply_rotary(k.float(), cos.float(), sin.float())  # fp32, then one rounding
    got_k = k_cache[layer, :, start : start + tokens]
    torch.testing.assert_close(got_k.float(), want_k.bfloat16().float(), rtol=8e-3, atol=1e-2)
    assert torch.equal(v_cache[layer, :, start : start + tokens], v)
    untouched = torch.ones(shape, dtype=torch.bool, device="cuda")
    untouched[layer, :, start : start + tokens] = False
    assert (k_cache[untouched] == 7.0).all() and (v_cache[untouched] == 7.0).all()


@needs_hopper
@pytest.mark.parametrize(("batch", "heads", "head_dim"), [(3, 2, 16), (8, 32, 64)])
def test_column_write_equals_a_write_at_each_rows_start(batch, heads, head_dim):
    """write_kv_columns (the fused kernel, each row at its own device-side column) leaves the cache
    bit for bit as write_kv of each row at that column does; in a launch whose odd rows point past
    the cache (a broken caller contract), the kernel writes the even rows and nothing outside."""
    layers, layer, max_len = 2, 1, 32
    gen = torch.Generator(device="cuda").manual_seed(batch)
    k, v = (torch.randn(batch, 1, heads, head_dim, generator=gen, device="cuda").bfloat16() for _ in range(2))
    rope = RotaryEmbedding(head_dim, 1e4, max_len).cuda()
    columns = torch.randperm(max_len, generator=gen, device="cuda")[:batch]
    cos, sin = rope(1, torch.bfloat16, columns.view(batch, 1))
    shape = (layers, batch, max_len, heads, head_dim)
    got_k, got_v, want_k, want_v = (
        torch.full(shape, 7.0, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    write_kv_columns(got_k, got_v, layer, columns, k, v, cos, sin)
    for row, column in enumerate(columns.tolist()):
        one = slice(row, row + 1)
        row_k, row_v = want_k[:, one].clone(), want_v[:, one].clone()
        write_kv(row_k, row_v, layer, column, k[one], v[one], cos[one], sin[one])
        want_k[:, one], want_v[:, one] = row_k, row_v
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)

    odd_out = columns.clone()
    odd_out[1::2] = max_len
    mixed_k, mixed_v = (torch.full(shape, 7.0, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    write_kv_columns(mixed_k, mixed_v, layer, odd_out, k, v, cos, sin)
    assert torch.equal(mixed_k[:, 0::2], want_k[:, 0::2]) and torch.equal(mixed_v[:, 0::2], want_v[:, 0::2])
    assert (mixed_k[:, 1::2] == 7.0).all() and (mixed_v[:, 1::2] == 7.0).all()
