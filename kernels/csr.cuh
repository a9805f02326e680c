// The training kernels' compact records of a = relu(g) and the launchers of the training forward
// and backward. Plain CUDA C++ (no torch headers).
//
// Rows with more active units than a threshold are heavy (a dense path of GEMMs on the gathered
// rows owns them), the others light. Each kind has its own record, in CSR order over all M rows
// (the other kind's rows empty), for g: [M, H] bf16 and row_ptr = exclusive prefix sum of that
// kind's per-row counts:
//   cols   [nnz] int32  unit of each active entry, ascending within a row
//   a_vals [nnz] bf16   a = relu(g) > 0 at that entry
//   u_vals [nnz] bf16   u = x . Wu[unit] at that entry
// and h = float(a) * float(u) wherever h is needed, so forward and backward see the same h.
// Light rows hold at most `threshold` entries each, so their record's capacity is known before
// the counts are read; there is no capacity anywhere that could drop an entry.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace sparse_llm {

// Largest D the row kernels stage in shared memory (a block of rows of x or grad_y).
constexpr int kMaxTrainDim = 8192;

// The split of the rows by their counts nnz[M] (int64), written by launch_csr_split_rows. Outputs marked
// optional may be null.
struct RowSplitView {
  uint8_t* heavy;        // [M]: the row is heavy
  int64_t* light_ptr;    // [M + 1]: exclusive prefix sum of the light rows' nnz (the light record's row offsets)
  int64_t* heavy_ptr;    // [M + 1]: the same over the heavy rows' counts
  int64_t* heavy_rows;   // optional [M]: the heavy rows in order, then unspecified
  int64_t* active_rows;  // optional [M]: the rows with nnz > 0 in order, then unspecified
  int64_t* sizes;        // optional [4]: light entries, heavy rows, heavy entries, active rows
};

// Heavy rows: nnz[r] > threshold where heavy_list is null, else the n_heavy_list rows of heavy_list
// (ascending). tile_scratch: csr_split_tiles(M) * 4 int64 of device memory.
int64_t csr_split_tiles(int64_t rows);
cudaError_t launch_csr_split_rows(const int64_t* nnz, int64_t rows, int64_t threshold, const int64_t* heavy_list,
                                  int64_t n_heavy_list, int64_t* tile_scratch, RowSplitView out,
                                  cudaStream_t stream);

// nnz[r] = number of g[r, :] > 0; the first min(nnz[r], stage_width) active entries of row r (units
// ascending) staged at stage_cols/stage_a[r * stage_width ...] ([M * stage_width]: all of a light
// row's when stage_width is the heavy-row threshold); every active unit added to fire_counts[H]
// (int32, zeroed by the caller). g: [M, H] bf16 row-major, H % 8 == 0, 16-byte aligned.
cudaError_t launch_csr_count(const __nv_bfloat16* g, int64_t rows, int hidden, int stage_width, int64_t* nnz,
                             int32_t* stage_cols, __nv_bfloat16* stage_a, int32_t* fire_counts, cudaStream_t stream);

// One kind's record, cols and a_vals at row_ptr[r] ... row_ptr[r + 1] (the split's light_ptr or
// heavy_ptr: the other kind's rows are empty there): the light rows' from the stage of
// launch_csr_count (each entry added to light_fires[H] where given: int32, zeroed by the caller),
// the heavy rows' from g.
cudaError_t launch_csr_fill_light(const int32_t* stage_cols, const __nv_bfloat16* stage_a, int stage_width,
                                  int64_t rows, const int64_t* row_ptr, int32_t* cols, __nv_bfloat16* a_vals,
                                  int32_t* light_fires, cudaStream_t stream);
// The heavy rows' entries past `capacity` (the record's length) are not written.
cudaError_t launch_csr_fill_heavy(const __nv_bfloat16* g, int64_t rows, int hidden, const int64_t* row_ptr,
                                  int32_t* cols, __nv_bfloat16* a_vals, cudaStream_t stream,
                                  int64_t capacity = INT64_MAX);

// Heavy rows (heavy[r] != 0: more active units than the sparse path's threshold) take a dense
// path of GEMMs on the gathered rows; the row kernels below skip them (their outputs untouched).

// Training forward after the pack, light rows: u_vals[e] = bf16(x[r] . wu[cols[e]]) for every entry
// e of row r, then y[r] = sum_e a_e * u_e * wd_t[cols[e]] (fp32 accumulation). x, y: [M, D]; wu,
// wd_t: [H, D] (wd_t is down_proj.weight transposed); D % 8 == 0, D <= kMaxTrainDim.
// Each CTA also writes l1_partial[b] = its sum of |bf16(a_e u_e)| (u_e as stored; h rounded as the
// dense path's bf16 h is), for b < csr_updown_blocks(M); launch_csr_l1_finish then sets *l1 =
// scale * their sum (fixed order).
cudaError_t launch_csr_updown(const __nv_bfloat16* x, const __nv_bfloat16* wu, const __nv_bfloat16* wd_t,
                              const int64_t* row_ptr, const int32_t* cols, const __nv_bfloat16* a_vals,
                              const uint8_t* heavy, int64_t rows, int dim, __nv_bfloat16* u_vals,
                              __nv_bfloat16* y, float* l1_partial, cudaStream_t stream);
