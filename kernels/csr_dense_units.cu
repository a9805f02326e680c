// The dense units of the training backward: the units with many light entries in the step, whose
// weight-gradient rows the backward takes by GEMMs over all rows instead of the per-unit kernels.
//
// The per-unit kernels read an x and a grad_y row (4 KB each) per entry, one entry after another,
// with no reuse between entries: a unit with thousands of entries (the hot units of a trained
// layer) costs them more than its column of dWg, dWu and dWd over all M rows costs three GEMMs on
// tensor cores. (The rows kernel's reads are the units' weight rows, which a hot unit's entries
// share in L1 and L2: it keeps them.) So the forward lists the units with many light entries
// (select, below; their count goes to the host with the record's sizes), and the backward scatters
// their entries' dg, du and h into a dense block (scatter) for the GEMMs, whose rows it then writes
// into the gradients (put); the per-unit kernels skip those units.
#include <cub/block/block_scan.cuh>

#include "csr.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kSelectThreads = 1024;

// One CTA: units[0, *count) = the units with fire_counts >= min_fires (none for min_fires 0),
// ascending (a block scan over chunks of the units: the same order and count every time).
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

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// slot was set to -1 everywhere (memset) before.
__global__ void dense_unit_slots_kernel(const int32_t* __restrict__ units, int64_t n, int32_t* __restrict__ slot) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) slot[units[i]] = static_cast<int32_t>(i);
}

// A warp a row: its light entries on the chunk's dense units written into the row of the block.
__global__ void __launch_bounds__(kThreads)
    scatter_dense_units_kernel(const int64_t* __restrict__ row_ptr, int64_t rows, const int32_t* __restrict__ cols,
                               const float* __restrict__ dg, const float* __restrict__ du,
                               const __nv_bfloat16* __restrict__ a_vals, const __nv_bfloat16* __restrict__ u_vals,
                               const int32_t* __restrict__ slot, int64_t first, int64_t count, int width,
                               __nv_bfloat16* __restrict__ block) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  __nv_bfloat16* out = block + row * 3 * static_cast<int64_t>(width);
  for (int64_t e = row_ptr[row] + lane; e < row_ptr[row + 1]; e += 32) {
    const int64_t s = slot[cols[e]] - first;  // off the dense units: -1 - first < 0
    if (s < 0 || s >= count) continue;
    out[s] = __float2bfloat16(dg[e]);
    out[width + s] = __float2bfloat16(du[e]);
    out[2 * width + s] = __float2bfloat16(__bfloat162float(a_vals[e]) * __bfloat162float(u_vals[e]));
  }
}

// One CTA per dense unit and matrix (blockIdx.y: dWg, dWu, dWd^T), 8 columns a thread.
template <typename Grad>
__global__ void __launch_bounds__(kThreads)
    put_dense_unit_rows_kernel(const int32_t* __restrict__ units, int width, int dim, const float* __restrict__ gu,
                               const float* __restrict__ d, bool accumulate, Grad* __restrict__ dwg,
                               Grad* __restrict__ dwu, Grad* __restrict__ dwd_t) {
  const int64_t i = blockIdx.x;
  const int64_t unit = units[i];
  const float* src = blockIdx.y == 0 ? gu + i * dim : blockIdx.y == 1 ? gu + (width + i) * dim : d + i * dim;
  Grad* dst = (blockIdx.y == 0 ? dwg : blockIdx.y == 1 ? dwu : dwd_t) + unit * dim;
  for (int v = threadIdx.x; v < dim / kChunk; v += kThreads) {
    const float4* in = reinterpret_cast<const float4*>(src) + 2 * v;
    const float4 lo = in[0], hi = in[1];
    const float vals[kChunk] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    if (accumulate)
      add8(dst, v, vals);
    else
      store8(dst, v, vals);
  }
}

template <typename Grad>
cudaError_t launch_put(const int32_t* units, int64_t n, int width, int dim, const float* gu, const float* d,
                       bool accumulate, Grad* dwg, Grad* dwu, Grad* dwd_t, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (dim % kChunk != 0 || n > width) return cudaErrorInvalidValue;
  put_dense_unit_rows_kernel<Grad><<<dim3(static_cast<unsigned>(n), 3), kThreads, 0, stream>>>(
      units, width, dim, gu, d, accumulate, dwg, dwu, dwd_t);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_select_dense_units(const int32_t* fire_counts, int hidden, int64_t min_fires, int32_t* units,
                                      int64_t* count, cudaStream_t stream) {
  select_dense_units_kernel<<<1, kSelectThreads, 0, stream>>>(fire_counts, hidden, min_fires, units, count);
  return cudaGetLastError();
}

cudaError_t launch_dense_unit_slots(const int32_t* units, int64_t n, int hidden, int32_t* slot, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(slot, 0xff, static_cast<size_t>(hidden) * sizeof(int32_t), stream);  // -1
  if (err != cudaSuccess || n == 0) return err;
  dense_unit_slots_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(units, n,
                                                                                                        slot);
  return cudaGetLastError();
}

cudaError_t launch_scatter_dense_units(const int64_t* row_ptr, int64_t rows, const int32_t* cols, const float* dg,
                                       const float* du, const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                       const int32_t* slot, int64_t first, int64_t count, int width,
                                       __nv_bfloat16* block, cudaStream_t stream) {
  if (rows == 0 || count == 0) return cudaSuccess;
  if (count > width) return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  scatter_dense_units_kernel<<<blocks, kThreads, 0, stream>>>(row_ptr, rows, cols, dg, du, a_vals, u_vals, slot,
                                                             first, count, width, block);
  return cudaGetLastError();
}

cudaError_t launch_put_dense_unit_rows(const int32_t* units, int64_t n, int width, int dim, const float* gu,
                                       const float* d, bool accumulate, __nv_bfloat16* dwg, __nv_bfloat16* dwu,
                                       __nv_bfloat16* dwd_t, cudaStream_t stream) {
  return launch_put(units, n, width, dim, gu, d, accumulate, dwg, dwu, dwd_t, stream);
}

cudaError_t launch_put_dense_unit_rows(const int32_t* units, int64_t n, int width, int dim, const float* gu,
                                       const float* d, bool accumulate, float* dwg, float* dwu, float* dwd_t,
                                       cudaStream_t stream) {
  return launch_put(units, n, width, dim, gu, d, accumulate, dwg, dwu, dwd_t, stream);
}

}  // namespace sparse_llm
