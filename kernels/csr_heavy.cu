// Moves the heavy rows' entries of the CSR record between the record and dense [n, H] row
// blocks, for the training kernels' dense path (Tensor Core GEMMs on the gathered heavy rows).
// One warp per heavy row; lanes stride over the row's entries.
#include "csr.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerCta = kThreads / 32;

__global__ void __launch_bounds__(kThreads)
    csr_gather_rows_kernel(const __nv_bfloat16* __restrict__ dense, const int64_t* __restrict__ list, int64_t n,
                           int hidden, const int64_t* __restrict__ row_ptr, const int32_t* __restrict__ cols,
                           __nv_bfloat16* __restrict__ vals, const int64_t* __restrict__ count, int64_t capacity) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (i >= n || (count != nullptr && i >= *count)) return;
  const int64_t row = list[i];
  const int64_t end = row_ptr[row + 1] < capacity ? row_ptr[row + 1] : capacity;
  for (int64_t e = row_ptr[row] + threadIdx.x % 32; e < end; e += 32) vals[e] = dense[i * hidden + cols[e]];
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

// One pass over the heavy rows' dense blocks (n * H elements, 8 per thread):
// dh += (grad_l1 / M) sign(u); dg = dh * u into dh, du = dh * a into a, h = a * u into u.
__global__ void __launch_bounds__(kThreads)
    heavy_backward_elementwise_kernel(int64_t n_vec, const float* __restrict__ grad_l1, int64_t rows,
                                      __nv_bfloat16* __restrict__ dh, __nv_bfloat16* __restrict__ a,
                                      __nv_bfloat16* __restrict__ u) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n_vec) return;
  const float l1_scale = *grad_l1 / static_cast<float>(rows);
  float fdh[kChunk], fa[kChunk], fu[kChunk], dg[kChunk], du[kChunk], h[kChunk];
  bf16x8_to_float(reinterpret_cast<const uint4*>(dh)[i], fdh);
  bf16x8_to_float(reinterpret_cast<const uint4*>(a)[i], fa);
  bf16x8_to_float(reinterpret_cast<const uint4*>(u)[i], fu);
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    const float sign_u = fu[k] > 0.0f ? 1.0f : (fu[k] < 0.0f ? -1.0f : 0.0f);
    const float d = fdh[k] + l1_scale * sign_u;
    dg[k] = d * fu[k];
    du[k] = d * fa[k];
    h[k] = fa[k] * fu[k];
  }
  reinterpret_cast<uint4*>(dh)[i] = float_to_bf16x8(dg);
  reinterpret_cast<uint4*>(a)[i] = float_to_bf16x8(du);
  reinterpret_cast<uint4*>(u)[i] = float_to_bf16x8(h);
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kRowsPerCta - 1) / kRowsPerCta); }

}  // namespace

cudaError_t launch_csr_gather_rows(const __nv_bfloat16* dense, const int64_t* list, int64_t n, int hidden,
                                   const int64_t* row_ptr, const int32_t* cols, __nv_bfloat16* vals,
                                   cudaStream_t stream, const int64_t* count, int64_t capacity) {
  if (n == 0) return cudaSuccess;
  csr_gather_rows_kernel<<<blocks_for(n), kThreads, 0, stream>>>(dense, list, n, hidden, row_ptr, cols, vals, count,
                                                                 capacity);
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

cudaError_t launch_heavy_backward_elementwise(int64_t n, int hidden, const float* grad_l1, int64_t rows,
                                              __nv_bfloat16* dh, __nv_bfloat16* a, __nv_bfloat16* u,
                                              cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (hidden % kChunk != 0) return cudaErrorInvalidValue;
  const int64_t n_vec = n * hidden / kChunk;
  heavy_backward_elementwise_kernel<<<static_cast<unsigned>((n_vec + kThreads - 1) / kThreads), kThreads, 0,
                                      stream>>>(n_vec, grad_l1, rows, dh, a, u);
  return cudaGetLastError();
}

}  // namespace sparse_llm
