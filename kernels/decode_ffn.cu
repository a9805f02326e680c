// The decode FFN (decode_ffn.cuh), with no host read, so a decode step can be captured in a CUDA
// graph. One row: one launch (decode_ffn_kernel, below). 2 rows: the gate GEMV with the
// compaction, then up/down. More rows: cuBLAS's gate, the compaction, then up/down. An explicit
// `splits` (the binding's tuning knob) runs up/down as its own launch at any row count.
//   gate     one CTA per segment of 32 units; each warp streams 4 rows of Wg (16-byte loads) and
//            dots them with every input row; the segment's active units are then compacted with
//            one ballot per row. The bytes read are Wg's, once, whatever the number of rows.
//   up/down  `splits` CTAs per row share the row's active units, a warp per unit: the dot of x with
//            Wu[j], then relu(g_j) * u_j times the row Wd^T[j] added into the warp's registers
//            (the row's whole output, dim / 32 values a lane). Only active rows of Wu and Wd^T are
//            read. g, u and h are rounded to bf16 where the dense path rounds them. The warps' sums
//            are added in a fixed tree, the CTAs' in split order: the result depends on the inputs
//            only.
//            The row's last CTA to finish (an arrival counter) adds the partial sums into out,
//            rounded as a separate add would be.
#include <algorithm>

#include "decode_ffn.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;  // compaction, up/down
constexpr int kWarps = kThreads / 32;
// The gate: a CTA per segment, 8 warps of 4 units, each lane with 4 16-byte loads of each unit
// (16 in all) in flight; few enough registers for two CTAs an SM, so the 176 CTAs of H = 5632 are
// resident together on 132 SMs.
constexpr int kGateThreads = 256;
constexpr int kGateWarps = kGateThreads / 32;
constexpr int kUnitsPerWarp = kDecodeSegUnits / kGateWarps;
constexpr int kGateLoads = 4;  // 16-byte loads of each unit a lane has in flight

// Row m's active units of segment seg (one warp; lane l holds unit seg * 32 + l's gate value).
__device__ __forceinline__ void compact_segment(int m, int seg, int n_seg, int lane, float gate, bool in_range,
                                                int32_t* seg_count, int32_t* seg_unit, float* seg_gate) {
  const bool active = in_range && gate > 0.0f;
  const unsigned mask = __ballot_sync(kFullMask, active);
  const int64_t record = static_cast<int64_t>(m) * n_seg + seg;
  if (active) {
    const int slot = __popc(mask & ((1u << lane) - 1u));
    seg_unit[record * kDecodeSegUnits + slot] = seg * kDecodeSegUnits + lane;
    seg_gate[record * kDecodeSegUnits + slot] = gate;
  }
  if (lane == 0) seg_count[record] = __popc(mask);
}

// offsets[s] = where segment s's units start in a row's list, offsets[n_seg] = the row's total,
// from the row's counts (written by another CTA or launch: read through L2), in shared memory
// (n_seg + 1 ints). Called by the whole CTA; ends with a barrier.
__device__ __forceinline__ void segment_offsets(const int32_t* __restrict__ counts, int n_seg, int* offsets) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int s = threadIdx.x; s < n_seg; s += blockDim.x)  // the counts in one coalesced pass,
    offsets[s + 1] = __ldcg(counts + s);
  __syncthreads();
  if (warp == 0) {  // then their inclusive prefix in place, from shared memory
    int carry = 0;
    for (int base = 0; base < n_seg; base += 32) {
      const int s = base + lane;
      const int inclusive = warp_inclusive_scan(s < n_seg ? offsets[s + 1] : 0, lane);
      if (s < n_seg) offsets[s + 1] = carry + inclusive;
      carry += __shfl_sync(kFullMask, inclusive, 31);
    }
    if (lane == 0) offsets[0] = 0;
  }
  __syncthreads();
}

// The segment holding list entry k: the last s with offsets[s] <= k.
__device__ __forceinline__ int segment_of(const int* offsets, int n_seg, int k) {
  int lo = 0, hi = n_seg;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= k) lo = mid; else hi = mid;
  }
  return lo;
}

