// Helpers of the dense path for heavy rows: an ordered list of the heavy rows (no host sync to
// build it), the rows gathered for its GEMMs, the fused gate h = relu(g[row]) * u on them, the
// rows' outputs scattered back, and their share of the L1 term. Each is one launch. The row count
// may be read on the device (`count`), so that the training forward can queue the first rows'
// work before its host read has told it how many heavy rows there are.
#include "twell.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;

// The rows to process: min(*count, n) where count is given (on the device), else n.
__device__ __forceinline__ int64_t counted_rows(const int64_t* count, int64_t n) {
  return count != nullptr && *count < n ? *count : n;
}

__global__ void compact_rows_kernel(const uint8_t* __restrict__ heavy, const int32_t* __restrict__ inclusive_pos,
                                    int64_t rows, int64_t* __restrict__ list) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row < rows && heavy[row]) list[inclusive_pos[row] - 1] = row;
}

// u and h may be the same buffer (h written in place).
__global__ void gate_mul_rows_kernel(const __nv_bfloat16* __restrict__ g, const int64_t* __restrict__ list,
                                     const int64_t* count, int64_t n, int hidden, const __nv_bfloat16* u,
                                     __nv_bfloat16* h) {
  const int vecs = hidden / 8;
  const int64_t total = n * vecs;
  const int64_t valid = counted_rows(count, n);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / vecs;
    const int v = static_cast<int>(i % vecs);
    uint4* hp = reinterpret_cast<uint4*>(h + r * hidden) + v;
    if (r >= valid) {
      *hp = make_uint4(0, 0, 0, 0);
      continue;
    }
    const uint4 graw = __ldg(reinterpret_cast<const uint4*>(g + list[r] * hidden) + v);
    uint4 uraw = reinterpret_cast<const uint4*>(u + r * hidden)[v];
    const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&graw);
    __nv_bfloat162* uq = reinterpret_cast<__nv_bfloat162*>(&uraw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 gf = __bfloat1622float2(gp[k]);
      const float2 uf = __bfloat1622float2(uq[k]);
      // Round relu(g) and u to bf16 first (they are bf16 already), then the product: as the dense path.
      uq[k] = __floats2bfloat162_rn(fmaxf(gf.x, 0.0f) * uf.x, fmaxf(gf.y, 0.0f) * uf.y);
    }
    *hp = uraw;
  }
}

__global__ void gather_rows_padded_kernel(const uint4* __restrict__ src, const int64_t* __restrict__ list,
                                          const int64_t* count, int64_t n, int64_t padded, int64_t row_vecs,
                                          uint4* __restrict__ dst) {
  const int64_t total = padded * row_vecs;
  const int64_t valid = counted_rows(count, n);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / row_vecs;
    const int64_t v = i % row_vecs;
    dst[i] = r < valid ? __ldg(src + list[r] * row_vecs + v) : make_uint4(0, 0, 0, 0);
  }
}

__global__ void scatter_rows_kernel(const uint4* __restrict__ src, const int64_t* __restrict__ list,
                                    const int64_t* count, int64_t n, int64_t row_vecs, uint4* __restrict__ dst) {
  const int64_t total = counted_rows(count, n) * row_vecs;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    dst[list[i / row_vecs] * row_vecs + i % row_vecs] = src[i];
}

// One CTA, a fixed order of additions: the sum is the same on every run.
constexpr int kSumThreads = 1024;
constexpr int kSumLoads = 4;

