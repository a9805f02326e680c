// A warp per row: its lanes count the row's positive entries (16-byte loads, a bit mask per load)
// and add each positive entry to the CTA's per-column counters in shared memory; each CTA then
// adds its counters to the global ones. One read of the matrix, where `(a > 0).sum(-1)` and
// `.sum(0)` make a bool copy and read it twice.
#include "activation_counts.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 1024;  // grid-stride over rows: the per-CTA counters are flushed once

__global__ void __launch_bounds__(kThreads)
    activation_counts_kernel(const __nv_bfloat16* __restrict__ a, int64_t rows, int hidden,
                             int64_t* __restrict__ row_counts, int32_t* __restrict__ col_counts) {
  extern __shared__ int32_t block_cols[];
  for (int c = threadIdx.x; c < hidden; c += kThreads) block_cols[c] = 0;
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int vecs = hidden / kChunk;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const uint4* src = reinterpret_cast<const uint4*>(a + row * hidden);
    int count = 0;
    for (int v = lane; v < vecs; v += 32) {
      float vals[kChunk];
      bf16x8_to_float(__ldg(src + v), vals);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        if (vals[i] > 0.0f) {
          ++count;
          atomicAdd(&block_cols[v * kChunk + i], 1);
        }
      }
    }
    count = __reduce_add_sync(kFullMask, count);
    if (lane == 0) row_counts[row] = count;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < hidden; c += kThreads) {
    if (block_cols[c] != 0) atomicAdd(&col_counts[c], block_cols[c]);
  }
}

}  // namespace

cudaError_t launch_activation_counts(const __nv_bfloat16* a, int64_t rows, int hidden, int64_t* row_counts,
                                     int32_t* col_counts, cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  if (hidden % kChunk != 0 || hidden > kMaxCountColumns) return cudaErrorInvalidValue;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  const unsigned grid = static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
  const size_t smem = static_cast<size_t>(hidden) * sizeof(int32_t);
  activation_counts_kernel<<<grid, kThreads, smem, stream>>>(a, rows, hidden, row_counts, col_counts);
  return cudaGetLastError();
}

}  // namespace sparse_llm
