// The heavy rows of the sync-free training forward (csr.cuh, "capacity path"): the host sizes the
// heavy rows' GEMMs by a capacity rather than by the count it would have to read, so these kernels
// take the count on the device and cover what the GEMMs do not:
//   - the gate of the GEMM rows with their share of the L1 term, as per-CTA partial sums;
//   - the rows past the capacity (an overflow: rare, the capacity follows recent steps with
//     headroom), computed one CTA a row straight from g, x and the weights, so the forward's y and
//     L1 are exact whatever the capacity.
// Partial sums go to fixed slots summed in a fixed order (launch_csr_l1_finish): deterministic.
#include "csr.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Units of one overflow row whose h a CTA computes before adding their Wd rows into y.
constexpr int kUnitChunk = 256;

__device__ __forceinline__ int64_t rows_below(const int64_t* count, int64_t n) { return *count < n ? *count : n; }

// h[i, :] = bf16(relu(g[list[i], :]) * u[i, :]) for i < min(*count, n), zero up to n; each CTA adds
// sum |h| (h as stored) over its elements to partial[blockIdx.x].
__global__ void __launch_bounds__(kThreads)
    gate_mul_rows_l1_kernel(const __nv_bfloat16* __restrict__ g, const int64_t* __restrict__ list,
                            const int64_t* __restrict__ count, int64_t n, int hidden,
                            const __nv_bfloat16* __restrict__ u, __nv_bfloat16* __restrict__ h,
                            float* __restrict__ partial) {
  __shared__ float sums[kThreads];
  const int vecs = hidden / kChunk;
  const int64_t valid = rows_below(count, n);
  float l1 = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n * vecs;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / vecs;
    const int v = static_cast<int>(i % vecs);
    uint4* hp = reinterpret_cast<uint4*>(h + r * hidden) + v;
    if (r >= valid) {
      *hp = make_uint4(0, 0, 0, 0);
      continue;
    }
    float gf[kChunk], uf[kChunk], hf[kChunk];
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(g + list[r] * hidden) + v), gf);
    bf16x8_to_float(reinterpret_cast<const uint4*>(u + r * hidden)[v], uf);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      hf[k] = fmaxf(gf[k], 0.0f) * uf[k];
      l1 += fabsf(bf16_rounded(hf[k]));
    }
    *hp = float_to_bf16x8(hf);
  }
  l1 = cta_ordered_sum<kThreads>(l1, sums);
  if (threadIdx.x == 0) partial[blockIdx.x] = l1;
}

// Rows list[first .. *count), CTA b taking first + b, first + b + gridDim.x, ...: for each, the
// active units of g's row in ascending order, kUnitChunk at a time: a warp per unit computes
// u = bf16(x . wu[unit]) and h = bf16(relu(g) * u) (the dense path's roundings), then each thread
// adds sum_k h_k * wd_t[unit_k, d] for its own columns d (fp32, units in order) and y[row] is
// rounded once. partial[blockIdx.x] = the CTA's sum of |h|. Dynamic shared memory: x's row
// (bf16) and y's accumulator (float), D elements each.
__global__ void __launch_bounds__(kThreads)
    heavy_overflow_updown_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ g,
                                 const __nv_bfloat16* __restrict__ wu, const __nv_bfloat16* __restrict__ wd_t,
                                 const int64_t* __restrict__ list, const int64_t* __restrict__ count, int64_t first,
                                 int dim, int hidden, __nv_bfloat16* __restrict__ y, float* __restrict__ partial) {
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);
  float* acc = reinterpret_cast<float*>(smem + static_cast<size_t>(dim) * sizeof(__nv_bfloat16));
  __shared__ int32_t units[kUnitChunk];
  __shared__ float hs[kUnitChunk];
  __shared__ int chunk_size;
  __shared__ float sums[kThreads];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float l1 = 0.0f;  // lane 0 of each warp: its units' |h|, in a fixed order
  const int64_t end = *count;
  for (int64_t i = first + blockIdx.x; i < end; i += gridDim.x) {
    const int64_t row = list[i];
    for (int d = threadIdx.x; d < dim; d += kThreads) {
      xs[d] = x[row * dim + d];
      acc[d] = 0.0f;
    }
    const __nv_bfloat16* grow = g + row * hidden;
    int next = 0;  // the first unit not yet scanned
    while (next < hidden) {
      // The next kUnitChunk active units, ascending (thread 0 scans: this path is rare).
      __syncthreads();
      if (threadIdx.x == 0) {
        int n = 0;
        while (next < hidden && n < kUnitChunk) {
          if (__bfloat162float(grow[next]) > 0.0f) units[n++] = next;
          ++next;
        }
        chunk_size = n;
      }
      __syncthreads();
      const int n = chunk_size;
      for (int k = warp; k < n; k += kWarps) {
        const int unit = units[k];
        const float u = __bfloat162float(
            __float2bfloat16(warp_dot_row<2>(xs, wu + static_cast<int64_t>(unit) * dim, dim, lane)));
        const float a = __bfloat162float(grow[unit]);
        if (lane == 0) {
          hs[k] = bf16_rounded(a * u);
          l1 += fabsf(hs[k]);
        }
      }
      __syncthreads();
      for (int d = threadIdx.x; d < dim; d += kThreads) {
        float s = acc[d];
        for (int k = 0; k < n; ++k) s += hs[k] * __bfloat162float(wd_t[static_cast<int64_t>(units[k]) * dim + d]);
        acc[d] = s;
      }
      // Every thread learns where thread 0's scan stopped.
      __syncthreads();
      if (threadIdx.x == 0) chunk_size = next;
      __syncthreads();
      next = chunk_size;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < dim; d += kThreads) y[row * dim + d] = __float2bfloat16(acc[d]);
    __syncthreads();
  }
  l1 = cta_ordered_sum<kThreads>(lane == 0 ? l1 : 0.0f, sums);
  if (threadIdx.x == 0) partial[blockIdx.x] = l1;
}

}  // namespace

cudaError_t launch_gate_mul_rows_l1(const __nv_bfloat16* g, const int64_t* list, const int64_t* count, int64_t n,
                                    int hidden, const __nv_bfloat16* u, __nv_bfloat16* h, float* partial,
                                    int blocks, cudaStream_t stream) {
  if (blocks <= 0 || hidden % kChunk != 0) return cudaErrorInvalidValue;
  gate_mul_rows_l1_kernel<<<blocks, kThreads, 0, stream>>>(g, list, count, n, hidden, u, h, partial);
  return cudaGetLastError();
}

cudaError_t launch_heavy_overflow_updown(const __nv_bfloat16* x, const __nv_bfloat16* g, const __nv_bfloat16* wu,
                                         const __nv_bfloat16* wd_t, const int64_t* list, const int64_t* count,
                                         int64_t first, int dim, int hidden, __nv_bfloat16* y, float* partial,
                                         int blocks, cudaStream_t stream) {
  if (blocks <= 0 || dim % kChunk != 0 || dim > kMaxTrainDim) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(dim) * (sizeof(__nv_bfloat16) + sizeof(float));
  cudaError_t err = cudaFuncSetAttribute(heavy_overflow_updown_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  heavy_overflow_updown_kernel<<<blocks, kThreads, smem, stream>>>(x, g, wu, wd_t, list, count, first, dim, hidden, y,
                                                                   partial);
  return cudaGetLastError();
}

}  // namespace sparse_llm
