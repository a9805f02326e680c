// The KV-cache write of the inference attention: RoPE applied to k on the way into the cache.
// Plain CUDA C++: no torch headers, so the .cu compiles with `nvcc -c` alone.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace sparse_llm {

// For every batch row b, token t, head h (k, v: [B, T, heads, head_dim] bf16; token rows
// token_stride elements apart, heads contiguous within a row, e.g. views of one q|k|v tensor):
//   k_out[b * out_batch_stride + (t * heads + h) * head_dim + i] = rope(k[b, t, h])[i]
//   v_out[same] = v[b, t, h, i]
// with rope(x) = x * cos + rotate_half(x) * sin (transformers' convention), computed in fp32 and
// rounded once; cos, sin: [T, head_dim] at cos + b * cos_batch_stride (0 when rows share them).
// With `columns` (B int64 on the device, else nullptr) row b's tokens go to columns[b] + t instead,
// k_out and v_out then pointing at column 0: a static decode step's write, each row at its own
// length, with no host read. A row whose columns[b] + T would fall outside [0, max_len) is skipped.
// head_dim % 16 == 0; every pointer and stride 16-byte aligned.
cudaError_t launch_kv_cache_write_rope(const __nv_bfloat16* k, const __nv_bfloat16* v, int64_t token_stride,
                                       const __nv_bfloat16* cos, const __nv_bfloat16* sin, int64_t cos_batch_stride,
                                       int64_t batch, int64_t tokens, int heads, int head_dim, const int64_t* columns,
                                       int64_t max_len, __nv_bfloat16* k_out, __nv_bfloat16* v_out,
                                       int64_t out_batch_stride, cudaStream_t stream);

}  // namespace sparse_llm
