// relu(g) into the CSR records of the training kernels (see csr.cuh), in two passes over g: count
// the active entries of every row (the counts become row offsets on the device), then write the
// entries of one kind of row (light or heavy) into that kind's record. One warp per row; each lane
// reads 8 bf16 (16 bytes) per step, so a step covers 256 columns and the warp's writes of a step
// stay in one short contiguous run.
#include "csr.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerCta = kThreads / 32;

// Bit i set when element i of the 8 is > 0 (NaN is not active, as in g > 0).
__device__ __forceinline__ unsigned active_mask(const uint4& raw, float (&vals)[kChunk]) {
  bf16x8_to_float(raw, vals);
  unsigned mask = 0;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) mask |= (vals[i] > 0.0f ? 1u : 0u) << i;
  return mask;
}

__global__ void __launch_bounds__(kThreads)
    csr_count_kernel(const __nv_bfloat16* __restrict__ g, int64_t rows, int hidden, int64_t* __restrict__ nnz) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (row >= rows) return;
  const uint4* src = reinterpret_cast<const uint4*>(g + row * hidden);
  const int vecs = hidden / kChunk;
  int count = 0;
  for (int v = lane; v < vecs; v += 32) {
    float vals[kChunk];
    count += __popc(active_mask(__ldg(src + v), vals));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) count += __shfl_xor_sync(kFullMask, count, off);
  if (lane == 0) nnz[row] = count;
}

__global__ void __launch_bounds__(kThreads)
    csr_fill_kernel(const __nv_bfloat16* __restrict__ g, int64_t rows, int hidden, const int64_t* __restrict__ row_ptr,
                    const int64_t* __restrict__ nnz, const uint8_t* __restrict__ heavy, bool heavy_rows,
                    int32_t* __restrict__ cols, __nv_bfloat16* __restrict__ a_vals, int32_t* __restrict__ fire_counts) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (row >= rows || nnz[row] == 0) return;  // at high sparsity most rows: g is not read again
  const bool write = (heavy[row] != 0) == heavy_rows;
  if (!write && fire_counts == nullptr) return;
  const uint4* src = reinterpret_cast<const uint4*>(g + row * hidden);
  const int vecs = hidden / kChunk;
  int64_t base = row_ptr[row];
  for (int v0 = 0; v0 < vecs; v0 += 32) {  // uniform trip count: the scan below needs every lane
    const int v = v0 + lane;
    float vals[kChunk];
    const unsigned mask = v < vecs ? active_mask(__ldg(src + v), vals) : 0u;
    const int count = __popc(mask);
    const int incl = warp_inclusive_scan(count, lane);
    int64_t out = base + incl - count;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      if (mask & (1u << i)) {
        const int unit = v * kChunk + i;
        if (write) {
          cols[out] = unit;
          a_vals[out] = __float2bfloat16(vals[i]);  // exact: vals came from bf16
          ++out;
        }
        if (fire_counts != nullptr) atomicAdd(fire_counts + unit, 1);
      }
    }
    base += __shfl_sync(kFullMask, incl, 31);
  }
}

unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta); }

}  // namespace

cudaError_t launch_csr_count(const __nv_bfloat16* g, int64_t rows, int hidden, int64_t* nnz, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (hidden % kChunk != 0) return cudaErrorInvalidValue;
  csr_count_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(g, rows, hidden, nnz);
  return cudaGetLastError();
}

cudaError_t launch_csr_fill(const __nv_bfloat16* g, int64_t rows, int hidden, const int64_t* row_ptr,
                            const int64_t* nnz, const uint8_t* heavy, bool heavy_rows, int32_t* cols,
                            __nv_bfloat16* a_vals, int32_t* fire_counts, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (hidden % kChunk != 0) return cudaErrorInvalidValue;
  csr_fill_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(g, rows, hidden, row_ptr, nnz, heavy, heavy_rows, cols,
                                                             a_vals, fire_counts);
  return cudaGetLastError();
}

}  // namespace sparse_llm
