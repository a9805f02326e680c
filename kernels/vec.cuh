// 16-byte vector helpers shared by the kernels: 8 bf16 per uint4, fp32 arithmetic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace sparse_llm {

constexpr int kChunk = 8;  // bf16 per 16-byte access
constexpr unsigned kFullMask = 0xffffffffu;

// v as a bf16 tensor holds it: the L1 term sums |h| with h rounded so, as the dense path's bf16 h is.
__device__ __forceinline__ float bf16_rounded(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&out)[kChunk]) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ uint4 float_to_bf16x8(const float (&in)[kChunk]) {
  uint4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return out;
}

// Stores 8 fp32 values as element v of a row of 8-element vectors: bf16 (one 16-byte store) or fp32
// (two). The weight-gradient kernels write the gradient's own dtype with it.
__device__ __forceinline__ void store8(__nv_bfloat16* row, int v, const float (&in)[kChunk]) {
  reinterpret_cast<uint4*>(row)[v] = float_to_bf16x8(in);
}
__device__ __forceinline__ void store8(float* row, int v, const float (&in)[kChunk]) {
  float4* out = reinterpret_cast<float4*>(row) + 2 * v;
  out[0] = make_float4(in[0], in[1], in[2], in[3]);
  out[1] = make_float4(in[4], in[5], in[6], in[7]);
}

// Adds 8 fp32 values to element v of such a row, rounding once to the row's dtype.
__device__ __forceinline__ void add8(__nv_bfloat16* row, int v, const float (&in)[kChunk]) {
  float sum[kChunk];
  bf16x8_to_float(reinterpret_cast<const uint4*>(row)[v], sum);
#pragma unroll
  for (int c = 0; c < kChunk; ++c) sum[c] += in[c];
  store8(row, v, sum);
}
__device__ __forceinline__ void add8(float* row, int v, const float (&in)[kChunk]) {
  float4* out = reinterpret_cast<float4*>(row) + 2 * v;
  const float4 lo = out[0], hi = out[1];
  out[0] = make_float4(lo.x + in[0], lo.y + in[1], lo.z + in[2], lo.w + in[3]);
  out[1] = make_float4(hi.x + in[4], hi.y + in[5], hi.z + in[6], hi.w + in[7]);
}

__device__ __forceinline__ float dot_bf16x8(const uint4& a, const uint4& b) {
  float fa[kChunk], fb[kChunk];
  bf16x8_to_float(a, fa);
  bf16x8_to_float(b, fb);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) s = fmaf(fa[i], fb[i], s);
  return s;
}

// acc += c * w, element-wise over 8 bf16.
__device__ __forceinline__ void axpy_bf16x8(float c, const uint4& w, float (&acc)[kChunk]) {
  float f[kChunk];
  bf16x8_to_float(w, f);
#pragma unroll
  for (int i = 0; i < kChunk; ++i) acc[i] = fmaf(c, f[i], acc[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int n = __shfl_up_sync(kFullMask, v, off);
    if (lane >= off) v += n;
  }
  return v;
}

// The sum of every thread's v over a CTA of kThreads threads (a power of two), added in a fixed
// order (a shared-memory tree), so the same on every run; valid in thread 0. `sums`: kThreads
// floats of shared memory.
template <int kThreads>
__device__ __forceinline__ float cta_ordered_sum(float v, float* sums) {
  sums[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  return sums[0];
}

// Dot product of a shared-memory row (xs) with a global bf16 row (w), both of dim elements,
// computed by one warp; every lane returns the sum. kLoads 16-byte loads of w in flight per lane.
template <int kLoads>
__device__ __forceinline__ float warp_dot_row(const __nv_bfloat16* xs, const __nv_bfloat16* __restrict__ w, int dim,
                                              int lane) {
  const uint4* wr = reinterpret_cast<const uint4*>(w);
  const uint4* xr = reinterpret_cast<const uint4*>(xs);
  const int vecs = dim / kChunk;
  float acc = 0.0f;
  for (int v0 = 0; v0 < vecs; v0 += 32 * kLoads) {
    uint4 wv[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int v = v0 + k * 32 + lane;
      if (v < vecs) wv[k] = __ldg(wr + v);
    }
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int v = v0 + k * 32 + lane;
      if (v < vecs) acc += dot_bf16x8(wv[k], xr[v]);
    }
  }
  return warp_sum(acc);
}

}  // namespace sparse_llm
