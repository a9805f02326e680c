// Training forward after the pack: the gated up/down projection from the CSR record.
//
// One CTA owns kRowsPerCta consecutive rows, whose entries are one contiguous range of the record.
// (1) The rows of x are staged in shared memory. (2) Warps take the block's entries round robin:
// u = x[r] . wu[unit] (16-byte gathers of the wu row, warp reduction), stored as bf16. (3) Every
// thread owns 8 output columns and accumulates y[r] += a * u * wd_t[unit] over the row's entries
// (coalesced 16-byte gathers, fp32). No per-row capacity: a fully dense row is just a long loop.
#include "csr.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kRowsPerCta = 8;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUpLoads = 8;     // 16-byte wu loads in flight per lane
constexpr int kDownUnroll = 4;  // wd_t rows in flight per thread

// Row (0 .. kRowsPerCta) of entry e, given the block's row offsets in shared memory.
__device__ __forceinline__ int local_row(const int64_t* ptr, int n_rows, int64_t e) {
  int r = 0;
  while (r + 1 < n_rows && ptr[r + 1] <= e) ++r;
  return r;
}

__global__ void __launch_bounds__(kThreads)
    csr_updown_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wu,
                      const __nv_bfloat16* __restrict__ wd_t, const int64_t* __restrict__ row_ptr,
                      const int32_t* __restrict__ cols, const __nv_bfloat16* __restrict__ a_vals,
                      const uint8_t* __restrict__ heavy, int64_t rows, int dim, __nv_bfloat16* u_vals,
                      __nv_bfloat16* __restrict__ y) {
  extern __shared__ uint4 smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);  // [kRowsPerCta][dim]
  __shared__ int64_t ptr[kRowsPerCta + 1];
  __shared__ bool skip[kRowsPerCta];  // heavy rows: the dense path owns them

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta;
  const int n_rows = static_cast<int>(rows - row0 < kRowsPerCta ? rows - row0 : kRowsPerCta);
  const int vecs = dim / kChunk;
  if (threadIdx.x <= n_rows) ptr[threadIdx.x] = row_ptr[row0 + threadIdx.x];
  if (threadIdx.x < n_rows) skip[threadIdx.x] = heavy[row0 + threadIdx.x] != 0;
  for (int i = threadIdx.x; i < n_rows * vecs; i += kThreads)
    reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x + row0 * dim)[i];
  __syncthreads();

  // (2) u at every entry of the block.
  for (int64_t e = ptr[0] + warp; e < ptr[n_rows]; e += kWarps) {
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
    for (int v = threadIdx.x; v < vecs; v += kThreads) {
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
  const size_t smem = static_cast<size_t>(kRowsPerCta) * dim * sizeof(__nv_bfloat16);
  cudaError_t err =
      cudaFuncSetAttribute(csr_updown_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t blocks = (rows + kRowsPerCta - 1) / kRowsPerCta;
  csr_updown_kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(x, wu, wd_t, row_ptr, cols, a_vals,
                                                                              heavy, rows, dim, u_vals, y);
  return cudaGetLastError();
}

}  // namespace sparse_llm
