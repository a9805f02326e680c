// TwELL (tile-wise ELLPACK) format and the launchers of the inference kernels.
// Plain CUDA C++: no torch headers, so every .cu compiles with `nvcc -c` alone.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace sparse_llm {

// The H columns of a = relu(g) are split into tiles of kTwellTile columns (the gate GEMM's N tile);
// each (row, tile) stores up to kTwellSlots non-zeros (compression factor C = 8) as
// (value, column-in-tile) pairs plus its true count. A count above kTwellSlots marks an overflowed
// tile: its row is routed to the exact dense path, nothing is dropped.
constexpr int kTwellTile = 128;
constexpr int kTwellSlots = 16;

// Largest per-row non-zero budget of the sparse path (a kernel launch parameter, bounded so that
// the per-block entry lists fit in shared memory).
constexpr int kMaxLightRowNnz = 512;

struct TwellView {
  const __nv_bfloat16* values;  // [M, n_tiles, kTwellSlots]; slots >= min(count, kTwellSlots) hold 0,
                                // except in empty tiles: unwritten (never read)
  const uint8_t* cols;          // [M, n_tiles, kTwellSlots]; column inside the tile
  const int32_t* counts;        // [M, n_tiles]; true number of non-zeros of the tile
  const int32_t* row_nnz;       // [M]; non-zeros of the row (the sum of its counts)
  int n_tiles;
};

inline int twell_n_tiles(int hidden) { return (hidden + kTwellTile - 1) / kTwellTile; }

// Packs a = relu(g) (g: [M, H] bf16, row-major) into TwELL. Writes row_nnz[M] (true non-zeros of
// each row) and heavy[M] = 1 when the row overflows a tile or holds more than heavy_threshold
// non-zeros (such rows take the dense path). Needs H % 8 == 0 and g 16-byte aligned.
cudaError_t launch_twell_pack(const __nv_bfloat16* g, int64_t rows, int hidden, int heavy_threshold,
                              __nv_bfloat16* values, uint8_t* cols, int32_t* counts, int32_t* row_nnz,
                              uint8_t* heavy, cudaStream_t stream);

// The same TwELL, from a = relu(g) and the gate GEMM's ReLU bit mask (kernels/gate_gemm.cpp):
// mask[row] holds n_tiles * 4 words, tile t in words 4t .. 4t+3; bit j of word w is set at least
// where a[row, 128 t + 32 w + j] > 0 (cuBLASLt sets it where g >= 0: the pack skips zero values;
// bits past H are ignored). Reads the mask and the values under set bits only, and leaves the
// slots of empty tiles unwritten: ~1/16 of the dense pack's traffic when the rows are sparse.
cudaError_t launch_twell_pack_masked(const __nv_bfloat16* a, const uint32_t* mask, int64_t rows, int hidden,
                                     int heavy_threshold, __nv_bfloat16* values, uint8_t* cols, int32_t* counts,
                                     int32_t* row_nnz, uint8_t* heavy, cudaStream_t stream);

// y[r] = sum_j a[r, j] * (x[r] . wu[j]) * wd_t[j] for every row r with heavy[r] == 0, or with
// `accumulate` y[r] += that sum (rounded to bf16 first, as a separate add would); rows with
// heavy[r] != 0 are left untouched (the dense path writes them). x: [M, D], wu: [H, D],
// wd_t: [H, D] (down_proj.weight transposed), y: [M, D], all bf16 row-major, 16-byte aligned,
// D % 8 == 0, D <= kMaxDim; light rows hold at most max_row_nnz <= kMaxLightRowNnz non-zeros.
constexpr int kMaxDim = 8192;
cudaError_t launch_twell_updown(const __nv_bfloat16* x, const __nv_bfloat16* wu, const __nv_bfloat16* wd_t,
                                TwellView twell, const uint8_t* heavy, int64_t rows, int dim,
                                int max_row_nnz, bool accumulate, __nv_bfloat16* y, cudaStream_t stream);

// list[0 .. count) = the rows with heavy[row] != 0, in order, given inclusive_pos = cumsum(heavy).
cudaError_t launch_compact_rows(const uint8_t* heavy, const int32_t* inclusive_pos, int64_t rows, int64_t* list,
                                cudaStream_t stream);

// In the helpers below, the rows processed are i < min(*count, n) where count (on the device) is
// given, else i < n.
//
// dst[i, :] = src[list[i], :] for those rows, zero for the others up to `padded`: rows of row_bytes
// bytes (any element type; a multiple of 16), src: [*, row] and dst: [padded, row] row-major,
// 16-byte aligned.
cudaError_t launch_gather_rows_padded(const void* src, const int64_t* list, const int64_t* count, int64_t n,
                                      int64_t padded, int64_t row_bytes, void* dst, cudaStream_t stream);

// dst[list[i], :] = src[i, :] for those rows (the inverse of the gather; rows as there).
cudaError_t launch_scatter_rows(const void* src, const int64_t* list, const int64_t* count, int64_t n,
                                int64_t row_bytes, void* dst, cudaStream_t stream);

// *acc += scale * sum_i |bf16(a[i] u[i])| (h as the dense path rounds it) over n entries, summed in a
// fixed order (deterministic); acc: one float on the device; a and u 16-byte aligned.
cudaError_t launch_add_abs_product_sum(const __nv_bfloat16* a, const __nv_bfloat16* u, int64_t n, float scale,
                                       float* acc, cudaStream_t stream);

// h[i, :] = bf16(relu(g[list[i], :]) * u[i, :]) for those rows, zero for the others up to n: the
// dense path's gate on gathered rows. g: [M, H], u, h: [n, H] (h may be u), bf16 row-major,
// H % 8 == 0, 16-byte aligned.
cudaError_t launch_gate_mul_rows(const __nv_bfloat16* g, const int64_t* list, const int64_t* count, int64_t n,
                                 int hidden, const __nv_bfloat16* u, __nv_bfloat16* h, cudaStream_t stream);

// dst[c, r] = src[r, c] for a row-major src of [rows, cols] (rows / 64 <= 65535); bf16 -> bf16,
// fp32 -> bf16 (rounded to nearest) and fp32 -> fp32.
cudaError_t launch_transpose_bf16(const __nv_bfloat16* src, int64_t rows, int64_t cols, __nv_bfloat16* dst,
                                  cudaStream_t stream);
cudaError_t launch_transpose(const float* src, int64_t rows, int64_t cols, __nv_bfloat16* dst, cudaStream_t stream);
cudaError_t launch_transpose(const float* src, int64_t rows, int64_t cols, float* dst, cudaStream_t stream);

}  // namespace sparse_llm