int64_t csr_updown_blocks(int64_t rows);
cudaError_t launch_csr_l1_finish(const float* l1_partial, int64_t n, float scale, float* l1, cudaStream_t stream);

// vals[e] = dense[i, cols[e]] for the entries e < capacity of row list[i], i < n (and i < *count where
// count, on the device, is given; dense: [n, H] bf16).
cudaError_t launch_csr_gather_rows(const __nv_bfloat16* dense, const int64_t* list, int64_t n, int hidden,
                                   const int64_t* row_ptr, const int32_t* cols, __nv_bfloat16* vals,
                                   cudaStream_t stream, const int64_t* count = nullptr,
                                   int64_t capacity = INT64_MAX);

// a_dense[i, cols[e]] = a_vals[e], u_dense[i, cols[e]] = u_vals[e] for the entries of row list[i]
// (a_dense, u_dense: [n, H] bf16, zeroed by the caller).
cudaError_t launch_csr_scatter_rows(const int64_t* list, int64_t n, int hidden, const int64_t* row_ptr,
                                    const int32_t* cols, const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                    __nv_bfloat16* a_dense, __nv_bfloat16* u_dense, cudaStream_t stream);

// The heavy rows' backward between its GEMMs, in place on [n, H] bf16 blocks: given dh = grad_y Wd
// and the rows' a and u (zero off the active entries), dh <- dg = (dh + (*grad_l1 / M) sign(u)) * u,
// a <- du = (...) * a, u <- h = a * u. H % 8 == 0.
cudaError_t launch_heavy_backward_elementwise(int64_t n, int hidden, const float* grad_l1, int64_t rows,
                                              __nv_bfloat16* dh, __nv_bfloat16* a, __nv_bfloat16* u,
                                              cudaStream_t stream);

// The dense units (kernels/csr_dense_units.cu): units[0, *count) = the units with fire_counts[H]
// (int32: the light rows' fires) >= min_fires (none where min_fires is 0), ascending; one CTA (units: H int32 of device memory).
cudaError_t launch_select_dense_units(const int32_t* fire_counts, int hidden, int64_t min_fires, int32_t* units,
                                      int64_t* count, cudaStream_t stream);
// slot[units[i]] = i for i < n, -1 for every other of the H units.
cudaError_t launch_dense_unit_slots(const int32_t* units, int64_t n, int hidden, int32_t* slot, cudaStream_t stream);
// For every entry e of the light record (row_ptr [M + 1]) whose unit has a slot in the chunk
// [first, first + count) (slot [H]: -1 off the dense units), s = its slot - first, at row r of block
// [M, 3 * width] bf16 (count <= width; zeroed by the caller): dg_e at column s, du_e at width + s and
// h_e = a_e u_e at 2 * width + s (dg, du: the rows kernel's float32 per entry).
cudaError_t launch_scatter_dense_units(const int64_t* row_ptr, int64_t rows, const int32_t* cols, const float* dg,
                                       const float* du, const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                       const int32_t* slot, int64_t first, int64_t count, int width,
                                       __nv_bfloat16* block, cudaStream_t stream);
// grad_*[units[i]] = (or, with accumulate, +=) rows i of gu [2 * width, D] (dWg's rows, then dWu's at
// width + i) and of d [width, D] (dWd^T's), float32, for i < n: a float32 gradient rounded once, a bf16
// one as the per-unit kernels round theirs (the heavy rows' bf16 share, then the sum). `units`: the
// forward's list (distinct, each < H; not checked).
cudaError_t launch_put_dense_unit_rows(const int32_t* units, int64_t n, int width, int dim, const float* gu,
                                       const float* d, bool accumulate, __nv_bfloat16* dwg, __nv_bfloat16* dwu,
                                       __nv_bfloat16* dwd_t, cudaStream_t stream);
cudaError_t launch_put_dense_unit_rows(const int32_t* units, int64_t n, int width, int dim, const float* gu,
                                       const float* d, bool accumulate, float* dwg, float* dwu, float* dwd_t,
                                       cudaStream_t stream);

// Backward, per light row: dh_e = grad_y[r] . wd_t[cols[e]] + (*grad_l1 / M) * sign(u_e) (the L1 term:
// sign(h) = sign(u) since a > 0), dg_e = dh_e * u_e, du_e = dh_e * a_e (fp32, one per entry), and
// dx[r] = sum_e dg_e * wg[cols[e]] + du_e * wu[cols[e]]. grad_l1: one float on the device.
cudaError_t launch_csr_backward_rows(const __nv_bfloat16* grad_y, const __nv_bfloat16* wg, const __nv_bfloat16* wu,
                                     const __nv_bfloat16* wd_t, const int64_t* row_ptr, const int32_t* cols,
                                     const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                     const uint8_t* heavy, const float* grad_l1, int64_t rows, int dim,
                                     float* dg, float* du, __nv_bfloat16* dx, cudaStream_t stream);

