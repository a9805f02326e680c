// Gated up/down projection from TwELL for the light rows (heavy rows take the dense path), in two
// kernels that cut the weights into column slices so that a unit active in several rows of a block
// is fetched from L2 once and re-read from L1:
//
//   up:   h[e] = a[e] * (x[row_e] . wu[unit_e])   CTA = a block of R rows, loops over D slices
//   down: y[row, slice] = sum_e h[e] wd_t[unit_e, slice]   CTA = (block of R rows, one D slice)
//
// Each warp owns R / 8 rows of its block and lists their entries (unit, row, slot) in shared
// memory, ordered by TwELL tile, so the 8 warps of a CTA sweep the units in the same order and hit
// the same weight rows at about the same time. Per slice, each lane owns 8 consecutive columns
// (16-byte loads); 8 entries are gathered at once to keep loads in flight.
#include "twell.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 8;                 // bf16 per 16-byte access
constexpr int kSlice = 32 * kChunk;       // columns of one slice
constexpr int kMaxRowsPerWarp = 8;
constexpr int kEntryBudget = 4096;        // entries listed per CTA (bounds shared memory)
constexpr int kInFlight = 8;              // entries gathered at once per warp
constexpr int kUnitBits = 20;             // entry key = (row in block << kUnitBits) | unit
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&out)[kChunk]) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ float dot_bf16x8(const uint4& a, const uint4& b) {
  float fa[kChunk], fb[kChunk];
  bf16x8_to_float(a, fa);
  bf16x8_to_float(b, fb);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) s = fmaf(fa[i], fb[i], s);
  return s;
}

__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int n = __shfl_up_sync(kFullMask, v, off);
    if (lane >= off) v += n;
  }
  return v;
}

struct BlockRows {
  int64_t row0;      // first row of the CTA's block
  int rows_per_warp;
  __device__ int local(int warp, int i) const { return warp + kWarps * i; }
};

// Lists the entries of the warp's rows in tile order: key = (row in block << kUnitBits) | unit and
// the slot index relative to the block's first slot (at most rows_per_warp * max_row_nnz entries,
// since light rows hold <= max_row_nnz each). Returns the count (same value in every lane).
__device__ int list_warp_entries(const TwellView& tw, const uint8_t* __restrict__ heavy, int64_t rows,
                                 const BlockRows& blk, int warp, int lane, int* key, int* slot) {
  bool light[kMaxRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kMaxRowsPerWarp; ++i) {
    const int64_t row = blk.row0 + blk.local(warp, i);
    light[i] = i < blk.rows_per_warp && row < rows && heavy[row] == 0;
  }
  const int64_t slot_base = blk.row0 * tw.n_tiles * kTwellSlots;
  int written = 0;
  for (int t0 = 0; t0 < tw.n_tiles; t0 += 32) {
    const int t = t0 + lane;
    int count[kMaxRowsPerWarp];
    uint4 cols[kMaxRowsPerWarp];
    int in_tile = 0;
#pragma unroll
    for (int i = 0; i < kMaxRowsPerWarp; ++i) {
      const int64_t row = blk.row0 + blk.local(warp, i);
      count[i] = (light[i] && t < tw.n_tiles) ? tw.counts[row * tw.n_tiles + t] : 0;
      in_tile += count[i];
    }
#pragma unroll
    for (int i = 0; i < kMaxRowsPerWarp; ++i) {  // all 16 columns of the tile's slots in one load
      const int64_t row = blk.row0 + blk.local(warp, i);
      if (count[i] > 0) cols[i] = *reinterpret_cast<const uint4*>(tw.cols + (row * tw.n_tiles + t) * kTwellSlots);
    }
    const int incl = warp_inclusive_scan(in_tile, lane);
    int pos = written + incl - in_tile;
#pragma unroll
    for (int i = 0; i < kMaxRowsPerWarp; ++i) {
      const int64_t row = blk.row0 + blk.local(warp, i);
      const int rel = static_cast<int>((row * tw.n_tiles + t) * kTwellSlots - slot_base);
      for (int k = 0; k < count[i]; ++k, ++pos) {
        const unsigned word = k < 8 ? (k < 4 ? cols[i].x : cols[i].y) : (k < 12 ? cols[i].z : cols[i].w);
        const int col = (word >> (8 * (k & 3))) & 0xff;
        key[pos] = (blk.local(warp, i) << kUnitBits) | (t * kTwellTile + col);
        slot[pos] = rel + k;
      }
    }
    written += __shfl_sync(kFullMask, incl, 31);
  }
  return written;
}

