// Training forward after the pack: the gated up/down projection from the CSR record.
//
// One CTA owns a block of consecutive rows (csr_rows.cuh), whose entries are one contiguous range
// of the record. (1) The rows of x are staged in shared memory. (2) Warps take the block's entries
// round robin:
// u = x[r] . wu[unit] (16-byte gathers of the wu row, warp reduction), stored as bf16. (3) Every
// thread owns 8 output columns and accumulates y[r] += a * u * wd_t[unit] over the row's entries
// (coalesced 16-byte gathers, fp32). No per-row capacity: a fully dense row is just a long loop.
// The CTA also sums |h| = |a * u| over its entries (the L1 term), in a fixed order; a one-CTA
// kernel then adds the CTAs' sums in order: deterministic, with no pass over the record.
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
                      __nv_bfloat16* __restrict__ y, float* __restrict__ l1_partial) {
  extern __shared__ uint4 smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);  // [kCsrRowsPerCta][dim]
  __shared__ int64_t ptr[kCsrRowsPerCta + 1];
  __shared__ bool skip[kCsrRowsPerCta];
  __shared__ float warp_l1[kCsrRowWarps];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kCsrRowsPerCta;
  const int n_rows = row_block_size(rows, row0);
  const int vecs = dim / kChunk;
  load_row_block(row_ptr, heavy, x, row0, n_rows, dim, ptr, skip, xs);

  // (2) u at every entry of the block, and |h| summed by each warp's lane 0.
  float l1 = 0.0f;
  for (int64_t e = ptr[0] + warp; e < ptr[n_rows]; e += kCsrRowWarps) {
    const int r = local_row(ptr, n_rows, e);
    if (skip[r]) continue;
    const float u = warp_dot_row<kUpLoads>(xs + r * dim, wu + static_cast<int64_t>(cols[e]) * dim, dim, lane);
    if (lane == 0) {
      const __nv_bfloat16 u_bf16 = __float2bfloat16(u);
      u_vals[e] = u_bf16;
      l1 += fabsf(bf16_rounded(__bfloat162float(a_vals[e]) * __bfloat162float(u_bf16)));  // the h y is made of
    }
  }
  if (lane == 0) warp_l1[warp] = l1;
  __syncthreads();  // u_vals of the block visible to all its threads (plain loads below, not __ldg)
  if (threadIdx.x == 0) {
    float block_l1 = 0.0f;
    for (int w = 0; w < kCsrRowWarps; ++w) block_l1 += warp_l1[w];
    l1_partial[blockIdx.x] = block_l1;
  }

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

// *l1 = scale * the sum of the n partial sums, added in a fixed order (one CTA).
constexpr int kL1FinishThreads = 1024;

__global__ void __launch_bounds__(kL1FinishThreads)
    csr_l1_finish_kernel(const float* __restrict__ partial, int64_t n, float scale, float* __restrict__ l1) {
  __shared__ float sums[kL1FinishThreads];
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kL1FinishThreads) sum += partial[i];
  sum = cta_ordered_sum<kL1FinishThreads>(sum, sums);
  if (threadIdx.x == 0) *l1 = sum * scale;
}

}  // namespace

cudaError_t launch_csr_updown(const __nv_bfloat16* x, const __nv_bfloat16* wu, const __nv_bfloat16* wd_t,
                              const int64_t* row_ptr, const int32_t* cols, const __nv_bfloat16* a_vals,
                              const uint8_t* heavy, int64_t rows, int dim, __nv_bfloat16* u_vals,
                              __nv_bfloat16* y, float* l1_partial, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (dim % kChunk != 0 || dim > kMaxTrainDim) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(kCsrRowsPerCta) * dim * sizeof(__nv_bfloat16);
  cudaError_t err =
      cudaFuncSetAttribute(csr_updown_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t blocks = csr_row_blocks(rows);
  csr_updown_kernel<<<static_cast<unsigned>(blocks), kCsrRowThreads, smem, stream>>>(
      x, wu, wd_t, row_ptr, cols, a_vals, heavy, rows, dim, u_vals, y, l1_partial);
  return cudaGetLastError();
}

int64_t csr_updown_blocks(int64_t rows) { return csr_row_blocks(rows); }

cudaError_t launch_csr_l1_finish(const float* l1_partial, int64_t n, float scale, float* l1, cudaStream_t stream) {
  csr_l1_finish_kernel<<<1, kL1FinishThreads, 0, stream>>>(l1_partial, n, scale, l1);
  return cudaGetLastError();
}

}  // namespace sparse_llm