__global__ void __launch_bounds__(kSumThreads)
    add_abs_product_sum_kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ u, int64_t n,
                               float scale, float* __restrict__ acc) {
  __shared__ float sums[kSumThreads];
  // One CTA reads the whole record: 16-byte loads, kSumLoads of each array in flight per thread
  // (scalar loads took 29 us for the ~300K heavy entries at 30 non-zeros per token, M = 16384).
  const uint4* av = reinterpret_cast<const uint4*>(a);
  const uint4* uv = reinterpret_cast<const uint4*>(u);
  const int64_t vecs = n / kChunk;
  float sum = 0.0f;
  for (int64_t v0 = threadIdx.x; v0 < vecs; v0 += kSumThreads * kSumLoads) {
    uint4 ar[kSumLoads], ur[kSumLoads];
#pragma unroll
    for (int k = 0; k < kSumLoads; ++k) {
      const int64_t v = v0 + k * kSumThreads;
      if (v < vecs) {
        ar[k] = __ldg(av + v);
        ur[k] = __ldg(uv + v);
      }
    }
#pragma unroll
    for (int k = 0; k < kSumLoads; ++k) {
      if (v0 + k * kSumThreads >= vecs) break;
      float af[kChunk], uf[kChunk];
      bf16x8_to_float(ar[k], af);
      bf16x8_to_float(ur[k], uf);
#pragma unroll
      for (int c = 0; c < kChunk; ++c) sum += fabsf(bf16_rounded(af[c] * uf[c]));
    }
  }
  for (int64_t i = vecs * kChunk + threadIdx.x; i < n; i += kSumThreads)
    sum += fabsf(bf16_rounded(__bfloat162float(a[i]) * __bfloat162float(u[i])));
  sum = cta_ordered_sum<kSumThreads>(sum, sums);
  if (threadIdx.x == 0) *acc += sum * scale;
}

// Blocks of a grid-stride launch over `work` items: one item a thread, at most 65536 blocks.
unsigned grid_stride_blocks(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
}

}  // namespace

cudaError_t launch_gather_rows_padded(const void* src, const int64_t* list, const int64_t* count, int64_t n,
                                      int64_t padded, int64_t row_bytes, void* dst, cudaStream_t stream) {
  if (padded == 0) return cudaSuccess;
  if (row_bytes % 16 != 0) return cudaErrorInvalidValue;
  const int64_t row_vecs = row_bytes / 16;
  gather_rows_padded_kernel<<<grid_stride_blocks(padded * row_vecs), kThreads, 0, stream>>>(
      static_cast<const uint4*>(src), list, count, n, padded, row_vecs, static_cast<uint4*>(dst));
  return cudaGetLastError();
}

cudaError_t launch_scatter_rows(const void* src, const int64_t* list, const int64_t* count, int64_t n,
                                int64_t row_bytes, void* dst, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (row_bytes % 16 != 0) return cudaErrorInvalidValue;
  const int64_t row_vecs = row_bytes / 16;
  scatter_rows_kernel<<<grid_stride_blocks(n * row_vecs), kThreads, 0, stream>>>(
      static_cast<const uint4*>(src), list, count, n, row_vecs, static_cast<uint4*>(dst));
  return cudaGetLastError();
}

cudaError_t launch_add_abs_product_sum(const __nv_bfloat16* a, const __nv_bfloat16* u, int64_t n, float scale,
                                       float* acc, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(u)) % 16 != 0) return cudaErrorMisalignedAddress;
  add_abs_product_sum_kernel<<<1, kSumThreads, 0, stream>>>(a, u, n, scale, acc);
  return cudaGetLastError();
}

cudaError_t launch_compact_rows(const uint8_t* heavy, const int32_t* inclusive_pos, int64_t rows, int64_t* list,
                                cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  compact_rows_kernel<<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      heavy, inclusive_pos, rows, list);
  return cudaGetLastError();
}

cudaError_t launch_gate_mul_rows(const __nv_bfloat16* g, const int64_t* list, const int64_t* count, int64_t n,
                                 int hidden, const __nv_bfloat16* u, __nv_bfloat16* h, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (hidden % 8 != 0) return cudaErrorInvalidValue;
  gate_mul_rows_kernel<<<grid_stride_blocks(n * (hidden / 8)), kThreads, 0, stream>>>(g, list, count, n, hidden, u,
                                                                                      h);
  return cudaGetLastError();
}

}  // namespace sparse_llm
