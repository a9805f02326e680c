// Helpers of the dense path for heavy rows: an ordered list of the heavy rows (no host sync to
// build it) and the fused gate h = relu(g[row]) * u on the gathered rows.
#include "twell.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;

__global__ void compact_rows_kernel(const uint8_t* __restrict__ heavy, const int32_t* __restrict__ inclusive_pos,
                                    int64_t rows, int64_t* __restrict__ list) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row < rows && heavy[row]) list[inclusive_pos[row] - 1] = row;
}

__global__ void gate_mul_rows_kernel(const __nv_bfloat16* __restrict__ g, const int64_t* __restrict__ list,
                                     int64_t n, int hidden, __nv_bfloat16* __restrict__ u) {
  const int vecs = hidden / 8;
  const int64_t total = n * vecs;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / vecs;
    const int v = static_cast<int>(i % vecs);
    const uint4 graw = __ldg(reinterpret_cast<const uint4*>(g + list[r] * hidden) + v);
    uint4* up = reinterpret_cast<uint4*>(u + r * hidden) + v;
    uint4 uraw = *up;
    const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&graw);
    __nv_bfloat162* uq = reinterpret_cast<__nv_bfloat162*>(&uraw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 gf = __bfloat1622float2(gp[k]);
      const float2 uf = __bfloat1622float2(uq[k]);
      // Round relu(g) and u to bf16 first (they are bf16 already), then the product: as the dense path.
      uq[k] = __floats2bfloat162_rn(fmaxf(gf.x, 0.0f) * uf.x, fmaxf(gf.y, 0.0f) * uf.y);
    }
    *up = uraw;
  }
}

}  // namespace

cudaError_t launch_compact_rows(const uint8_t* heavy, const int32_t* inclusive_pos, int64_t rows, int64_t* list,
                                cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  compact_rows_kernel<<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      heavy, inclusive_pos, rows, list);
  return cudaGetLastError();
}

cudaError_t launch_gate_mul_rows(const __nv_bfloat16* g, const int64_t* list, int64_t n, int hidden,
                                 __nv_bfloat16* u, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (hidden % 8 != 0) return cudaErrorInvalidValue;
  const int64_t work = n * (hidden / 8);
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  gate_mul_rows_kernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), kThreads, 0, stream>>>(
      g, list, n, hidden, u);
  return cudaGetLastError();
}

}  // namespace sparse_llm