__global__ void __launch_bounds__(kThreads)
    twell_up_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wu, TwellView tw,
                    const uint8_t* __restrict__ heavy, int64_t rows, int dim, int rows_per_warp, int warp_cap,
                    float* __restrict__ h_out) {
  extern __shared__ uint4 smem[];
  const int block_rows = kWarps * rows_per_warp;
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);                        // [block_rows][kSlice]
  int* keys = reinterpret_cast<int*>(xs + block_rows * kSlice);                      // [kWarps][warp_cap]
  int* slots = keys + kWarps * warp_cap;
  float* acc = reinterpret_cast<float*>(slots + kWarps * warp_cap);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const BlockRows blk{static_cast<int64_t>(blockIdx.x) * block_rows, rows_per_warp};
  int* my_keys = keys + warp * warp_cap;
  float* my_acc = acc + warp * warp_cap;
  const int len = list_warp_entries(tw, heavy, rows, blk, warp, lane, my_keys, slots + warp * warp_cap);
  for (int e = lane; e < len; e += 32) my_acc[e] = 0.0f;

  for (int s0 = 0; s0 < dim; s0 += kSlice) {
    const int width = min(kSlice, dim - s0);
    __syncthreads();  // the previous slice's xs reads are done
    for (int c = threadIdx.x; c < block_rows * (kSlice / kChunk); c += kThreads) {
      const int r = c / (kSlice / kChunk);
      const int v = c % (kSlice / kChunk);
      const int64_t row = blk.row0 + r;
      if (row < rows && heavy[row] == 0 && v * kChunk < width)
        reinterpret_cast<uint4*>(xs + r * kSlice)[v] = __ldg(reinterpret_cast<const uint4*>(x + row * dim + s0) + v);
    }
    __syncthreads();
    const bool active = lane * kChunk < width;
    for (int e0 = 0; e0 < len; e0 += kInFlight) {
      uint4 w[kInFlight];
      int key[kInFlight];
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        key[q] = e0 + q < len ? my_keys[e0 + q] : 0;
        const int unit = key[q] & ((1 << kUnitBits) - 1);
        w[q] = make_uint4(0u, 0u, 0u, 0u);
        if (active && e0 + q < len)
          w[q] = __ldg(reinterpret_cast<const uint4*>(wu + static_cast<int64_t>(unit) * dim + s0) + lane);
      }
      float part[kInFlight];
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        const int r = key[q] >> kUnitBits;
        part[q] = active ? dot_bf16x8(w[q], reinterpret_cast<const uint4*>(xs + r * kSlice)[lane]) : 0.0f;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int q = 0; q < kInFlight; ++q) part[q] += __shfl_xor_sync(kFullMask, part[q], off);
      }
#pragma unroll
      for (int q = 0; q < kInFlight; ++q)
        if (lane == q && e0 + q < len) my_acc[e0 + q] += part[q];
    }
  }
  __syncwarp();
  const int64_t slot_base = blk.row0 * tw.n_tiles * kTwellSlots;
  const int* my_slots = slots + warp * warp_cap;
  for (int e = lane; e < len; e += 32) {
    const int64_t s = slot_base + my_slots[e];
    h_out[s] = __bfloat162float(tw.values[s]) * my_acc[e];
  }
}

