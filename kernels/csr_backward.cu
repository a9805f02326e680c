// Training backward from the CSR record: every gradient comes from the active entries only.
//
// Rows kernel (one CTA per block of rows, csr_rows.cuh, like the forward up/down): grad_y rows
// staged in shared memory; warps take the block's entries: dh = grad_y[r] . wd_t[unit] + L1 term, then
// dg = dh * u and du = dh * a (fp32, kept for the units kernel); then every thread owns 8 columns
// of dx[r] = sum_e dg_e wg[unit] + du_e wu[unit].
//
// Units kernels (one warp per unit and column slice; several for a unit with many entries): walk
// the unit's entries in column order and accumulate its rows of dWg, dWu (from x) and dWd^T (from
// grad_y) in registers, so every weight gradient row is written (or, after the heavy rows' GEMMs,
// added to) once, with no atomics: deterministic.
#include <algorithm>

#include "csr_rows.cuh"

namespace sparse_llm {
namespace {

constexpr int kDotLoads = 8;   // 16-byte wd_t loads in flight per lane
constexpr int kDxUnroll = 2;   // entries in flight per thread (two weight rows each)
// One warp per unit and 256-column slice: the CTAs running at once all work on the same slice
// (units vary fastest in the grid), so the slices of x and grad_y they gather rows from (16 MiB
// at 16384 tokens and D = 2048) stay in L2. 128 threads (1024 columns) was 7.6-8.4% slower at
// 65536 tokens on an H100, and 64 threads no faster (one-call A/B at 4fc1555; docs/kernels.md).
constexpr int kUnitThreads = 32;
constexpr int kUnitCols = kUnitThreads * kChunk;  // columns of one units-kernel CTA
constexpr int kUnitUnroll = 4;                    // entries in flight per thread
static_assert(kUnitThreads == 32, "the long-units kernel maps a warp's lanes onto one slice of kUnitCols");
__host__ __device__ inline int unit_slices(int dim) { return (dim + kUnitCols - 1) / kUnitCols; }
// Units with more entries than this take the long-units kernel: kLongUnitWarps warps share each
// (unit, slice), so a hot unit's chain of dependent gathers is that many times shorter.
constexpr int kLongUnit = 256;
constexpr int kLongUnitWarps = 8;
constexpr int kLongUnitCtas = 396;  // 3 resident a multiprocessor on an H100 (132); they loop over the pairs

__global__ void __launch_bounds__(kCsrRowThreads)
    csr_backward_rows_kernel(const __nv_bfloat16* __restrict__ grad_y, const __nv_bfloat16* __restrict__ wg,
                             const __nv_bfloat16* __restrict__ wu, const __nv_bfloat16* __restrict__ wd_t,
                             const int64_t* __restrict__ row_ptr, const int32_t* __restrict__ cols,
                             const __nv_bfloat16* __restrict__ a_vals, const __nv_bfloat16* __restrict__ u_vals,
                             const uint8_t* __restrict__ heavy, const float* __restrict__ grad_l1, int64_t rows,
                             int dim, float* dg, float* du, __nv_bfloat16* __restrict__ dx) {
  extern __shared__ uint4 smem[];
  __nv_bfloat16* gys = reinterpret_cast<__nv_bfloat16*>(smem);  // [kCsrRowsPerCta][dim]
  __shared__ int64_t ptr[kCsrRowsPerCta + 1];
  __shared__ bool skip[kCsrRowsPerCta];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kCsrRowsPerCta;
  const int n_rows = row_block_size(rows, row0);
  const int vecs = dim / kChunk;
  const float l1_scale = *grad_l1 / static_cast<float>(rows);  // d(l1)/d|h| = 1 / M
  load_row_block(row_ptr, heavy, grad_y, row0, n_rows, dim, ptr, skip, gys);

  for (int64_t e = ptr[0] + warp; e < ptr[n_rows]; e += kCsrRowWarps) {
    const int r = local_row(ptr, n_rows, e);
    if (skip[r]) continue;
    const float dot = warp_dot_row<kDotLoads>(gys + r * dim, wd_t + static_cast<int64_t>(cols[e]) * dim, dim, lane);
    if (lane == 0) {
      const float a = __bfloat162float(a_vals[e]);
      const float u = __bfloat162float(u_vals[e]);
      const float sign_h = u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : 0.0f);
      const float dh = dot + l1_scale * sign_h;
      dg[e] = dh * u;
      du[e] = dh * a;
    }
  }
  __syncthreads();  // dg, du of the block visible to all its threads (plain loads below)

