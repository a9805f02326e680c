// The split of the rows into light and heavy, with everything the training kernels index by it:
// the heavy mask, both kinds' row offsets and, for the forward, the ordered
// lists of the heavy and of the active rows and the first four sizes the host reads
// (the fifth, the dense units, is written by launch_select_dense_units).
//
// Two launches over tiles of kTileRows rows: the first sums each tile, the second scans each tile
// from the sums of the tiles before it and writes the outputs. Written with ATen it was a dozen
// small kernels, and in one CTA 54 us at 16384 rows; in the forward it sits between the gate GEMM
// and the host read, so its time delays the read, after which the GPU waits on the host.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "csr.cuh"

namespace sparse_llm {
namespace {

constexpr int kSplitThreads = 256;
constexpr int kRowsPerThread = 4;
constexpr int kTileRows = kSplitThreads * kRowsPerThread;

// The four running sums of a set of rows.
struct SplitSums {
  long long light_entries, heavy_entries, heavy_rows, active_rows;
};

struct AddSums {
  __device__ __forceinline__ SplitSums operator()(const SplitSums& a, const SplitSums& b) const {
    return {a.light_entries + b.light_entries, a.heavy_entries + b.heavy_entries, a.heavy_rows + b.heavy_rows,
            a.active_rows + b.active_rows};
  }
};

// Where the heavy rows come from: nnz > threshold (forward), or the forward's list of them, in
// ascending order (backward).
struct HeavySource {
  int64_t threshold;
  const int64_t* list;  // null: by threshold
  int64_t list_size;
};

// This CTA's tile: the counts of its rows and which of them are heavy, in shared memory.
struct Tile {
  int64_t first;
  int rows;
  long long nnz[kTileRows];
  bool heavy[kTileRows];
};

__device__ void load_tile(const int64_t* __restrict__ nnz, int64_t rows, const HeavySource& src, Tile& tile) {
  tile.first = static_cast<int64_t>(blockIdx.x) * kTileRows;
  tile.rows = static_cast<int>(rows - tile.first < kTileRows ? rows - tile.first : kTileRows);
  for (int i = threadIdx.x; i < kTileRows; i += kSplitThreads) {
    tile.nnz[i] = i < tile.rows ? nnz[tile.first + i] : 0;
    tile.heavy[i] = src.list == nullptr && i < tile.rows && tile.nnz[i] > src.threshold;
  }
  if (src.list != nullptr) {
    __syncthreads();
    // The list's entries inside the tile form one run: find where it starts, then mark it.
    __shared__ int64_t run_begin;
    if (threadIdx.x == 0) {
      int64_t lo = 0, hi = src.list_size;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (src.list[mid] < tile.first)
          lo = mid + 1;
        else
          hi = mid;
      }
      run_begin = lo;
    }
    __syncthreads();
    for (int64_t i = run_begin + threadIdx.x; i < src.list_size && src.list[i] < tile.first + tile.rows;
         i += kSplitThreads)
      tile.heavy[src.list[i] - tile.first] = true;
  }
  __syncthreads();
}

// The sums of this thread's kRowsPerThread consecutive rows of the tile.
__device__ SplitSums thread_sums(const Tile& tile) {
  SplitSums s{0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int i = threadIdx.x * kRowsPerThread + k;
    const long long n = tile.nnz[i];
    (tile.heavy[i] ? s.heavy_entries : s.light_entries) += n;
    s.heavy_rows += tile.heavy[i];
    s.active_rows += n > 0;
  }
  return s;
}

__global__ void __launch_bounds__(kSplitThreads)
    csr_split_tile_sums_kernel(const int64_t* __restrict__ nnz, int64_t rows, HeavySource src,
                               SplitSums* __restrict__ tile_sums) {
  using Reduce = cub::BlockReduce<SplitSums, kSplitThreads>;
  __shared__ typename Reduce::TempStorage reduce_storage;
  __shared__ Tile tile;
  load_tile(nnz, rows, src, tile);
  const SplitSums total = Reduce(reduce_storage).Reduce(thread_sums(tile), AddSums());
  if (threadIdx.x == 0) tile_sums[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kSplitThreads)
    csr_split_write_kernel(const int64_t* __restrict__ nnz, int64_t rows, HeavySource src,
                           const SplitSums* __restrict__ tile_sums, RowSplitView out) {
  using Reduce = cub::BlockReduce<SplitSums, kSplitThreads>;
  using Scan = cub::BlockScan<SplitSums, kSplitThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } storage;
  __shared__ Tile tile;
  __shared__ SplitSums carry;
  load_tile(nnz, rows, src, tile);

  // The sums of the tiles before this one.
  SplitSums before{0, 0, 0, 0};
  for (unsigned t = threadIdx.x; t < blockIdx.x; t += kSplitThreads) before = AddSums()(before, tile_sums[t]);
  before = Reduce(storage.reduce).Reduce(before, AddSums());
  if (threadIdx.x == 0) carry = before;
  __syncthreads();

  SplitSums at;
  Scan(storage.scan).ExclusiveScan(thread_sums(tile), at, carry, AddSums());
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    out.light_ptr[0] = out.heavy_ptr[0] = 0;
    if (rows == 0 && out.sizes != nullptr) out.sizes[0] = out.sizes[1] = out.sizes[2] = out.sizes[3] = 0;
  }
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int i = threadIdx.x * kRowsPerThread + k;
    if (i >= tile.rows) break;
    const int64_t r = tile.first + i;
    const long long n = tile.nnz[i];
    const bool heavy = tile.heavy[i];
    if (heavy) {
      at.heavy_entries += n;
      if (out.heavy_rows != nullptr) out.heavy_rows[at.heavy_rows] = r;
      ++at.heavy_rows;
    } else {
      at.light_entries += n;
    }
    if (n > 0) {
      if (out.active_rows != nullptr) out.active_rows[at.active_rows] = r;
      ++at.active_rows;
    }
    out.heavy[r] = heavy;
    out.light_ptr[r + 1] = at.light_entries;
    out.heavy_ptr[r + 1] = at.heavy_entries;
    if (r == rows - 1 && out.sizes != nullptr) {  // the running sums through the last row: the totals
      out.sizes[0] = at.light_entries;
      out.sizes[1] = at.heavy_rows;
      out.sizes[2] = at.heavy_entries;
      out.sizes[3] = at.active_rows;
    }
  }
}

}  // namespace

int64_t csr_split_tiles(int64_t rows) { return (rows + kTileRows - 1) / kTileRows; }

cudaError_t launch_csr_split_rows(const int64_t* nnz, int64_t rows, int64_t threshold, const int64_t* heavy_list,
                                  int64_t n_heavy_list, int64_t* tile_scratch, RowSplitView out,
                                  cudaStream_t stream) {
  const HeavySource src{threshold, heavy_list, n_heavy_list};
  const int64_t tiles = csr_split_tiles(rows);
  SplitSums* tile_sums = reinterpret_cast<SplitSums*>(tile_scratch);
  if (tiles > 0) {
    csr_split_tile_sums_kernel<<<static_cast<unsigned>(tiles), kSplitThreads, 0, stream>>>(nnz, rows, src,
                                                                                           tile_sums);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  // At least one CTA: with no rows it still writes the offsets' first element and the sizes.
  csr_split_write_kernel<<<static_cast<unsigned>(tiles > 0 ? tiles : 1), kSplitThreads, 0, stream>>>(
      nnz, rows, src, tile_sums, out);
  return cudaGetLastError();
}

}  // namespace sparse_llm
