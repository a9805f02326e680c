// bf16 matrix transpose through 64x64 shared-memory tiles: down_proj.weight [D, H] -> [H, D], the
// layout the sparse down projection gathers rows from.
#include "twell.cuh"

namespace sparse_llm {
namespace {

constexpr int kTile = 64;
constexpr int kRowsPerPass = 8;

__global__ void __launch_bounds__(32 * kRowsPerPass)
    transpose_kernel(const __nv_bfloat16* __restrict__ src, int64_t rows, int64_t cols,
                     __nv_bfloat16* __restrict__ dst) {
  __shared__ __nv_bfloat16 tile[kTile][kTile + 2];  // +2: fewer bank conflicts on the column read
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x;
  for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
    const int64_t r = r0 + i;
    const int64_t c = c0 + 2 * tx;
    if (r < rows) {
      if (c < cols) tile[i][2 * tx] = src[r * cols + c];
      if (c + 1 < cols) tile[i][2 * tx + 1] = src[r * cols + c + 1];
    }
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
    const int64_t out_row = c0 + i;
    const int64_t out_col = r0 + 2 * tx;
    if (out_row < cols) {
      if (out_col < rows) dst[out_row * rows + out_col] = tile[2 * tx][i];
      if (out_col + 1 < rows) dst[out_row * rows + out_col + 1] = tile[2 * tx + 1][i];
    }
  }
}

}  // namespace

cudaError_t launch_transpose_bf16(const __nv_bfloat16* src, int64_t rows, int64_t cols, __nv_bfloat16* dst,
                                  cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  if (grid.y > 65535) return cudaErrorInvalidValue;
  transpose_kernel<<<grid, dim3(32, kRowsPerPass), 0, stream>>>(src, rows, cols, dst);
  return cudaGetLastError();
}

}  // namespace sparse_llm
