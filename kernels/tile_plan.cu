// The tiles' unions of active units (tile_plan.cuh). The bits kernel reads g once, a warp a row as
// the count pass does (8 units a lane a step), folds each lane's 8-unit mask into 32-unit words
// across groups of 4 lanes, ORs them into the CTA's words in shared memory, then ORs the CTA's
// non-zero words into its tile's; where asked, it also writes each row's words and their ranks
// (a warp scan of the words' popcounts), the record layout of the row's entries. The compact kernel, a CTA a tile, lists each tile's set bits in
// order through a block-wide scan of the words' popcounts.
#include <cub/block/block_scan.cuh>

#include "tile_plan.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kBitsThreads = kTilePlanRowsPerCta * 32;
constexpr int kCompactThreads = 256;

__global__ void __launch_bounds__(kBitsThreads)
    tile_union_bits_kernel(const __nv_bfloat16* __restrict__ g, int64_t rows, int hidden, int tile,
                           uint32_t* __restrict__ bits, uint32_t* __restrict__ row_words,
                           int32_t* __restrict__ row_ranks) {
  __shared__ uint32_t cta_words[kTilePlanMaxHidden / 32];
  const int words = hidden / 32;
  for (int w = threadIdx.x; w < words; w += kBitsThreads) cta_words[w] = 0;
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kTilePlanRowsPerCta;
  const int64_t row = first_row + threadIdx.x / 32;
  if (row < rows) {
    const uint4* src = reinterpret_cast<const uint4*>(g + row * hidden);
    const int vecs = hidden / kChunk;
    int rank = 0;  // the row's active units before this step's words
    for (int v0 = 0; v0 < vecs; v0 += 32) {
      const int v = v0 + lane;  // units 8v ... 8v + 7: byte v % 4 of word v / 4
      unsigned word = 0;
      if (v < vecs) {
        float vals[kChunk];
        bf16x8_to_float(__ldg(src + v), vals);
#pragma unroll
        for (int i = 0; i < kChunk; ++i) word |= (vals[i] > 0.0f ? 1u : 0u) << (8 * (lane % 4) + i);
      }
      word |= __shfl_xor_sync(kFullMask, word, 1);
      word |= __shfl_xor_sync(kFullMask, word, 2);
      if (lane % 4 == 0 && word != 0) atomicOr(&cta_words[v / 4], word);
      if (row_words != nullptr) {
        // Each group of 4 lanes holds one word: its popcount, scanned over the warp's 8 groups.
        const int count = lane % 4 == 0 ? __popc(word) : 0;
        const int inclusive = warp_inclusive_scan(count, lane);
        if (lane % 4 == 0 && v < vecs) {
          const int64_t at = row * (hidden / 32) + v / 4;
          row_words[at] = word;
          row_ranks[at] = rank + inclusive - count;
        }
        rank += __shfl_sync(kFullMask, inclusive, 31);
      }
    }
  }
  __syncthreads();
  uint32_t* tile_words = bits + (first_row / tile) * words;
  for (int w = threadIdx.x; w < words; w += kBitsThreads)
    if (cta_words[w] != 0) atomicOr(tile_words + w, cta_words[w]);
}

__global__ void __launch_bounds__(kCompactThreads)
    tile_union_compact_kernel(const uint32_t* __restrict__ bits, int hidden, int32_t* __restrict__ units,
                              int32_t* __restrict__ counts) {
  using Scan = cub::BlockScan<int, kCompactThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int64_t t = blockIdx.x;
  const int words = hidden / 32;
  const uint32_t* tile_words = bits + t * words;
  int32_t* slot = units + t * hidden;
  int carry = 0;  // units listed by the earlier chunks of words
  for (int w0 = 0; w0 < words; w0 += kCompactThreads) {
    const int w = w0 + static_cast<int>(threadIdx.x);
    uint32_t word = w < words ? tile_words[w] : 0u;
    int offset, chunk_total;
    Scan(scan_storage).ExclusiveSum(__popc(word), offset, chunk_total);
    int32_t* out = slot + carry + offset;
    while (word != 0) {
      const int b = __ffs(word) - 1;
      *out++ = 32 * w + b;
      word &= word - 1;
    }
    carry += chunk_total;
    __syncthreads();  // scan_storage is reused by the next chunk
  }
  if (threadIdx.x == 0) counts[t] = carry;
}

