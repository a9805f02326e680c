// Design 2's plan (docs/kernels.md, design review part 3): for every tile of `tile` consecutive rows of
// g, the union of the units active (g > 0) on any of its rows, built on the device in two launches
// with no host read. Plain CUDA C++: no torch headers.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace sparse_llm {

// Rows a CTA of the bits kernel reads (a warp a row): a tile must be a multiple of it, so that a
// CTA's rows lie in one tile and it ORs its words into global memory once.
constexpr int kTilePlanRowsPerCta = 8;
// The widest g: a CTA holds a row's 32-unit words in shared memory (6 KiB at this width).
constexpr int kTilePlanMaxHidden = 49152;

// bits[t, w] |= bit u % 32 of every unit u = 32 w + b active on a row of tile t (rows t * tile ...
// (t + 1) * tile - 1, the last tile possibly short). g: [rows, hidden] bf16 row-major, 16-byte
// aligned; hidden % 32 == 0, hidden <= kTilePlanMaxHidden; tile % kTilePlanRowsPerCta == 0; bits:
// [ceil(rows / tile), hidden / 32] uint32, zeroed by the caller. NaN is not active.
// Optional (both or neither): the rows' own words, row_words[r, w] (uint32 [rows, hidden / 32]), and
// row_ranks[r, w] = the active units of row r below unit 32 w (int32, same shape): where an entry
// (r, u) sits in a record of the rows' active entries, ascending by unit, is the row's offset +
// row_ranks[r, u / 32] + the set bits of row_words[r, u / 32] below bit u % 32.
cudaError_t launch_tile_union_bits(const __nv_bfloat16* g, int64_t rows, int hidden, int tile, uint32_t* bits,
                                   uint32_t* row_words, int32_t* row_ranks, cudaStream_t stream);

// From those bits: units[t * hidden + i] for i < counts[t] = tile t's active units, ascending (the
// rest of its slot unwritten). units: [tiles, hidden] int32; counts: [tiles] int32.
cudaError_t launch_tile_union_compact(const uint32_t* bits, int64_t tiles, int hidden, int32_t* units,
                                      int32_t* counts, cudaStream_t stream);

// The same plan and row layout from a record instead of g, for a backward that keeps no [M, H]
// tensor: row_ptr [rows + 1] (int64) and cols (int32, each row's units ascending) of every row's
// active entries. row_words [rows, hidden / 32] is zeroed by the caller, bits [tiles, hidden / 32]
// written whole; row_ranks[r, w] is written where row r has an active unit in word w (the only
// words a kernel asks about), as the rank of the word's first entry in the row. Any tile > 0. Then
// launch_tile_union_compact as above.
cudaError_t launch_tile_layout_from_record(const int64_t* row_ptr, const int32_t* cols, int64_t rows, int hidden,
                                           int tile, uint32_t* bits, uint32_t* row_words, int32_t* row_ranks,
                                           cudaStream_t stream);

}  // namespace sparse_llm
