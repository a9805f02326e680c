// The dense units of the training backward: the units that fired on many rows of the step, whose
// light entries the backward takes as dense GEMMs over all rows instead of one entry at a time.
//
// A unit that fires on a few percent of the rows costs the per-entry kernels one 4 KB weight row
// (rows kernel) and an x and a grad_y row (units kernel) per entry, read at a few TFLOP/s of
// useful work; over all M rows on tensor cores its column costs about as much as ~1-2% of them do
// gathered. So the forward lists the units over a fire count (select, below; the count goes to
// the host with the record's sizes), and the backward scatters their light entries into dense
// [M, n] blocks (scatter, below) for its GEMMs, while the per-entry kernels skip them.
#include <cub/block/block_scan.cuh>

#include "csr.cuh"

namespace sparse_llm {
namespace {

constexpr int kSelectThreads = 1024;

// One CTA: units[0, *count) = the units with fire_counts >= min_fires (none for min_fires 0), ascending (a block scan
// over chunks of the units, so the order and the count are the same every time).
__global__ void __launch_bounds__(kSelectThreads)
    select_dense_units_kernel(const int32_t* __restrict__ fire_counts, int hidden, int64_t min_fires,
                              int32_t* __restrict__ units, int64_t* __restrict__ count) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan;
  int base = 0;
  for (int chunk = 0; chunk < hidden; chunk += kSelectThreads) {
    const int unit = chunk + static_cast<int>(threadIdx.x);
    const int dense = min_fires > 0 && unit < hidden && fire_counts[unit] >= min_fires ? 1 : 0;
    int rank, chunk_total;
    Scan(scan).ExclusiveSum(dense, rank, chunk_total);
    if (dense) units[base + rank] = unit;
    base += chunk_total;
    __syncthreads();  // the scan's storage is reused by the next chunk
  }
  if (threadIdx.x == 0) *count = base;
}

constexpr int kScatterThreads = 256;
constexpr int kScatterWarps = kScatterThreads / 32;

// A warp a row: its light entries on dense units written at (row, slot) of a_dense and u_dense.
__global__ void __launch_bounds__(kScatterThreads)
    scatter_dense_units_kernel(const int64_t* __restrict__ row_ptr, int64_t rows, const int32_t* __restrict__ cols,
                               const __nv_bfloat16* __restrict__ a_vals, const __nv_bfloat16* __restrict__ u_vals,
                               const int32_t* __restrict__ slot, int width, __nv_bfloat16* __restrict__ a_dense,
                               __nv_bfloat16* __restrict__ u_dense) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kScatterWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  for (int64_t e = row_ptr[row] + lane; e < row_ptr[row + 1]; e += 32) {
    const int s = slot[cols[e]];
    if (s < 0) continue;
    a_dense[row * width + s] = a_vals[e];
    u_dense[row * width + s] = u_vals[e];
  }
}

}  // namespace

cudaError_t launch_select_dense_units(const int32_t* fire_counts, int hidden, int64_t min_fires, int32_t* units,
                                      int64_t* count, cudaStream_t stream) {
  select_dense_units_kernel<<<1, kSelectThreads, 0, stream>>>(fire_counts, hidden, min_fires, units, count);
  return cudaGetLastError();
}

cudaError_t launch_scatter_dense_units(const int64_t* row_ptr, int64_t rows, const int32_t* cols,
                                       const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals, const int32_t* slot,
                                       int width, __nv_bfloat16* a_dense, __nv_bfloat16* u_dense,
                                       cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((rows + kScatterWarps - 1) / kScatterWarps);
  scatter_dense_units_kernel<<<blocks, kScatterThreads, 0, stream>>>(row_ptr, rows, cols, a_vals, u_vals, slot,
                                                                    width, a_dense, u_dense);
  return cudaGetLastError();
}

}  // namespace sparse_llm
