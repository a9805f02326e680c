// relu(g) into the CSR records of the training kernels (see csr.cuh), in one pass over g: count
// the active entries of every row (the counts become row offsets on the device), add them to the
// fire counts and stage each row's first `stage_width` entries (all of a light row's); the light
// record is then copied from the stage, and only the heavy rows are read from g again. One warp
// per row; each lane reads 8 bf16 (16 bytes) per step, so a step covers 256 columns and the warp's
// writes of a step stay in one short contiguous run.
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

// Calls emit(unit, value) for the active entries of g's row `row` in ascending order, each with its
// position in the row (uniform trip count: every lane runs the warp scan); returns the count.
template <typename Emit>
__device__ __forceinline__ int64_t scan_row(const __nv_bfloat16* __restrict__ g, int64_t row, int hidden, int lane,
                                            Emit emit) {
  const uint4* src = reinterpret_cast<const uint4*>(g + row * hidden);
  const int vecs = hidden / kChunk;
  int64_t base = 0;
  for (int v0 = 0; v0 < vecs; v0 += 32) {
    const int v = v0 + lane;
    float vals[kChunk];
    const unsigned mask = v < vecs ? active_mask(__ldg(src + v), vals) : 0u;
    const int count = __popc(mask);
    const int incl = warp_inclusive_scan(count, lane);
    int64_t pos = base + incl - count;
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      if (mask & (1u << i)) emit(pos++, v * kChunk + i, vals[i]);
    base += __shfl_sync(kFullMask, incl, 31);
  }
  return base;
}

__global__ void __launch_bounds__(kThreads)
    csr_count_kernel(const __nv_bfloat16* __restrict__ g, int64_t rows, int hidden, int stage_width,
                     int64_t* __restrict__ nnz, int32_t* __restrict__ stage_cols, __nv_bfloat16* __restrict__ stage_a,
                     int32_t* __restrict__ fire_counts) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t stage0 = row * stage_width;
  const int64_t count = scan_row(g, row, hidden, lane, [&](int64_t pos, int unit, float value) {
    if (pos < stage_width) {
      stage_cols[stage0 + pos] = unit;
      stage_a[stage0 + pos] = __float2bfloat16(value);  // exact: value came from bf16
    }
    atomicAdd(fire_counts + unit, 1);
  });
  if (lane == 0) nnz[row] = count;
}

// The light rows' record from the stage (a heavy row's range in row_ptr is empty): one warp per row.
__global__ void __launch_bounds__(kThreads)
    csr_fill_light_kernel(const int32_t* __restrict__ stage_cols, const __nv_bfloat16* __restrict__ stage_a,
                          int stage_width, int64_t rows, const int64_t* __restrict__ row_ptr,
                          int32_t* __restrict__ cols, __nv_bfloat16* __restrict__ a_vals,
                          int32_t* __restrict__ light_fires) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t begin = row_ptr[row], n = row_ptr[row + 1] - begin, stage0 = row * stage_width;
  for (int64_t i = lane; i < n; i += 32) {
    const int32_t unit = stage_cols[stage0 + i];
    cols[begin + i] = unit;
    a_vals[begin + i] = stage_a[stage0 + i];
    if (light_fires != nullptr) atomicAdd(light_fires + unit, 1);  // integers: any order, the same sum
  }
}

// The heavy rows' record, from g. A light row's range in row_ptr is empty (a heavy row has at least
// one entry), and its row of g is not read.
__global__ void __launch_bounds__(kThreads)
    csr_fill_heavy_kernel(const __nv_bfloat16* __restrict__ g, int64_t rows, int hidden,
                          const int64_t* __restrict__ row_ptr, int64_t capacity, int32_t* __restrict__ cols,
                          __nv_bfloat16* __restrict__ a_vals) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t begin = row_ptr[row];
  if (row_ptr[row + 1] == begin || begin >= capacity) return;
  scan_row(g, row, hidden, lane, [&](int64_t pos, int unit, float value) {
    if (begin + pos < capacity) {
      cols[begin + pos] = unit;
      a_vals[begin + pos] = __float2bfloat16(value);
    }
  });
}

unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta); }

}  // namespace

cudaError_t launch_csr_count(const __nv_bfloat16* g, int64_t rows, int hidden, int stage_width, int64_t* nnz,
                             int32_t* stage_cols, __nv_bfloat16* stage_a, int32_t* fire_counts, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (hidden % kChunk != 0 || stage_width < 0) return cudaErrorInvalidValue;
  csr_count_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(g, rows, hidden, stage_width, nnz, stage_cols, stage_a,
                                                              fire_counts);
  return cudaGetLastError();
}

cudaError_t launch_csr_fill_light(const int32_t* stage_cols, const __nv_bfloat16* stage_a, int stage_width,
                                  int64_t rows, const int64_t* row_ptr, int32_t* cols, __nv_bfloat16* a_vals,
                                  int32_t* light_fires, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  csr_fill_light_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(stage_cols, stage_a, stage_width, rows, row_ptr,
                                                                   cols, a_vals, light_fires);
  return cudaGetLastError();
}

cudaError_t launch_csr_fill_heavy(const __nv_bfloat16* g, int64_t rows, int hidden, const int64_t* row_ptr,
                                  int32_t* cols, __nv_bfloat16* a_vals, cudaStream_t stream, int64_t capacity) {
  if (rows == 0) return cudaSuccess;
  if (hidden % kChunk != 0) return cudaErrorInvalidValue;
  csr_fill_heavy_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(g, rows, hidden, row_ptr, capacity, cols, a_vals);
  return cudaGetLastError();
}

}  // namespace sparse_llm
