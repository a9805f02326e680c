// Matrix transpose through 64x64 shared-memory tiles, casting on the way: down_proj.weight [D, H]
// -> [H, D] bf16, the layout the sparse down projection gathers rows from (from bf16, or from the
// fp32 master weight in one pass instead of a cast and a transpose), and the weight gradient's
// [H, D] -> [D, H] in bf16 or fp32.
#include "twell.cuh"

namespace sparse_llm {
namespace {

constexpr int kTile = 64;
constexpr int kRowsPerPass = 8;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

template <typename Src, typename Dst>
__global__ void __launch_bounds__(32 * kRowsPerPass)
    transpose_kernel(const Src* __restrict__ src, int64_t rows, int64_t cols, Dst* __restrict__ dst) {
  __shared__ float tile[kTile][kTile + 1];  // +1: the column reads below hit at most two ways per bank
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x;
  for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
    const int64_t r = r0 + i;
    const int64_t c = c0 + 2 * tx;
    if (r < rows) {
      if (c < cols) tile[i][2 * tx] = to_float(src[r * cols + c]);
      if (c + 1 < cols) tile[i][2 * tx + 1] = to_float(src[r * cols + c + 1]);
    }
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
    const int64_t out_row = c0 + i;
    const int64_t out_col = r0 + 2 * tx;
    if (out_row < cols) {
      if (out_col < rows) store(dst + out_row * rows + out_col, tile[2 * tx][i]);
      if (out_col + 1 < rows) store(dst + out_row * rows + out_col + 1, tile[2 * tx + 1][i]);
    }
  }
}

template <typename Src, typename Dst>
cudaError_t launch(const Src* src, int64_t rows, int64_t cols, Dst* dst, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  if (grid.y > 65535) return cudaErrorInvalidValue;
  transpose_kernel<<<grid, dim3(32, kRowsPerPass), 0, stream>>>(src, rows, cols, dst);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_transpose_bf16(const __nv_bfloat16* src, int64_t rows, int64_t cols, __nv_bfloat16* dst,
                                  cudaStream_t stream) {
  return launch(src, rows, cols, dst, stream);
}

cudaError_t launch_transpose(const float* src, int64_t rows, int64_t cols, __nv_bfloat16* dst, cudaStream_t stream) {
  return launch(src, rows, cols, dst, stream);
}

cudaError_t launch_transpose(const float* src, int64_t rows, int64_t cols, float* dst, cudaStream_t stream) {
  return launch(src, rows, cols, dst, stream);
}

}  // namespace sparse_llm
