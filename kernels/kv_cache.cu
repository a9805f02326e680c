// RoPE(k) and v written into the KV cache in one pass: a thread takes 8 columns of a head's first
// half and their rotation partners in the second half (16-byte loads and stores), so a prefill's
// k is read once and never written anywhere but the cache.
#include <algorithm>

#include "kv_cache.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    kv_cache_write_rope_kernel(const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                               int64_t token_stride, const __nv_bfloat16* __restrict__ cos, const __nv_bfloat16* __restrict__ sin,
                               int64_t cos_batch_stride, int64_t batch, int64_t tokens, int heads, int head_dim,
                               const int64_t* __restrict__ columns, int64_t max_len,
                               __nv_bfloat16* __restrict__ k_out, __nv_bfloat16* __restrict__ v_out,
                               int64_t out_batch_stride) {
  const int half = head_dim / 2;
  const int groups = half / 8;  // 8-column groups of a head's first half
  const int64_t total = batch * tokens * heads * groups;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int group = static_cast<int>(i % groups);
    const int64_t head_row = i / groups;  // (b * tokens + t) * heads + h
    const int64_t token_row = head_row / heads;
    const int64_t t = token_row % tokens;
    const int64_t b = token_row / tokens;
    const int64_t in = token_row * token_stride + (head_row - token_row * heads) * head_dim + group * 8;
    int64_t out = b * out_batch_stride + (head_row - b * tokens * heads) * head_dim + group * 8;
    if (columns != nullptr) {  // row b's tokens start at its own column (a static decode step)
      const int64_t column = columns[b];
      if (column < 0 || column + tokens > max_len) continue;  // the caller's contract; never written
      out += column * heads * head_dim;
    }
    const int64_t angle = b * cos_batch_stride + t * head_dim + group * 8;

    float x1[kChunk], x2[kChunk], c1[kChunk], c2[kChunk], s1[kChunk], s2[kChunk];
    bf16x8_to_float(*reinterpret_cast<const uint4*>(k + in), x1);
    bf16x8_to_float(*reinterpret_cast<const uint4*>(k + in + half), x2);
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(cos + angle)), c1);
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(cos + angle + half)), c2);
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(sin + angle)), s1);
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(sin + angle + half)), s2);
    float first[kChunk], second[kChunk];
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      first[e] = x1[e] * c1[e] - x2[e] * s1[e];
      second[e] = x2[e] * c2[e] + x1[e] * s2[e];
    }
    *reinterpret_cast<uint4*>(k_out + out) = float_to_bf16x8(first);
    *reinterpret_cast<uint4*>(k_out + out + half) = float_to_bf16x8(second);
    *reinterpret_cast<uint4*>(v_out + out) = *reinterpret_cast<const uint4*>(v + in);
    *reinterpret_cast<uint4*>(v_out + out + half) = *reinterpret_cast<const uint4*>(v + in + half);
  }
}

}  // namespace

cudaError_t launch_kv_cache_write_rope(const __nv_bfloat16* k, const __nv_bfloat16* v, int64_t token_stride,
                                       const __nv_bfloat16* cos, const __nv_bfloat16* sin, int64_t cos_batch_stride,
                                       int64_t batch, int64_t tokens, int heads, int head_dim, const int64_t* columns,
                                       int64_t max_len, __nv_bfloat16* k_out, __nv_bfloat16* v_out,
                                       int64_t out_batch_stride, cudaStream_t stream) {
  if (head_dim % 16 != 0) return cudaErrorInvalidValue;
  const int64_t total = batch * tokens * heads * (head_dim / 16);
  if (total == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 20);
  kv_cache_write_rope_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      k, v, token_stride, cos, sin, cos_batch_stride, batch, tokens, heads, head_dim, columns, max_len, k_out, v_out,
      out_batch_stride);
  return cudaGetLastError();
}

}  // namespace sparse_llm
