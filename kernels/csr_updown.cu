// Training forward after the pack: the gated up/down projection from the CSR record.
//
// One CTA owns a block of consecutive rows (csr_rows.cuh), whose entries are one contiguous range
// of the record. (1) The rows of x are staged in shared memory. (2) Warps take the block's entries
// round robin:
// u = x[r] . wu[unit] (16-byte gathers of the wu row, warp reduction), stored as bf16. (3) Every
// thread owns 8 output columns and accumulates y[r] += a * u * wd_t[unit] over the row's entries
// (coalesced 16-byte gathers, fp32). No per-row capacity: a fully dense row is just a long loop.
#include "csr_rows.cuh"

namespace sparse_llm {
namespace {

constexpr int kUpLoads = 8;     // 16-byte wu loads in flight per lane
constexpr int kDownUnroll = 4;  // wd_t rows in flight per thread

__global__ void __launch_bounds__(kCsrRowThreads)
    csr_updown_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wu,
                      const __nv_bfloat16* __restrict__ wd_t, const int64_t* __restrict__ row_ptr,
                      const int32_t* __restrict__ cols, const __nv_bfloat16* __restrict__ a_vals,
                      const uint8_t* __restrict__ heavy, int64_t rows, int dim, __nv_bfloat16* u_vals,
                      __nv_bfloat16* __restrict__ y) {
  extern __shared__ uint4 smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);  // [kCsrRowsPerCta][dim]
  __shared__ int64_t ptr[kCsrRowsPerCta + 1];
  __shared__ bool skip[kCsrRowsPerCta];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kCsrRowsPerCta;
  const int n_rows = row_block_size(rows, row0);
  const int vecs = dim / kChunk;
  load_row_block(row_ptr, heavy, x, row0, n_rows, dim, ptr, skip, xs);

  // (2) u at every entry of the block.
  for (int64_t e = ptr[0] + warp; e < ptr[n_rows]; e += kCsrRowWarps) {
    const int r = local_row(ptr, n_rows, e);
    if (skip[r]) continue;
    const float u = warp_dot_row<kUpLoads>(xs + r * dim, wu + static_cast<int64_t>(cols[e]) * dim, dim, lane);
    if (lane == 0) u_vals[e] = __float2bfloat16(u);
  }
  __syncthreads();  // u_vals of the block visible to all its threads (plain loads below, not __ldg)

  // (3) y[r] = sum_e a_e u_e wd_t[unit_e].
  for (int r = 0; r < n_rows; ++r) {
    if (skip[r]) continue;
    const int64_t begin = ptr[r], end = ptr[r + 1];
    for (int v = threadIdx.x; v < vecs; v += kCsrRowThreads) {
      float acc[kChunk] = {};
      int64_t e = begin;
      for (; e + kDownUnroll <= end; e += kDownUnroll) {
        uint4 w[kDownUnroll];
        float h[kDownUnroll];
#pragma unroll
        for (int k = 0; k < kDownUnroll; ++k) {
          w[k] = __ldg(reinterpret_cast<const uint4*>(wd_t + static_cast<int64_t>(cols[e + k]) * dim) + v);
          h[k] = __bfloat162float(a_vals[e + k]) * __bfloat162float(u_vals[e + k]);
        }
#pragma unroll
        for (int k = 0; k < kDownUnroll; ++k) axpy_bf16x8(h[k], w[k], acc);
      }
      for (; e < end; ++e) {
        const float h = __bfloat162float(a_vals[e]) * __bfloat162float(u_vals[e]);
        axpy_bf16x8(h, __ldg(reinterpret_cast<const uint4*>(wd_t + static_cast<int64_t>(cols[e]) * dim) + v), acc);
      }
      reinterpret_cast<uint4*>(y + (row0 + r) * dim)[v] = float_to_bf16x8(acc);
    }
  }
}

}  // namespace

cudaError_t launch_csr_updown(const __nv_bfloat16* x, const __nv_bfloat16* wu, const __nv_bfloat16* wd_t,
                              const int64_t* row_ptr, const int32_t* cols, const __nv_bfloat16* a_vals,
                              const uint8_t* heavy, int64_t rows, int dim, __nv_bfloat16* u_vals,
                              __nv_bfloat16* y, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (dim % kChunk != 0 || dim > kMaxTrainDim) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(kCsrRowsPerCta) * dim * sizeof(__nv_bfloat16);
  cudaError_t err =
      cudaFuncSetAttribute(csr_updown_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t blocks = (rows + kCsrRowsPerCta - 1) / kCsrRowsPerCta;
  csr_updown_kernel<<<static_cast<unsigned>(blocks), kCsrRowThreads, smem, stream>>>(x, wu, wd_t, row_ptr, cols, a_vals,
                                                                              heavy, rows, dim, u_vals, y);
  return cudaGetLastError();
}

}  // namespace sparse_llm
