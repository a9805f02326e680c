// The split of the rows into light and heavy, with everything the training kernels index by it,
// in one launch: the heavy mask, the light rows' counts, both kinds' row offsets and, for the
// forward, the ordered lists of the heavy and of the active rows and the four sizes the host reads.
//
// One CTA walks the rows in tiles (consecutive rows a thread, block-wide scans of their sums).
// Written with ATen it was a dozen small kernels; in the forward they sit between the gate GEMM
// and the host read, so each of them delayed the read, after which the GPU waits on the host.
#include <cub/block/block_scan.cuh>

#include "csr.cuh"

namespace sparse_llm {
namespace {

constexpr int kSplitThreads = 512;
constexpr int kRowsPerThread = 8;
constexpr int64_t kTileRows = kSplitThreads * kRowsPerThread;

// The four running sums of a chunk of rows.
struct SplitSums {
  long long light_entries, heavy_entries, heavy_rows, active_rows;
};

__device__ __forceinline__ SplitSums operator+(const SplitSums& a, const SplitSums& b) {
  return {a.light_entries + b.light_entries, a.heavy_entries + b.heavy_entries, a.heavy_rows + b.heavy_rows,
          a.active_rows + b.active_rows};
}

using Scan = cub::BlockScan<long long, kSplitThreads>;

// Exclusive prefix of v over the block's threads, and the block's total.
__device__ __forceinline__ long long block_exclusive_sum(long long v, long long& total,
                                                         typename Scan::TempStorage& storage) {
  long long prefix;
  Scan(storage).ExclusiveSum(v, prefix, total);
  __syncthreads();  // storage reused by the next scan
  return prefix;
}

__global__ void __launch_bounds__(kSplitThreads)
    csr_split_rows_kernel(const int64_t* __restrict__ nnz, int64_t rows, int64_t threshold,
                          const int64_t* __restrict__ heavy_list, int64_t n_heavy_list, uint8_t* __restrict__ heavy,
                          int64_t* __restrict__ light_nnz, int64_t* __restrict__ light_ptr,
                          int64_t* __restrict__ heavy_ptr, int64_t* __restrict__ heavy_rows_out,
                          int64_t* __restrict__ active_rows_out, int64_t* __restrict__ sizes) {
  __shared__ typename Scan::TempStorage scan_storage;
  const bool from_list = heavy_list != nullptr;
  if (from_list) {  // the backward's mask, from the forward's list of heavy rows
    for (int64_t r = threadIdx.x; r < rows; r += kSplitThreads) heavy[r] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n_heavy_list; i += kSplitThreads) heavy[heavy_list[i]] = 1;
    __syncthreads();  // the mask's global writes visible to the whole block
  }
  if (threadIdx.x == 0) light_ptr[0] = heavy_ptr[0] = 0;

  // Tiles of kRowsPerThread consecutive rows a thread, in order; `carry` holds the sums of the
  // tiles before.
  SplitSums carry{0, 0, 0, 0};
  for (int64_t tile = 0; tile < rows; tile += kTileRows) {
    const int64_t first = tile + static_cast<int64_t>(threadIdx.x) * kRowsPerThread;
    long long n[kRowsPerThread];
    bool is_heavy[kRowsPerThread];
    SplitSums sums{0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int64_t r = first + k;
      n[k] = r < rows ? nnz[r] : 0;
      is_heavy[k] = r < rows && (from_list ? heavy[r] != 0 : n[k] > threshold);
      (is_heavy[k] ? sums.heavy_entries : sums.light_entries) += n[k];
      sums.heavy_rows += is_heavy[k];
      sums.active_rows += n[k] > 0;
    }
    SplitSums at, tile_total;
    at.light_entries = block_exclusive_sum(sums.light_entries, tile_total.light_entries, scan_storage);
    at.heavy_entries = block_exclusive_sum(sums.heavy_entries, tile_total.heavy_entries, scan_storage);
    at.heavy_rows = block_exclusive_sum(sums.heavy_rows, tile_total.heavy_rows, scan_storage);
    at.active_rows = block_exclusive_sum(sums.active_rows, tile_total.active_rows, scan_storage);
    at = at + carry;
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int64_t r = first + k;
      if (r >= rows) break;
      if (is_heavy[k]) {
        at.heavy_entries += n[k];
        if (heavy_rows_out != nullptr) heavy_rows_out[at.heavy_rows] = r;
        ++at.heavy_rows;
      } else {
        at.light_entries += n[k];
      }
      if (n[k] > 0) {
        if (active_rows_out != nullptr) active_rows_out[at.active_rows] = r;
        ++at.active_rows;
      }
      if (!from_list) heavy[r] = is_heavy[k];
      light_nnz[r] = is_heavy[k] ? 0 : n[k];
      light_ptr[r + 1] = at.light_entries;
      heavy_ptr[r + 1] = at.heavy_entries;
    }
    carry = carry + tile_total;
  }
  if (sizes != nullptr && threadIdx.x == 0) {
    sizes[0] = carry.light_entries;
    sizes[1] = carry.heavy_rows;
    sizes[2] = carry.heavy_entries;
    sizes[3] = carry.active_rows;
  }
}

}  // namespace

cudaError_t launch_csr_split_rows(const int64_t* nnz, int64_t rows, int64_t threshold, const int64_t* heavy_list,
                                  int64_t n_heavy_list, RowSplitView out, cudaStream_t stream) {
  csr_split_rows_kernel<<<1, kSplitThreads, 0, stream>>>(nnz, rows, threshold, heavy_list, n_heavy_list, out.heavy,
                                                         out.light_nnz, out.light_ptr, out.heavy_ptr, out.heavy_rows,
                                                         out.active_rows, out.sizes);
  return cudaGetLastError();
}

}  // namespace sparse_llm
