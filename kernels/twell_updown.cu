// Fused gated up/down projection from TwELL, for the light rows (heavy rows take the dense path).
//
// One CTA owns kRowsPerCta rows. (1) Each warp turns one row's TwELL tiles into a list of
// (unit, a) entries in shared memory and stages the row of x there. A row without entries is
// known from its one row_nnz word: its zeros are written right there, or it is left as it is when
// accumulating (at 99.99% sparsity that is nearly every row). (2) Warps share the block's
// entries: h = a * (x[r] . wu[unit]) with a 16-byte gather of the wu row and a warp reduction.
// (3) Every thread owns 8 output columns and accumulates y[r] += h * wd_t[unit] over the row's
// entries: one coalesced 16-byte gather per entry and thread, fp32 accumulation. With `accumulate`
// the row is then added into y (y <- bf16(y + bf16(sum)): the rounding of a separate add).
#include "twell.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kRowsPerCta = 8;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUpLoads = 8;                 // 16-byte wu loads in flight per lane
constexpr int kDownUnroll = 4;              // wd_t rows in flight per thread

__global__ void __launch_bounds__(kThreads)
    twell_updown_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wu,
                        const __nv_bfloat16* __restrict__ wd_t, TwellView tw,
                        const uint8_t* __restrict__ heavy, int64_t rows, int dim, int max_row_nnz,
                        bool accumulate, __nv_bfloat16* __restrict__ y) {
  extern __shared__ uint4 smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);                     // [R][dim]
  int* ent_unit = reinterpret_cast<int*>(xs + kRowsPerCta * dim);                 // [R][max_row_nnz]
  float* ent_h = reinterpret_cast<float*>(ent_unit + kRowsPerCta * max_row_nnz);  // [R][max_row_nnz]
  __shared__ int row_len[kRowsPerCta];  // entries of the row; -1: heavy, empty (done) or past the end

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta;
  const int vecs_per_row = dim / kChunk;

  // (1) entry lists and x rows
  for (int r = warp; r < kRowsPerCta; r += kWarps) {
    const int64_t row = row0 + r;
    const bool light = row < rows && heavy[row] == 0;
    if (!light) {
      if (lane == 0) row_len[r] = -1;
      continue;
    }
    if (tw.row_nnz[row] == 0) {  // nothing to gather: its zero row is written now and the row skipped after
      if (!accumulate) {
        uint4* out = reinterpret_cast<uint4*>(y + row * dim);
        for (int v = lane; v < vecs_per_row; v += 32) out[v] = make_uint4(0u, 0u, 0u, 0u);
      }
      if (lane == 0) row_len[r] = -1;
      continue;
    }
    int written = 0;
    for (int t0 = 0; t0 < tw.n_tiles; t0 += 32) {
      const int t = t0 + lane;
      const int count = t < tw.n_tiles ? tw.counts[row * tw.n_tiles + t] : 0;  // <= slots: light row
      const int incl = warp_inclusive_scan(count, lane);
      const int base = written + incl - count;
      const int64_t slot0 = (row * tw.n_tiles + t) * kTwellSlots;
      for (int k = 0; k < count; ++k) {
        ent_unit[r * max_row_nnz + base + k] = t * kTwellTile + tw.cols[slot0 + k];
        ent_h[r * max_row_nnz + base + k] = __bfloat162float(tw.values[slot0 + k]);
      }
      written += __shfl_sync(kFullMask, incl, 31);
    }
    if (lane == 0) row_len[r] = written;
    const uint4* src = reinterpret_cast<const uint4*>(x + row * dim);
    uint4* dst = reinterpret_cast<uint4*>(xs + r * dim);
    for (int v = lane; v < vecs_per_row; v += 32) dst[v] = src[v];
  }
  __syncthreads();

  // (2) h = a * (x . wu[unit]); the warps take the block's entries round robin.
  int flat = 0;
  for (int r = 0; r < kRowsPerCta; ++r) {
    const int len = row_len[r];
    if (len <= 0) continue;
    for (int e = (warp - flat % kWarps + kWarps) % kWarps; e < len; e += kWarps) {
      const int unit = ent_unit[r * max_row_nnz + e];
      const float acc = warp_dot_row<kUpLoads>(xs + r * dim, wu + static_cast<int64_t>(unit) * dim, dim, lane);
      if (lane == 0) ent_h[r * max_row_nnz + e] *= acc;
    }
    flat += len;
  }
  __syncthreads();

  // (3) y[r, cols] = sum_e h_e * wd_t[unit_e, cols]; 8 columns per thread.
  for (int r = 0; r < kRowsPerCta; ++r) {
    const int len = row_len[r];
    if (len < 0) continue;
    const int64_t row = row0 + r;
    const int* units = ent_unit + r * max_row_nnz;
    const float* hs = ent_h + r * max_row_nnz;
    for (int v = threadIdx.x; v < vecs_per_row; v += kThreads) {
      float acc[kChunk] = {};
      int e = 0;
      for (; e + kDownUnroll <= len; e += kDownUnroll) {
        uint4 w[kDownUnroll];
#pragma unroll
        for (int k = 0; k < kDownUnroll; ++k)
          w[k] = __ldg(reinterpret_cast<const uint4*>(wd_t + static_cast<int64_t>(units[e + k]) * dim) + v);
#pragma unroll
        for (int k = 0; k < kDownUnroll; ++k) {
          float f[kChunk];
          bf16x8_to_float(w[k], f);
          const float h = hs[e + k];
#pragma unroll
          for (int i = 0; i < kChunk; ++i) acc[i] = fmaf(h, f[i], acc[i]);
        }
      }
      for (; e < len; ++e) {
        float f[kChunk];
        bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(wd_t + static_cast<int64_t>(units[e]) * dim) + v), f);
        const float h = hs[e];
#pragma unroll
        for (int i = 0; i < kChunk; ++i) acc[i] = fmaf(h, f[i], acc[i]);
      }
      uint4* dst = reinterpret_cast<uint4*>(y + row * dim) + v;
      uint4 out;
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      if (accumulate) {
        const uint4 prev = *dst;
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&prev);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 a = __bfloat1622float2(p[i]), b = __bfloat1622float2(o[i]);
          o[i] = __floats2bfloat162_rn(a.x + b.x, a.y + b.y);
        }
      }
      *dst = out;
    }
  }
}

}  // namespace

cudaError_t launch_twell_updown(const __nv_bfloat16* x, const __nv_bfloat16* wu, const __nv_bfloat16* wd_t,
                                TwellView twell, const uint8_t* heavy, int64_t rows, int dim,
                                int max_row_nnz, bool accumulate, __nv_bfloat16* y, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (dim % kChunk != 0 || dim > kMaxDim || max_row_nnz < 0 || max_row_nnz > kMaxLightRowNnz)
    return cudaErrorInvalidValue;
  const int list_cap = max_row_nnz > 0 ? max_row_nnz : 1;
  const size_t smem = static_cast<size_t>(kRowsPerCta) * dim * sizeof(__nv_bfloat16) +
                      static_cast<size_t>(kRowsPerCta) * list_cap * (sizeof(int) + sizeof(float));
  cudaError_t err = cudaFuncSetAttribute(twell_updown_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const int64_t blocks = (rows + kRowsPerCta - 1) / kRowsPerCta;
  twell_updown_kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
      x, wu, wd_t, twell, heavy, rows, dim, list_cap, accumulate, y);
  return cudaGetLastError();
}

}  // namespace sparse_llm
