// Moves the heavy rows' entries of the CSR record between the record and dense [n, H] row
// blocks, for the training kernels' dense path (Tensor Core GEMMs on the gathered heavy rows).
// One warp per heavy row; lanes stride over the row's entries.
#include "csr.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerCta = kThreads / 32;

__global__ void __launch_bounds__(kThreads)
    csr_gather_rows_kernel(const __nv_bfloat16* __restrict__ dense, const int64_t* __restrict__ list, int64_t n,
                           int hidden, const int64_t* __restrict__ row_ptr, const int32_t* __restrict__ cols,
                           __nv_bfloat16* __restrict__ vals) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (i >= n) return;
  const int64_t row = list[i];
  for (int64_t e = row_ptr[row] + threadIdx.x % 32; e < row_ptr[row + 1]; e += 32)
    vals[e] = dense[i * hidden + cols[e]];
}

__global__ void __launch_bounds__(kThreads)
    csr_scatter_rows_kernel(const int64_t* __restrict__ list, int64_t n, int hidden,
                            const int64_t* __restrict__ row_ptr, const int32_t* __restrict__ cols,
                            const __nv_bfloat16* __restrict__ a_vals, const __nv_bfloat16* __restrict__ u_vals,
                            __nv_bfloat16* __restrict__ a_dense, __nv_bfloat16* __restrict__ u_dense) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (i >= n) return;
  const int64_t row = list[i];
  for (int64_t e = row_ptr[row] + threadIdx.x % 32; e < row_ptr[row + 1]; e += 32) {
    a_dense[i * hidden + cols[e]] = a_vals[e];
    u_dense[i * hidden + cols[e]] = u_vals[e];
  }
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kRowsPerCta - 1) / kRowsPerCta); }

}  // namespace

cudaError_t launch_csr_gather_rows(const __nv_bfloat16* dense, const int64_t* list, int64_t n, int hidden,
                                   const int64_t* row_ptr, const int32_t* cols, __nv_bfloat16* vals,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  csr_gather_rows_kernel<<<blocks_for(n), kThreads, 0, stream>>>(dense, list, n, hidden, row_ptr, cols, vals);
  return cudaGetLastError();
}

cudaError_t launch_csr_scatter_rows(const int64_t* list, int64_t n, int hidden, const int64_t* row_ptr,
                                    const int32_t* cols, const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                    __nv_bfloat16* a_dense, __nv_bfloat16* u_dense, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  csr_scatter_rows_kernel<<<blocks_for(n), kThreads, 0, stream>>>(list, n, hidden, row_ptr, cols, a_vals, u_vals,
                                                                  a_dense, u_dense);
  return cudaGetLastError();
}

}  // namespace sparse_llm