// The gate of segment `seg` (kDecodeSegUnits units) for every row, rounded to bf16 as the dense
// path's gate GEMM output is (so the same units fire), into gates[m][unit in segment]; the caller
// synchronises before reading them. kRows: the rows' accumulators a lane keeps (rows <= kRows).
template <int kRows>
__device__ __forceinline__ void gate_segment(const __nv_bfloat16* __restrict__ x, int64_t x_stride,
                                             const __nv_bfloat16* __restrict__ wg, int rows, int dim, int hidden,
                                             int seg, float (&gates)[kRows][kDecodeSegUnits]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int vecs = dim / kChunk;
  const int first_unit = seg * kDecodeSegUnits + warp * kUnitsPerWarp;

  float acc[kUnitsPerWarp][kRows] = {};
  const uint4* w[kUnitsPerWarp];
#pragma unroll
  for (int u = 0; u < kUnitsPerWarp; ++u)  // units past H read row 0 and are dropped by the caller
    w[u] = reinterpret_cast<const uint4*>(wg + static_cast<int64_t>(first_unit + u < hidden ? first_unit + u : 0) * dim);
  for (int v0 = lane; v0 < vecs; v0 += 32 * kGateLoads) {
    uint4 wv[kUnitsPerWarp][kGateLoads];  // every load of this pass issued before any is used
#pragma unroll
    for (int u = 0; u < kUnitsPerWarp; ++u)
#pragma unroll
      for (int k = 0; k < kGateLoads; ++k) {
        const int v = v0 + 32 * k;
        if (v < vecs) wv[u][k] = __ldg(w[u] + v);
      }
#pragma unroll
    for (int k = 0; k < kGateLoads; ++k) {
      const int v = v0 + 32 * k;
      if (v >= vecs) break;
      float wf[kUnitsPerWarp][kChunk];  // each weight converted once, used by every row
#pragma unroll
      for (int u = 0; u < kUnitsPerWarp; ++u) bf16x8_to_float(wv[u][k], wf[u]);
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m >= rows) break;
        float xf[kChunk];
        bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(x + m * x_stride) + v), xf);
#pragma unroll
        for (int u = 0; u < kUnitsPerWarp; ++u)
#pragma unroll
          for (int e = 0; e < kChunk; ++e) acc[u][m] = fmaf(wf[u][e], xf[e], acc[u][m]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kUnitsPerWarp; ++u)
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      if (m >= rows) break;
      const float g = __bfloat162float(__float2bfloat16(warp_sum(acc[u][m])));
      if (lane == 0) gates[m][warp * kUnitsPerWarp + u] = g;
    }
}

template <int kRows>
__global__ void __launch_bounds__(kGateThreads, 2)
    decode_gate_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const __nv_bfloat16* __restrict__ wg,
                       int rows, int dim, int hidden, int32_t* __restrict__ seg_count, int32_t* __restrict__ seg_unit,
                       float* __restrict__ seg_gate) {
  __shared__ float gates[kRows][kDecodeSegUnits];
  const int seg = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  gate_segment<kRows>(x, x_stride, wg, rows, dim, hidden, seg, gates);
  __syncthreads();
  const int n_seg = gridDim.x;
  for (int m = warp; m < rows; m += kGateWarps)
    compact_segment(m, seg, n_seg, lane, gates[m][lane], seg * kDecodeSegUnits + lane < hidden, seg_count, seg_unit,
                    seg_gate);
}

__global__ void __launch_bounds__(kThreads)
    decode_compact_kernel(const __nv_bfloat16* __restrict__ g, int hidden, int n_seg, int32_t* __restrict__ seg_count,
                          int32_t* __restrict__ seg_unit, float* __restrict__ seg_gate) {
  const int m = blockIdx.y;
  const int seg = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (seg >= n_seg) return;  // whole warps leave: the ballot below stays warp-uniform
  const int unit = seg * kDecodeSegUnits + lane;
  const bool in_range = unit < hidden;
  const float gate = in_range ? __bfloat162float(g[static_cast<int64_t>(m) * hidden + unit]) : 0.0f;
  compact_segment(m, seg, n_seg, lane, gate, in_range, seg_count, seg_unit, seg_gate);
}