__global__ void __launch_bounds__(kThreads)
    twell_down_kernel(const __nv_bfloat16* __restrict__ wd_t, TwellView tw, const float* __restrict__ h_in,
                      const uint8_t* __restrict__ heavy, int64_t rows, int dim, int rows_per_warp, int warp_cap,
                      __nv_bfloat16* __restrict__ y) {
  extern __shared__ uint4 smem[];
  const int block_rows = kWarps * rows_per_warp;
  float* acc = reinterpret_cast<float*>(smem);                  // [block_rows][kSlice]
  int* keys = reinterpret_cast<int*>(acc + block_rows * kSlice);  // [kWarps][warp_cap]
  int* slots = keys + kWarps * warp_cap;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const BlockRows blk{static_cast<int64_t>(blockIdx.x) * block_rows, rows_per_warp};
  const int s0 = blockIdx.y * kSlice;
  const int width = min(kSlice, dim - s0);
  const bool active = lane * kChunk < width;
  int* my_keys = keys + warp * warp_cap;
  int* my_slots = slots + warp * warp_cap;
  const int len = list_warp_entries(tw, heavy, rows, blk, warp, lane, my_keys, my_slots);
  // The warp's own rows of acc: no other warp touches them, so no block barrier is needed.
  for (int i = 0; i < rows_per_warp; ++i) {
    float4* a = reinterpret_cast<float4*>(acc + blk.local(warp, i) * kSlice + lane * kChunk);
    a[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    a[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // h of the listed entries, overwriting their slot indices.
  const int64_t slot_base = blk.row0 * tw.n_tiles * kTwellSlots;
  for (int e = lane; e < len; e += 32) my_slots[e] = __float_as_int(h_in[slot_base + my_slots[e]]);
  __syncwarp();

  if (active) {
    for (int e0 = 0; e0 < len; e0 += kInFlight) {
      uint4 w[kInFlight];
      int key[kInFlight];
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        key[q] = e0 + q < len ? my_keys[e0 + q] : 0;
        const int unit = key[q] & ((1 << kUnitBits) - 1);
        w[q] = make_uint4(0u, 0u, 0u, 0u);
        if (e0 + q < len)
          w[q] = __ldg(reinterpret_cast<const uint4*>(wd_t + static_cast<int64_t>(unit) * dim + s0) + lane);
      }
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        if (e0 + q >= len) break;
        const float h = __int_as_float(my_slots[e0 + q]);
        float f[kChunk];
        bf16x8_to_float(w[q], f);
        float4* a = reinterpret_cast<float4*>(acc + (key[q] >> kUnitBits) * kSlice + lane * kChunk);
        float4 lo = a[0], hi = a[1];
        lo.x = fmaf(h, f[0], lo.x);
        lo.y = fmaf(h, f[1], lo.y);
        lo.z = fmaf(h, f[2], lo.z);
        lo.w = fmaf(h, f[3], lo.w);
        hi.x = fmaf(h, f[4], hi.x);
        hi.y = fmaf(h, f[5], hi.y);
        hi.z = fmaf(h, f[6], hi.z);
        hi.w = fmaf(h, f[7], hi.w);
        a[0] = lo;
        a[1] = hi;
      }
    }
    for (int i = 0; i < rows_per_warp; ++i) {
      const int r = blk.local(warp, i);
      const int64_t row = blk.row0 + r;
      if (row >= rows || heavy[row] != 0) continue;
      const float4* a = reinterpret_cast<const float4*>(acc + r * kSlice + lane * kChunk);
      const float4 lo = a[0], hi = a[1];
      uint4 out;
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
      o[0] = __floats2bfloat162_rn(lo.x, lo.y);
      o[1] = __floats2bfloat162_rn(lo.z, lo.w);
      o[2] = __floats2bfloat162_rn(hi.x, hi.y);
      o[3] = __floats2bfloat162_rn(hi.z, hi.w);
      reinterpret_cast<uint4*>(y + row * dim + s0)[lane] = out;
    }
  }
}

}  // namespace

cudaError_t launch_twell_updown(const __nv_bfloat16* x, const __nv_bfloat16* wu, const __nv_bfloat16* wd_t,
                                TwellView twell, const uint8_t* heavy, int64_t rows, int dim, int max_row_nnz,
                                float* h_work, __nv_bfloat16* y, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (dim % kChunk != 0 || dim > kMaxDim || max_row_nnz < 0 || max_row_nnz > kMaxLightRowNnz)
    return cudaErrorInvalidValue;
  if (twell.n_tiles * kTwellTile > (1 << kUnitBits)) return cudaErrorInvalidValue;
  // Fewer rows per warp when the per-row budget is large, so the entry lists fit shared memory.
  int rows_per_warp = kMaxRowsPerWarp;
  while (rows_per_warp > 1 && kWarps * rows_per_warp * max_row_nnz > kEntryBudget) rows_per_warp /= 2;
  const int warp_cap = rows_per_warp * (max_row_nnz > 0 ? max_row_nnz : 1);
  const int block_rows = kWarps * rows_per_warp;
  const int64_t blocks = (rows + block_rows - 1) / block_rows;
  const size_t list_bytes = static_cast<size_t>(kWarps) * warp_cap * sizeof(int);
  const size_t up_smem = static_cast<size_t>(block_rows) * kSlice * sizeof(__nv_bfloat16) + 3 * list_bytes;
  const size_t down_smem = static_cast<size_t>(block_rows) * kSlice * sizeof(float) + 2 * list_bytes;
  cudaError_t err = cudaFuncSetAttribute(twell_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(up_smem));
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(twell_down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(down_smem));
  if (err != cudaSuccess) return err;
  twell_up_kernel<<<static_cast<unsigned>(blocks), kThreads, up_smem, stream>>>(
      x, wu, twell, heavy, rows, dim, rows_per_warp, warp_cap, h_work);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>((dim + kSlice - 1) / kSlice));
  twell_down_kernel<<<grid, kThreads, down_smem, stream>>>(wd_t, twell, h_work, heavy, rows, dim, rows_per_warp,
                                                             warp_cap, y);
  return cudaGetLastError();
}

}  // namespace sparse_llm