// The column order the per-unit kernel reads, from the light record (row_ptr [M + 1], cols):
// unit_ptr [H + 1] (int64) each unit's range, csc_entry [total] the record's entries by unit,
// ascending within a unit (a stable counting sort), csc_rows [total] their rows. Scratch sized by
// csr_column_order_scratch: counts and offsets (count_ints int32 each) and scan_bytes for the scan.
// H <= kMaxColumnSortHidden (a shared-memory histogram), total < 2^31.
constexpr int kMaxColumnSortHidden = 49152;
struct ColumnOrderScratch {
  int64_t blocks;      // CTAs over the entries
  int64_t count_ints;  // H * blocks
  int64_t scan_bytes;  // CUB's scan temporary storage
};
ColumnOrderScratch csr_column_order_scratch(int64_t total, int hidden);
cudaError_t launch_csr_column_order(const int64_t* row_ptr, int64_t rows, const int32_t* cols, int64_t total,
                                    int hidden, ColumnOrderScratch scratch, int32_t* counts, int32_t* offsets,
                                    void* scan_temp, int64_t* unit_ptr, int32_t* csc_rows, int32_t* csc_entry,
                                    cudaStream_t stream);

// Backward, per unit j, over its light-row entries in column order (unit_ptr [H + 1]; for the k-th
// entry of the unit, csc_rows[k] is its row and csc_entry[k] its index in the CSR record):
//   dwg[j] = sum dg_e x[r],  dwu[j] = sum du_e x[r],  dwd_t[j] = sum a_e u_e grad_y[r].
// Units with no entries get zero rows; with `accumulate`, the sums are added to the rows instead
// (rounded once) and units with no entries are left as they are. x, grad_y: [M, D]; dwg, dwu,
// dwd_t: [H, D], bf16 or float (fp32 accumulation either way; a float gradient is rounded once,
// where the master weights are). total: the record's entries (unit_ptr[H]); long_scratch: H + 1
// int32 of device memory (the list of units with many entries, which take more warps each).
// dense_slot (optional, [H] int32): units with a slot (>= 0) are skipped, their rows untouched.
cudaError_t launch_csr_backward_units(const __nv_bfloat16* x, const __nv_bfloat16* grad_y, const int64_t* unit_ptr,
                                      const int32_t* csc_rows, const int32_t* csc_entry, const float* dg,
                                      const float* du, const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                      int hidden, int dim, int64_t total, bool accumulate, const int32_t* dense_slot,
                                      int32_t* long_scratch, __nv_bfloat16* dwg, __nv_bfloat16* dwu,
                                      __nv_bfloat16* dwd_t, cudaStream_t stream);
cudaError_t launch_csr_backward_units(const __nv_bfloat16* x, const __nv_bfloat16* grad_y, const int64_t* unit_ptr,
                                      const int32_t* csc_rows, const int32_t* csc_entry, const float* dg,
                                      const float* du, const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                      int hidden, int dim, int64_t total, bool accumulate, const int32_t* dense_slot,
                                      int32_t* long_scratch, float* dwg, float* dwu, float* dwd_t,
                                      cudaStream_t stream);

// The capacity path's heavy rows (kernels/heavy_capacity.cu), the count on the device:
// h[i, :] = bf16(relu(g[list[i], :]) * u[i, :]) for i < min(*count, n), zero up to n, and
// partial[b] = CTA b's sum of |h| (h as stored; blocks CTAs); g: [M, H], u, h: [n, H].
cudaError_t launch_gate_mul_rows_l1(const __nv_bfloat16* g, const int64_t* list, const int64_t* count, int64_t n,
                                    int hidden, const __nv_bfloat16* u, __nv_bfloat16* h, float* partial,
                                    int blocks, cudaStream_t stream);
// The rows list[first .. *count) that the GEMMs did not take: y[row] = sum over the row's active
// units of bf16(relu(g) * bf16(x . wu[unit])) * wd_t[unit] (fp32, rounded once), straight from g;
// partial[b] = CTA b's sum of |h| (h as the dense path rounds it; blocks CTAs, each writing its slot
// even with no row).
cudaError_t launch_heavy_overflow_updown(const __nv_bfloat16* x, const __nv_bfloat16* g, const __nv_bfloat16* wu,
                                         const __nv_bfloat16* wd_t, const int64_t* list, const int64_t* count,
                                         int64_t first, int dim, int hidden, __nv_bfloat16* y, float* partial,
                                         int blocks, cudaStream_t stream);

}  // namespace sparse_llm