// kVecs: 16-byte vectors of a row per lane, at least ceil(dim / 8 / 32).
template <int kVecs>
__global__ void __launch_bounds__(kThreads)
    decode_updown_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_stride, const __nv_bfloat16* __restrict__ wu,
                         const __nv_bfloat16* __restrict__ wd_t, int dim, int n_seg,
                         const int32_t* __restrict__ seg_count, const int32_t* __restrict__ seg_unit,
                         const float* __restrict__ seg_gate, float* __restrict__ partial,
                         int32_t* __restrict__ arrivals, __nv_bfloat16* __restrict__ out) {
  extern __shared__ float4 smem[];
  __shared__ bool last_to_arrive;
  int* offsets = reinterpret_cast<int*>(smem);                 // n_seg + 1: where each segment's units start
  float* sums = reinterpret_cast<float*>(smem) + ((n_seg + 4) / 4) * 4;  // (kWarps / 2) x dim: the reduction
  const int m = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int vecs = dim / kChunk;

  segment_offsets(seg_count + static_cast<int64_t>(m) * n_seg, n_seg, offsets);
  const int total = offsets[n_seg];

  uint4 xv[kVecs];
  float acc[kVecs][kChunk] = {};
  const uint4* xr = reinterpret_cast<const uint4*>(x + m * x_stride);
#pragma unroll
  for (int i = 0; i < kVecs; ++i)
    if (lane + 32 * i < vecs) xv[i] = __ldg(xr + lane + 32 * i);

  for (int k = split * kWarps + warp; k < total; k += splits * kWarps) {
    const int lo = segment_of(offsets, n_seg, k);
    const int64_t slot = (static_cast<int64_t>(m) * n_seg + lo) * kDecodeSegUnits + (k - offsets[lo]);
    const int64_t unit = seg_unit[slot];
    const float gate = seg_gate[slot];
    const uint4* up = reinterpret_cast<const uint4*>(wu + unit * dim);
    const uint4* down = reinterpret_cast<const uint4*>(wd_t + unit * dim);
    uint4 uv[kVecs], dv[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i)  // every load of both rows issued before any is used: one
      if (lane + 32 * i < vecs) {    // memory round trip a unit, not one a vector
        uv[i] = __ldg(up + lane + 32 * i);
        dv[i] = __ldg(down + lane + 32 * i);
      }
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i)
      if (lane + 32 * i < vecs) part += dot_bf16x8(xv[i], uv[i]);
    // u and h = relu(g) * u rounded to bf16 as the dense path rounds them (its up GEMM's output
    // and the elementwise product): only the order of the down projection's fp32 sum differs.
    const float u = __bfloat162float(__float2bfloat16(warp_sum(part)));
    const float h = __bfloat162float(__float2bfloat16(gate * u));
#pragma unroll
    for (int i = 0; i < kVecs; ++i)
      if (lane + 32 * i < vecs) axpy_bf16x8(h, dv[i], acc[i]);
  }

  // The warps' sums in a fixed tree (w += w + half, half = 4, 2, 1): the same sum on every run.
  // Each round the upper half stores its registers (16-byte stores) and the lower half adds them.
  for (int half = kWarps / 2; half > 0; half /= 2) {
    if (warp >= half && warp < 2 * half) {
      float* mine = sums + (warp - half) * dim;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int v = lane + 32 * i;
        if (v >= vecs) break;
        store8(mine, v, acc[i]);
      }
    }
    __syncthreads();
    if (warp < half) {
      const float4* other = reinterpret_cast<const float4*>(sums + warp * dim);
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int v = lane + 32 * i;
        if (v >= vecs) break;
        const float4 lo = other[2 * v], hi = other[2 * v + 1];
        acc[i][0] += lo.x; acc[i][1] += lo.y; acc[i][2] += lo.z; acc[i][3] += lo.w;
        acc[i][4] += hi.x; acc[i][5] += hi.y; acc[i][6] += hi.z; acc[i][7] += hi.w;
      }
    }
    __syncthreads();
  }
  // CTAs past the row's last unit hold zeros: they write nothing, and the sum below skips them.
  const int working = min(splits, (total + kWarps - 1) / kWarps);
  if (warp == 0 && split < working) {
    float* mine = partial + (static_cast<int64_t>(m) * splits + split) * dim;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int v = lane + 32 * i;
      if (v >= vecs) break;
      store8(mine, v, acc[i]);
    }
    __threadfence();  // the partial is visible to every SM before this CTA counts as arrived
  }
  __syncthreads();
  if (threadIdx.x == 0) last_to_arrive = atomicAdd(arrivals + m, 1) == splits - 1;
  __syncthreads();
  if (!last_to_arrive || working == 0) return;  // no unit fired: out + 0 is out
  // The row's last CTA: out[m] += bf16(sum of the working partials in split order), rounded as a
  // separate add would be (the FFN output first, then the sum).
  __threadfence();
  for (int v = threadIdx.x; v < vecs; v += kThreads) {
    float y[kChunk] = {};
    for (int s = 0; s < working; ++s) {
      const float4* p = reinterpret_cast<const float4*>(partial + (static_cast<int64_t>(m) * splits + s) * dim) + 2 * v;
      const float4 lo = __ldcg(p), hi = __ldcg(p + 1);  // L2: written by other SMs
      y[0] += lo.x; y[1] += lo.y; y[2] += lo.z; y[3] += lo.w;
      y[4] += hi.x; y[5] += hi.y; y[6] += hi.z; y[7] += hi.w;
    }
    float rounded[kChunk];
    bf16x8_to_float(float_to_bf16x8(y), rounded);
    add8(out + static_cast<int64_t>(m) * dim, v, rounded);
  }
}