  for (int r = 0; r < n_rows; ++r) {
    if (skip[r]) continue;
    const int64_t begin = ptr[r], end = ptr[r + 1];
    for (int v = threadIdx.x; v < vecs; v += kCsrRowThreads) {
      float acc[kChunk] = {};
      int64_t e = begin;
      for (; e + kDxUnroll <= end; e += kDxUnroll) {
        uint4 wgv[kDxUnroll], wuv[kDxUnroll];
#pragma unroll
        for (int k = 0; k < kDxUnroll; ++k) {
          const int64_t unit = cols[e + k];
          wgv[k] = __ldg(reinterpret_cast<const uint4*>(wg + unit * dim) + v);
          wuv[k] = __ldg(reinterpret_cast<const uint4*>(wu + unit * dim) + v);
        }
#pragma unroll
        for (int k = 0; k < kDxUnroll; ++k) {
          axpy_bf16x8(dg[e + k], wgv[k], acc);
          axpy_bf16x8(du[e + k], wuv[k], acc);
        }
      }
      for (; e < end; ++e) {
        const int64_t unit = cols[e];
        axpy_bf16x8(dg[e], __ldg(reinterpret_cast<const uint4*>(wg + unit * dim) + v), acc);
        axpy_bf16x8(du[e], __ldg(reinterpret_cast<const uint4*>(wu + unit * dim) + v), acc);
      }
      reinterpret_cast<uint4*>(dx + (row0 + r) * dim)[v] = float_to_bf16x8(acc);
    }
  }
}

// Adds to acc_* one unit's sums over its column-order entries [begin, end), for this thread's 8
// columns v of x and grad_y.
__device__ __forceinline__ void unit_range_sums(const __nv_bfloat16* __restrict__ x,
                                                const __nv_bfloat16* __restrict__ grad_y,
                                                const int32_t* __restrict__ csc_rows,
                                                const int32_t* __restrict__ csc_entry, const float* __restrict__ dg,
                                                const float* __restrict__ du, const __nv_bfloat16* __restrict__ a_vals,
                                                const __nv_bfloat16* __restrict__ u_vals, int64_t begin, int64_t end,
                                                int dim, int v, float (&acc_g)[kChunk], float (&acc_u)[kChunk],
                                                float (&acc_d)[kChunk]) {
  int64_t k = begin;
  for (; k + kUnitUnroll <= end; k += kUnitUnroll) {
    uint4 xv[kUnitUnroll], gv[kUnitUnroll];
    float cg[kUnitUnroll], cu[kUnitUnroll], ch[kUnitUnroll];
#pragma unroll
    for (int i = 0; i < kUnitUnroll; ++i) {
      const int64_t row = csc_rows[k + i];
      const int64_t e = csc_entry[k + i];
      xv[i] = __ldg(reinterpret_cast<const uint4*>(x + row * dim) + v);
      gv[i] = __ldg(reinterpret_cast<const uint4*>(grad_y + row * dim) + v);
      cg[i] = dg[e];
      cu[i] = du[e];
      ch[i] = __bfloat162float(a_vals[e]) * __bfloat162float(u_vals[e]);
    }
#pragma unroll
    for (int i = 0; i < kUnitUnroll; ++i) {
      float xf[kChunk];
      bf16x8_to_float(xv[i], xf);
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        acc_g[c] = fmaf(cg[i], xf[c], acc_g[c]);
        acc_u[c] = fmaf(cu[i], xf[c], acc_u[c]);
      }
      axpy_bf16x8(ch[i], gv[i], acc_d);
    }
  }
  for (; k < end; ++k) {
    const int64_t row = csc_rows[k];
    const int64_t e = csc_entry[k];
    float xf[kChunk];
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(x + row * dim) + v), xf);
    for (int c = 0; c < kChunk; ++c) {
      acc_g[c] = fmaf(dg[e], xf[c], acc_g[c]);
      acc_u[c] = fmaf(du[e], xf[c], acc_u[c]);
    }
    const float h = __bfloat162float(a_vals[e]) * __bfloat162float(u_vals[e]);
    axpy_bf16x8(h, __ldg(reinterpret_cast<const uint4*>(grad_y + row * dim) + v), acc_d);
  }
}

// Writes (or, with accumulate, adds) one unit's three gradient rows at this thread's 8 columns v.
template <typename Grad>
__device__ __forceinline__ void write_unit_rows(int64_t unit, int dim, int v, bool accumulate,
                                                const float (&acc_g)[kChunk], const float (&acc_u)[kChunk],
                                                const float (&acc_d)[kChunk], Grad* dwg, Grad* dwu, Grad* dwd_t) {
  if (accumulate) {
    add8(dwg + unit * dim, v, acc_g);
    add8(dwu + unit * dim, v, acc_u);
    add8(dwd_t + unit * dim, v, acc_d);
  } else {
    store8(dwg + unit * dim, v, acc_g);
    store8(dwu + unit * dim, v, acc_u);
    store8(dwd_t + unit * dim, v, acc_d);
  }
}