// A warp a row of the record: each entry sets its bit in the row's word, and the first entry of a
// word (cols ascending) writes the word's rank.
__global__ void __launch_bounds__(kBitsThreads)
    tile_row_words_from_record_kernel(const int64_t* __restrict__ row_ptr, const int32_t* __restrict__ cols,
                                      int64_t rows, int words, uint32_t* __restrict__ row_words,
                                      int32_t* __restrict__ row_ranks) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kTilePlanRowsPerCta + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t begin = row_ptr[row], end = row_ptr[row + 1];
  uint32_t* out_words = row_words + row * words;
  int32_t* out_ranks = row_ranks + row * words;
  for (int64_t e = begin + lane; e < end; e += 32) {
    const int unit = cols[e];
    if (static_cast<unsigned>(unit) >= static_cast<unsigned>(32 * words)) continue;  // not a unit: no write
    atomicOr(out_words + unit / 32, 1u << (unit % 32));
    if (e == begin || cols[e - 1] / 32 != unit / 32) out_ranks[unit / 32] = static_cast<int32_t>(e - begin);
  }
}

// A thread a (tile, word): the OR of the tile's rows' words.
__global__ void tile_bits_from_rows_kernel(const uint32_t* __restrict__ row_words, int64_t rows, int words, int tile,
                                           int64_t tiles, uint32_t* __restrict__ bits) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tiles * words) return;
  const int64_t t = i / words, w = i % words;
  const int64_t last = t * tile + tile < rows ? t * tile + tile : rows;
  uint32_t word = 0;
  for (int64_t r = t * tile; r < last; ++r) word |= row_words[r * words + w];
  bits[i] = word;
}

}  // namespace

cudaError_t launch_tile_layout_from_record(const int64_t* row_ptr, const int32_t* cols, int64_t rows, int hidden,
                                           int tile, uint32_t* bits, uint32_t* row_words, int32_t* row_ranks,
                                           cudaStream_t stream) {
  if (hidden % 32 != 0 || hidden > kTilePlanMaxHidden || tile <= 0) return cudaErrorInvalidValue;
  if (rows == 0 || hidden == 0) return cudaSuccess;
  const int words = hidden / 32;
  const int64_t row_blocks = (rows + kTilePlanRowsPerCta - 1) / kTilePlanRowsPerCta;
  tile_row_words_from_record_kernel<<<static_cast<unsigned>(row_blocks), kBitsThreads, 0, stream>>>(
      row_ptr, cols, rows, words, row_words, row_ranks);
  const int64_t tiles = (rows + tile - 1) / tile;
  constexpr int kThreads = 256;
  const int64_t blocks = (tiles * words + kThreads - 1) / kThreads;
  tile_bits_from_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(row_words, rows, words, tile,
                                                                                     tiles, bits);
  return cudaGetLastError();
}

cudaError_t launch_tile_union_bits(const __nv_bfloat16* g, int64_t rows, int hidden, int tile, uint32_t* bits,
                                   uint32_t* row_words, int32_t* row_ranks, cudaStream_t stream) {
  if (hidden % 32 != 0 || hidden > kTilePlanMaxHidden || tile <= 0 || tile % kTilePlanRowsPerCta != 0 ||
      (row_words == nullptr) != (row_ranks == nullptr))
    return cudaErrorInvalidValue;
  if (rows == 0 || hidden == 0) return cudaSuccess;
  const int64_t blocks = (rows + kTilePlanRowsPerCta - 1) / kTilePlanRowsPerCta;
  tile_union_bits_kernel<<<static_cast<unsigned>(blocks), kBitsThreads, 0, stream>>>(g, rows, hidden, tile, bits,
                                                                                     row_words, row_ranks);
  return cudaGetLastError();
}

cudaError_t launch_tile_union_compact(const uint32_t* bits, int64_t tiles, int hidden, int32_t* units,
                                      int32_t* counts, cudaStream_t stream) {
  if (hidden % 32 != 0 || hidden > kTilePlanMaxHidden) return cudaErrorInvalidValue;
  if (tiles == 0) return cudaSuccess;
  tile_union_compact_kernel<<<static_cast<unsigned>(tiles), kCompactThreads, 0, stream>>>(bits, hidden, units,
                                                                                          counts);
  return cudaGetLastError();
}

}  // namespace sparse_llm
