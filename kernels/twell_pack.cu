// Pack relu(g) into TwELL: one warp per row, 4 columns per lane per tile, a warp scan places the
// non-zeros of each tile; four tiles are loaded at once to keep enough bytes in flight.
#include "twell.cuh"

namespace sparse_llm {
namespace {

constexpr int kPackWarps = 8;
constexpr int kTilesInFlight = 4;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int n = __shfl_up_sync(kFullMask, v, off);
    if (lane >= off) v += n;
  }
  return v;
}

__global__ void __launch_bounds__(kPackWarps * 32)
    twell_pack_kernel(const __nv_bfloat16* __restrict__ g, int64_t rows, int hidden, int n_tiles,
                      int heavy_threshold, __nv_bfloat16* __restrict__ values, uint8_t* __restrict__ cols,
                      int32_t* __restrict__ counts, int32_t* __restrict__ row_nnz,
                      uint8_t* __restrict__ heavy) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kPackWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const __nv_bfloat16* g_row = g + row * hidden;
  int total = 0;
  int max_tile = 0;

  for (int t0 = 0; t0 < n_tiles; t0 += kTilesInFlight) {
    uint2 raw[kTilesInFlight];
#pragma unroll
    for (int k = 0; k < kTilesInFlight; ++k) {
      const int col = (t0 + k) * kTwellTile + lane * 4;
      raw[k] = make_uint2(0u, 0u);  // padding columns read as zero: never a non-zero
      if (t0 + k < n_tiles && col < hidden) raw[k] = __ldcs(reinterpret_cast<const uint2*>(g_row + col));
    }
#pragma unroll
    for (int k = 0; k < kTilesInFlight; ++k) {
      const int t = t0 + k;
      if (t >= n_tiles) break;
      __nv_bfloat16 v[4];
      __nv_bfloat162 lo = *reinterpret_cast<__nv_bfloat162*>(&raw[k].x);
      __nv_bfloat162 hi = *reinterpret_cast<__nv_bfloat162*>(&raw[k].y);
      v[0] = lo.x;
      v[1] = lo.y;
      v[2] = hi.x;
      v[3] = hi.y;
      int mask = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) mask |= (__bfloat162float(v[i]) > 0.0f) << i;
      const int mine = __popc(mask);
      const int incl = warp_inclusive_scan(mine, lane);
      const int tile_count = __shfl_sync(kFullMask, incl, 31);
      int pos = incl - mine;
      const int64_t slot0 = (row * n_tiles + t) * kTwellSlots;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if ((mask >> i) & 1) {
          if (pos < kTwellSlots) {
            values[slot0 + pos] = v[i];
            cols[slot0 + pos] = static_cast<uint8_t>(lane * 4 + i);
          }
          ++pos;
        }
      }
      if (lane == 0) counts[row * n_tiles + t] = tile_count;
      total += tile_count;
      max_tile = max(max_tile, tile_count);
    }
  }
  if (lane == 0) {
    row_nnz[row] = total;
    heavy[row] = (total > heavy_threshold || max_tile > kTwellSlots) ? 1 : 0;
  }
}

}  // namespace

cudaError_t launch_twell_pack(const __nv_bfloat16* g, int64_t rows, int hidden, int heavy_threshold,
                              __nv_bfloat16* values, uint8_t* cols, int32_t* counts, int32_t* row_nnz,
                              uint8_t* heavy, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kPackWarps - 1) / kPackWarps;
  twell_pack_kernel<<<static_cast<unsigned>(blocks), kPackWarps * 32, 0, stream>>>(
      g, rows, hidden, twell_n_tiles(hidden), heavy_threshold, values, cols, counts, row_nnz, heavy);
  return cudaGetLastError();
}

}  // namespace sparse_llm