// Units with at most kLongUnit entries: one warp per unit and column slice. A longer unit is
// appended to long_units (for the kernel below) by its first slice's CTA and skipped here. One warp
// walking a hot unit's entries in sequence (up to 2,500 at 30 non-zeros per token on the standard
// workload, M = 16384), one dependent gather after another, had set the kernel's time: 490 us on an
// H100, against 250 + 77 us for the two kernels.
template <typename Grad>  // the weight gradients' dtype: bf16 or float
__global__ void __launch_bounds__(kUnitThreads)
    csr_backward_units_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ grad_y,
                              const int64_t* __restrict__ unit_ptr, const int32_t* __restrict__ csc_rows,
                              const int32_t* __restrict__ csc_entry, const float* __restrict__ dg,
                              const float* __restrict__ du, const __nv_bfloat16* __restrict__ a_vals,
                              const __nv_bfloat16* __restrict__ u_vals, int dim, bool accumulate,
                              const int32_t* __restrict__ dense_slot, int32_t* __restrict__ long_units,
                              int32_t* __restrict__ n_long, Grad* __restrict__ dwg, Grad* __restrict__ dwu,
                              Grad* __restrict__ dwd_t) {
  const int64_t unit = blockIdx.x;
  if (dense_slot != nullptr && dense_slot[unit] >= 0) return;  // a dense unit: GEMMs write its rows
  const int v = blockIdx.y * kUnitThreads + threadIdx.x;  // this thread's 8 columns
  const int64_t begin = unit_ptr[unit], end = unit_ptr[unit + 1];
  if (end - begin > kLongUnit) {
    if (blockIdx.y == 0 && threadIdx.x == 0) long_units[atomicAdd(n_long, 1)] = static_cast<int32_t>(unit);
    return;
  }
  if (v * kChunk >= dim) return;
  if (accumulate && begin == end) return;  // the row holds the heavy rows' share already
  float acc_g[kChunk] = {}, acc_u[kChunk] = {}, acc_d[kChunk] = {};
  unit_range_sums(x, grad_y, csc_rows, csc_entry, dg, du, a_vals, u_vals, begin, end, dim, v, acc_g, acc_u, acc_d);
  write_unit_rows(unit, dim, v, accumulate, acc_g, acc_u, acc_d, dwg, dwu, dwd_t);
}

// Units with more than kLongUnit entries (the list the kernel above made): kLongUnitWarps warps per
// unit and column slice, each over a fixed share of the entries, their sums added in warp order
// (deterministic, whatever order the list is in). The CTAs loop over (slice, unit) pairs slice by
// slice, so that those running at once gather from one slice of x and grad_y, as above.
template <typename Grad>
__global__ void __launch_bounds__(kLongUnitWarps * 32, 3)
    csr_backward_long_units_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ grad_y,
                                   const int64_t* __restrict__ unit_ptr, const int32_t* __restrict__ csc_rows,
                                   const int32_t* __restrict__ csc_entry, const float* __restrict__ dg,
                                   const float* __restrict__ du, const __nv_bfloat16* __restrict__ a_vals,
                                   const __nv_bfloat16* __restrict__ u_vals, int dim, bool accumulate,
                                   const int32_t* __restrict__ long_units, const int32_t* __restrict__ n_long,
                                   Grad* __restrict__ dwg, Grad* __restrict__ dwu, Grad* __restrict__ dwd_t) {
  // [warp][3 * kChunk][lane]: lane-minor, so a warp's stores and loads hit 32 banks.
  __shared__ float sums[kLongUnitWarps][3 * kChunk][32];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int count = *n_long;
  const int64_t pairs = static_cast<int64_t>(count) * unit_slices(dim);
  for (int64_t i = blockIdx.x; i < pairs; i += gridDim.x) {
    const int64_t unit = long_units[i % count];
    const int v = static_cast<int>(i / count) * kUnitThreads + lane;  // this thread's 8 columns
    const bool in_dim = v * kChunk < dim;
    const int64_t begin = unit_ptr[unit], len = unit_ptr[unit + 1] - begin;
    float acc[3][kChunk] = {};
    if (in_dim)
      unit_range_sums(x, grad_y, csc_rows, csc_entry, dg, du, a_vals, u_vals, begin + len * warp / kLongUnitWarps,
                      begin + len * (warp + 1) / kLongUnitWarps, dim, v, acc[0], acc[1], acc[2]);
#pragma unroll
    for (int j = 0; j < 3; ++j)
#pragma unroll
      for (int c = 0; c < kChunk; ++c) sums[warp][j * kChunk + c][lane] = acc[j][c];
    __syncthreads();
    if (warp == 0 && in_dim) {
#pragma unroll
      for (int j = 0; j < 3; ++j)
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
          float s = sums[0][j * kChunk + c][lane];
          for (int w = 1; w < kLongUnitWarps; ++w) s += sums[w][j * kChunk + c][lane];
          acc[j][c] = s;
        }
      write_unit_rows(unit, dim, v, accumulate, acc[0], acc[1], acc[2], dwg, dwu, dwd_t);
    }
    __syncthreads();  // sums free for the next unit
  }
}