template <int kVecs>
cudaError_t launch_updown(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* wu, const __nv_bfloat16* wd_t,
                          int rows, int dim, int n_seg, const int32_t* seg_count, const int32_t* seg_unit,
                          const float* seg_gate, int splits, float* partial, int32_t* arrivals,
                          __nv_bfloat16* out, cudaStream_t stream) {
  const size_t smem = (static_cast<size_t>((n_seg + 4) / 4) * 4 + kWarps / 2 * dim) * sizeof(float);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;  // the binding checks H first (kDecodeMaxSegments)
  decode_updown_kernel<kVecs><<<dim3(splits, rows), kThreads, smem, stream>>>(x, x_stride, wu, wd_t, dim, n_seg,
                                                                              seg_count, seg_unit, seg_gate, partial,
                                                                              arrivals, out);
  return cudaGetLastError();
}

// The whole FFN of one row in one launch. A CTA per segment computes its gates (gate_segment),
// then for each of its active units the up projection and h = relu(g) * u (a warp a unit), lists
// them in the segment's record (unit, h; in unit order) and asks L2 for the unit's row of Wd^T.
// The last kDecodeFinishers CTAs to arrive (an arrival counter) wait for the rest, then each adds one
// slice of y = sum of h_j Wd^T[j] into out: a warp per eighth of the list (units k = warp mod 8),
// a lane per 8 values of the slice, the warps' sums in a fixed tree. Every lane has only a few
// rows to load (~4 at 30 active units), so the tail after the gate is a few memory round trips,
// and the result depends on the inputs only.
constexpr int kListChunk = 512;  // list entries a finisher stages in shared memory at a time
constexpr int kDownLoads = 4;    // rows of Wd^T a lane has in flight
constexpr int kUpVecs = kDecodeMaxDim / kChunk / 32;  // 16-byte vectors of a row a lane holds
static_assert(kGateWarps == kDecodeFinishers, "a finisher's warps take the list's units round robin");

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__global__ void __launch_bounds__(kGateThreads, 2)
    decode_ffn_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wg,
                      const __nv_bfloat16* __restrict__ wu, const __nv_bfloat16* __restrict__ wd_t, int dim,
                      int hidden, int32_t* __restrict__ seg_count, int32_t* __restrict__ seg_unit,
                      float* __restrict__ seg_h, int32_t* __restrict__ arrivals, __nv_bfloat16* __restrict__ out) {
  __shared__ float gates[1][kDecodeSegUnits];
  __shared__ int active_lane[kDecodeSegUnits];  // the segment's active units, in order
  __shared__ int active_count;
  __shared__ int offsets[kDecodeOneLaunchMaxSegments + 1];  // finishers: where each segment's units start
  __shared__ int list_unit[kListChunk];
  __shared__ float list_h[kListChunk];
  __shared__ float4 sums[kGateWarps / 2][32][2];  // finishers: the warps' tree
  __shared__ int ticket;
  const int seg = blockIdx.x, n_seg = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int vecs = dim / kChunk;

  gate_segment<1>(x, dim, wg, 1, dim, hidden, seg, gates);
  __syncthreads();
  if (warp == 0) {  // the compaction: one ballot
    const bool active = seg * kDecodeSegUnits + lane < hidden && gates[0][lane] > 0.0f;
    const unsigned mask = __ballot_sync(kFullMask, active);
    if (active) active_lane[__popc(mask & ((1u << lane) - 1u))] = lane;
    if (lane == 0) {
      active_count = __popc(mask);
      seg_count[seg] = __popc(mask);
    }
  }
  __syncthreads();
  for (int slot = warp; slot < active_count; slot += kGateWarps) {  // up and h, a warp a unit
    const int unit_lane = active_lane[slot];
    const int64_t unit = static_cast<int64_t>(seg) * kDecodeSegUnits + unit_lane;
    const uint4* up = reinterpret_cast<const uint4*>(wu + unit * dim);
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    uint4 uv[kUpVecs], xv[kUpVecs];
#pragma unroll
    for (int i = 0; i < kUpVecs; ++i)  // every load issued before any is used
      if (lane + 32 * i < vecs) {
        uv[i] = __ldg(up + lane + 32 * i);
        xv[i] = __ldg(xr + lane + 32 * i);
      }
    if (lane * 64 < dim) prefetch_l2(wd_t + unit * dim + lane * 64);  // the row's 128-byte lines
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < kUpVecs; ++i)
      if (lane + 32 * i < vecs) part += dot_bf16x8(xv[i], uv[i]);
    // u and h rounded to bf16 as the dense path rounds them (its up GEMM's output and the product).
    const float u = __bfloat162float(__float2bfloat16(warp_sum(part)));
    const float h = __bfloat162float(__float2bfloat16(gates[0][unit_lane] * u));
    if (lane == 0) {
      const int64_t record = static_cast<int64_t>(seg) * kDecodeSegUnits + slot;
      seg_unit[record] = static_cast<int32_t>(unit);
      seg_h[record] = h;
    }
  }
  __syncthreads();  // every record of the CTA written ...
  const int finishers = min(kDecodeFinishers, n_seg);  // decode_one_launch_finishers
  if (threadIdx.x == 0) {
    __threadfence();  // ... and, through this fence after the barrier, visible to every SM first
    ticket = atomicAdd(arrivals, 1);
    // The last `finishers` to arrive wait for the others: the CTAs not yet arrived are finishers
    // too, resident or scheduled as the others exit, so the wait ends as long as the GPU has a
    // CTA slot besides the (at most 7) waiting ones. CUDA does not promise that scheduling, but
    // every GPU this runs on (a whole Hopper, 264 slots for these CTAs) gives it.
    if (ticket >= n_seg - finishers)
      while (atomicAdd(arrivals, 0) < n_seg) __nanosleep(64);
    __threadfence();  // the other CTAs' records are read after their arrivals
  }
  __syncthreads();
  const int finisher = ticket - (n_seg - finishers);
  if (finisher < 0) return;

  segment_offsets(seg_count, n_seg, offsets);  // written by other SMs in this launch
  const int total = offsets[n_seg];
  if (total == 0) return;  // no unit fired: out + 0 is out

  // This finisher's slice of the row: `per` vectors, a lane each (<= 32: decode_one_launch_applies).
  const int per = (vecs + finishers - 1) / finishers;
  const int v = finisher * per + lane;
  const bool mine = lane < per && v < vecs;
  float acc[kChunk] = {};
  for (int base = 0; base < total; base += kListChunk) {
    const int n = min(kListChunk, total - base);
    for (int i = threadIdx.x; i < n; i += kGateThreads) {  // the list's next entries, in unit order
      const int k = base + i;
      const int lo = segment_of(offsets, n_seg, k);
      const int64_t record = static_cast<int64_t>(lo) * kDecodeSegUnits + (k - offsets[lo]);
      list_unit[i] = __ldcg(seg_unit + record);
      list_h[i] = __ldcg(seg_h + record);
    }
    __syncthreads();
    if (mine)
      for (int i0 = warp; i0 < n; i0 += kGateWarps * kDownLoads) {
        uint4 dv[kDownLoads];
#pragma unroll
        for (int j = 0; j < kDownLoads; ++j) {
          const int i = i0 + j * kGateWarps;
          if (i < n) dv[j] = __ldg(reinterpret_cast<const uint4*>(wd_t + static_cast<int64_t>(list_unit[i]) * dim) + v);
        }
#pragma unroll
        for (int j = 0; j < kDownLoads; ++j) {
          const int i = i0 + j * kGateWarps;
          if (i < n) axpy_bf16x8(list_h[i], dv[j], acc);
        }
      }
    __syncthreads();
  }
  // The warps' sums in a fixed tree (w += w + half, half = 4, 2, 1), then out += bf16(y), rounded
  // as a separate add would be.
  for (int half = kGateWarps / 2; half > 0; half /= 2) {
    if (warp >= half && warp < 2 * half) {
      sums[warp - half][lane][0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      sums[warp - half][lane][1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    __syncthreads();
    if (warp < half) {
      const float4 lo = sums[warp][lane][0], hi = sums[warp][lane][1];
      acc[0] += lo.x; acc[1] += lo.y; acc[2] += lo.z; acc[3] += lo.w;
      acc[4] += hi.x; acc[5] += hi.y; acc[6] += hi.z; acc[7] += hi.w;
    }
    __syncthreads();
  }
  if (warp == 0 && mine) {
    float rounded[kChunk];
    bf16x8_to_float(float_to_bf16x8(acc), rounded);
    add8(out, v, rounded);
  }
}

}  // namespace

cudaError_t launch_decode_gate(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* wg, int rows, int dim,
                               int hidden, int32_t* seg_count, int32_t* seg_unit, float* seg_gate,
                               cudaStream_t stream) {
  if (rows > kDecodeFusedRows || dim % kChunk != 0) return cudaErrorInvalidValue;
  if (rows == 0 || hidden == 0) return cudaSuccess;
  const int grid = decode_segments(hidden);
  static_assert(kDecodeFusedRows == 2, "one instantiation a row count up to kDecodeFusedRows");
  if (rows == 1)
    decode_gate_kernel<1><<<grid, kGateThreads, 0, stream>>>(x, x_stride, wg, rows, dim, hidden, seg_count, seg_unit, seg_gate);
  else
    decode_gate_kernel<2><<<grid, kGateThreads, 0, stream>>>(x, x_stride, wg, rows, dim, hidden, seg_count, seg_unit, seg_gate);
  return cudaGetLastError();
}

cudaError_t launch_decode_compact(const __nv_bfloat16* g, int rows, int hidden, int32_t* seg_count,
                                  int32_t* seg_unit, float* seg_gate, cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  const int n_seg = decode_segments(hidden);
  decode_compact_kernel<<<dim3((n_seg + kWarps - 1) / kWarps, rows), kThreads, 0, stream>>>(
      g, hidden, n_seg, seg_count, seg_unit, seg_gate);
  return cudaGetLastError();
}

cudaError_t launch_decode_updown_add(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* wu,
                                     const __nv_bfloat16* wd_t, int rows, int dim, int hidden,
                                     const int32_t* seg_count, const int32_t* seg_unit, const float* seg_gate,
                                     int splits, float* partial, int32_t* arrivals, __nv_bfloat16* out,
                                     cudaStream_t stream) {
  if (dim % kChunk != 0 || dim > kDecodeMaxDim || splits < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const int n_seg = decode_segments(hidden);
  const int vecs_per_lane = (dim / kChunk + 31) / 32;
  cudaError_t err;
  if (vecs_per_lane <= 2)
    err = launch_updown<2>(x, x_stride, wu, wd_t, rows, dim, n_seg, seg_count, seg_unit, seg_gate, splits, partial,
                           arrivals, out, stream);
  else if (vecs_per_lane <= 4)
    err = launch_updown<4>(x, x_stride, wu, wd_t, rows, dim, n_seg, seg_count, seg_unit, seg_gate, splits, partial,
                           arrivals, out, stream);
  else
    err = launch_updown<8>(x, x_stride, wu, wd_t, rows, dim, n_seg, seg_count, seg_unit, seg_gate, splits, partial,
                           arrivals, out, stream);
  return err;
}

cudaError_t launch_decode_ffn_add(const __nv_bfloat16* x, const __nv_bfloat16* wg,
                                  const __nv_bfloat16* wu, const __nv_bfloat16* wd_t, int rows, int dim, int hidden,
                                  int32_t* seg_count, int32_t* seg_unit, float* seg_h, int32_t* arrivals,
                                  __nv_bfloat16* out, cudaStream_t stream) {
  if (!decode_one_launch_applies(rows, dim, hidden) || dim % kChunk != 0) return cudaErrorInvalidValue;
  if (rows == 0 || hidden == 0) return cudaSuccess;
  static_assert(kDecodeOneLaunchRows == 1, "the kernel takes one row");
  decode_ffn_kernel<<<decode_segments(hidden), kGateThreads, 0, stream>>>(x, wg, wu, wd_t, dim, hidden, seg_count,
                                                                          seg_unit, seg_h, arrivals, out);
  return cudaGetLastError();
}

}  // namespace sparse_llm
