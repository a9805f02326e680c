// The light record's column order for the backward's per-unit kernel: a stable counting sort of
// the entries by unit. The record is row-major, so within a unit the entries (and their rows)
// come out ascending, the order in which the per-unit kernel adds them: deterministic.
//
// The entries are cut into `blocks` consecutive ranges, one CTA each. (1) Each CTA counts its
// range's entries per unit (shared-memory histogram) into counts[unit * blocks + block]. (2) An
// exclusive scan of counts, unit-major, gives each (unit, block) its first position. (3) Each CTA
// walks its range in order and writes every entry at its unit's next position, ranking equal units
// inside a warp-wide chunk with __match_any_sync. That walk is serial (one warp), so a CTA takes
// ~256 entries: with 2048 a CTA the kernel took ~50 us a call at 11K entries on an H100. Four
// launches; with ATen (a stable sort, searchsorted, repeat_interleave, index_select and casts) it
// was ~12 and ~40 us a layer on the 1b step.
#include <algorithm>

#include <cub/device/device_scan.cuh>

#include "csr.cuh"

namespace sparse_llm {
namespace {

constexpr int kColumnThreads = 256;
constexpr int kColumnChunk = 2048;         // entries staged in shared memory at a time
constexpr int64_t kColumnBlockEntries = 256;  // entries a CTA takes: one warp ranks them in order
constexpr int64_t kMaxColumnBlocks = 256;    // bounds counts[] when the record is large

struct Range {
  int64_t begin, end;
};

__device__ __forceinline__ int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ Range block_range(int64_t total, int64_t blocks) {
  const int64_t per = (total + blocks - 1) / blocks;
  const int64_t begin = smaller(total, static_cast<int64_t>(blockIdx.x) * per);
  return {begin, smaller(total, begin + per)};
}

// The last row r with row_ptr[r] <= e: the row holding entry e (empty rows share its offset), for
// row_ptr[0] <= e < row_ptr[rows].
__device__ int64_t row_of_entry(const int64_t* __restrict__ row_ptr, int64_t rows, int64_t e) {
  int64_t lo = 0, hi = rows;  // row_ptr[lo] <= e, and the answer is below hi
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (row_ptr[mid] <= e)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// The row of entry e, given r (row_ptr[r] <= e), the row of an earlier entry: the next entry is
// usually a few rows on, so walk a few, then search.
__device__ int64_t advance_row(const int64_t* __restrict__ row_ptr, int64_t rows, int64_t r, int64_t e) {
  for (int step = 0; step < 8; ++step) {
    if (row_ptr[r + 1] > e) return r;
    ++r;
  }
  return r + row_of_entry(row_ptr + r, rows - r, e);
}

__global__ void __launch_bounds__(kColumnThreads)
    column_counts_kernel(const int32_t* __restrict__ cols, int64_t total, int hidden, int64_t blocks,
                         int32_t* __restrict__ counts) {
  extern __shared__ int32_t unit_count[];  // [hidden]
  for (int u = threadIdx.x; u < hidden; u += kColumnThreads) unit_count[u] = 0;
  __syncthreads();
  const Range range = block_range(total, blocks);
  for (int64_t e = range.begin + threadIdx.x; e < range.end; e += kColumnThreads) atomicAdd(&unit_count[cols[e]], 1);
  __syncthreads();
  for (int u = threadIdx.x; u < hidden; u += kColumnThreads) counts[u * blocks + blockIdx.x] = unit_count[u];
}

__global__ void __launch_bounds__(kColumnThreads)
    column_scatter_kernel(const int64_t* __restrict__ row_ptr, int64_t rows, const int32_t* __restrict__ cols,
                          int64_t total, int hidden, int64_t blocks, const int32_t* __restrict__ offsets,
                          int64_t* __restrict__ unit_ptr, int32_t* __restrict__ csc_rows,
                          int32_t* __restrict__ csc_entry) {
  extern __shared__ int32_t next[];  // [hidden]: each unit's next position
  __shared__ int32_t chunk_col[kColumnChunk];
  __shared__ int32_t chunk_row[kColumnChunk];
  if (blockIdx.x == 0) {
    for (int u = threadIdx.x; u < hidden; u += kColumnThreads) unit_ptr[u] = offsets[u * blocks];
    if (threadIdx.x == 0) unit_ptr[hidden] = total;
  }
  // Each unit's first position for this CTA, read only for the units its entries hold (the
  // offsets of one CTA are strided in memory).
  for (int u = threadIdx.x; u < hidden; u += kColumnThreads) next[u] = 0;
  __syncthreads();
  const Range range = block_range(total, blocks);
  for (int64_t e = range.begin + threadIdx.x; e < range.end; e += kColumnThreads) next[cols[e]] = 1;
  __syncthreads();
  for (int u = threadIdx.x; u < hidden; u += kColumnThreads)
    if (next[u] != 0) next[u] = offsets[u * blocks + blockIdx.x];

  const int lane = threadIdx.x % 32;
  for (int64_t c0 = range.begin; c0 < range.end; c0 += kColumnChunk) {
    const int n = static_cast<int>(smaller(kColumnChunk, range.end - c0));
    // Stage the chunk's units and rows: each thread finds the row of its slice's first entry,
    // then walks on through the slice.
    const int per_thread = (n + kColumnThreads - 1) / kColumnThreads;
    const int i0 = threadIdx.x * per_thread;
    if (i0 < n) {
      int64_t r = row_of_entry(row_ptr, rows, c0 + i0);
      for (int i = i0; i < n && i < i0 + per_thread; ++i) {
        r = advance_row(row_ptr, rows, r, c0 + i);
        chunk_row[i] = static_cast<int32_t>(r);
        chunk_col[i] = cols[c0 + i];
      }
    }
    __syncthreads();
    // One warp places the chunk's entries in order; lanes holding the same unit take consecutive
    // positions in lane order, and the lowest of them advances the unit's next position.
    if (threadIdx.x < 32) {
      for (int base = 0; base < n; base += 32) {
        const int i = base + lane;
        const bool valid = i < n;
        const int unit = valid ? chunk_col[i] : -1 - lane;  // a unique key for each idle lane
        const unsigned peers = __match_any_sync(0xffffffffu, unit);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        const int first = valid ? next[unit] : 0;
        __syncwarp();
        if (valid && rank == 0) next[unit] = first + __popc(peers);
        __syncwarp();
        if (valid) {
          csc_entry[first + rank] = static_cast<int32_t>(c0 + i);
          csc_rows[first + rank] = chunk_row[i];
        }
      }
    }
    __syncthreads();  // the chunk's staging is free again
  }
}

int64_t column_blocks(int64_t total) {
  const int64_t wanted = (total + kColumnBlockEntries - 1) / kColumnBlockEntries;
  return std::max<int64_t>(1, std::min<int64_t>(kMaxColumnBlocks, wanted));
}

}  // namespace

ColumnOrderScratch csr_column_order_scratch(int64_t total, int hidden) {
  ColumnOrderScratch scratch;
  scratch.blocks = column_blocks(total);
  scratch.count_ints = static_cast<int64_t>(hidden) * scratch.blocks;
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                scratch.count_ints);
  scratch.scan_bytes = static_cast<int64_t>(bytes);
  return scratch;
}

cudaError_t launch_csr_column_order(const int64_t* row_ptr, int64_t rows, const int32_t* cols, int64_t total,
                                    int hidden, ColumnOrderScratch scratch, int32_t* counts, int32_t* offsets,
                                    void* scan_temp, int64_t* unit_ptr, int32_t* csc_rows, int32_t* csc_entry,
                                    cudaStream_t stream) {
  if (hidden > kMaxColumnSortHidden || total >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  if (total == 0) return cudaMemsetAsync(unit_ptr, 0, (static_cast<size_t>(hidden) + 1) * sizeof(int64_t), stream);
  const size_t count_smem = static_cast<size_t>(hidden) * sizeof(int32_t);
  for (const void* kernel : {reinterpret_cast<const void*>(column_counts_kernel),
                             reinterpret_cast<const void*>(column_scatter_kernel)}) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(count_smem));
    if (err != cudaSuccess) return err;
  }
  const auto grid = static_cast<unsigned>(scratch.blocks);
  column_counts_kernel<<<grid, kColumnThreads, count_smem, stream>>>(cols, total, hidden, scratch.blocks, counts);
  size_t scan_bytes = static_cast<size_t>(scratch.scan_bytes);
  cudaError_t err = cub::DeviceScan::ExclusiveSum(scan_temp, scan_bytes, static_cast<const int32_t*>(counts), offsets,
                                                   scratch.count_ints, stream);
  if (err != cudaSuccess) return err;
  column_scatter_kernel<<<grid, kColumnThreads, count_smem, stream>>>(row_ptr, rows, cols, total, hidden,
                                                                      scratch.blocks, offsets, unit_ptr, csc_rows,
                                                                      csc_entry);
  return cudaGetLastError();
}

}  // namespace sparse_llm