template <typename Grad>
cudaError_t launch_units(const __nv_bfloat16* x, const __nv_bfloat16* grad_y, const int64_t* unit_ptr,
                         const int32_t* csc_rows, const int32_t* csc_entry, const float* dg, const float* du,
                         const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals, int hidden, int dim, int64_t total,
                         bool accumulate, const int32_t* dense_slot, int32_t* long_scratch, Grad* dwg, Grad* dwu,
                         Grad* dwd_t, cudaStream_t stream) {
  if (hidden == 0) return cudaSuccess;
  if (dim % kChunk != 0 || dim > kMaxTrainDim) return cudaErrorInvalidValue;
  int32_t* n_long = long_scratch + hidden;
  cudaError_t err = cudaMemsetAsync(n_long, 0, sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(hidden), static_cast<unsigned>(unit_slices(dim)));
  csr_backward_units_kernel<Grad><<<grid, kUnitThreads, 0, stream>>>(
      x, grad_y, unit_ptr, csc_rows, csc_entry, dg, du, a_vals, u_vals, dim, accumulate, dense_slot, long_scratch,
      n_long, dwg, dwu, dwd_t);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // At most total / (kLongUnit + 1) units are long; the list's length is read on the device.
  const int64_t max_long = std::min<int64_t>(hidden, total / (kLongUnit + 1));
  if (max_long == 0) return cudaSuccess;
  const int64_t max_pairs = max_long * unit_slices(dim);
  const unsigned ctas = static_cast<unsigned>(std::min<int64_t>(max_pairs, kLongUnitCtas));
  csr_backward_long_units_kernel<Grad><<<ctas, kLongUnitWarps * 32, 0, stream>>>(
      x, grad_y, unit_ptr, csc_rows, csc_entry, dg, du, a_vals, u_vals, dim, accumulate, long_scratch, n_long, dwg,
      dwu, dwd_t);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_csr_backward_rows(const __nv_bfloat16* grad_y, const __nv_bfloat16* wg, const __nv_bfloat16* wu,
                                     const __nv_bfloat16* wd_t, const int64_t* row_ptr, const int32_t* cols,
                                     const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                     const uint8_t* heavy, const float* grad_l1, int64_t rows, int dim,
                                     float* dg, float* du, __nv_bfloat16* dx, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (dim % kChunk != 0 || dim > kMaxTrainDim) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(kCsrRowsPerCta) * dim * sizeof(__nv_bfloat16);
  cudaError_t err = cudaFuncSetAttribute(csr_backward_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t blocks = csr_row_blocks(rows);
  csr_backward_rows_kernel<<<static_cast<unsigned>(blocks), kCsrRowThreads, smem, stream>>>(
      grad_y, wg, wu, wd_t, row_ptr, cols, a_vals, u_vals, heavy, grad_l1, rows, dim, dg, du, dx);
  return cudaGetLastError();
}

cudaError_t launch_csr_backward_units(const __nv_bfloat16* x, const __nv_bfloat16* grad_y, const int64_t* unit_ptr,
                                      const int32_t* csc_rows, const int32_t* csc_entry, const float* dg,
                                      const float* du, const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                      int hidden, int dim, int64_t total, bool accumulate, const int32_t* dense_slot,
                                      int32_t* long_scratch, __nv_bfloat16* dwg, __nv_bfloat16* dwu,
                                      __nv_bfloat16* dwd_t, cudaStream_t stream) {
  return launch_units(x, grad_y, unit_ptr, csc_rows, csc_entry, dg, du, a_vals, u_vals, hidden, dim, total, accumulate,
                      dense_slot, long_scratch, dwg, dwu, dwd_t, stream);
}

cudaError_t launch_csr_backward_units(const __nv_bfloat16* x, const __nv_bfloat16* grad_y, const int64_t* unit_ptr,
                                      const int32_t* csc_rows, const int32_t* csc_entry, const float* dg,
                                      const float* du, const __nv_bfloat16* a_vals, const __nv_bfloat16* u_vals,
                                      int hidden, int dim, int64_t total, bool accumulate, const int32_t* dense_slot,
                                      int32_t* long_scratch, float* dwg, float* dwu, float* dwd_t,
                                      cudaStream_t stream) {
  return launch_units(x, grad_y, unit_ptr, csc_rows, csc_entry, dg, du, a_vals, u_vals, hidden, dim, total, accumulate,
                      dense_slot, long_scratch, dwg, dwu, dwd_t, stream);
}

}  // namespace sparse_llm
