// The row blocks shared by the training kernels that walk rows of the CSR record (csr_updown.cu,
// csr_backward.cu): one CTA owns kCsrRowsPerCta consecutive rows, whose entries are one
// contiguous range of the record; the block's rows of one activation are staged in shared memory.
#pragma once

#include "csr.cuh"
#include "vec.cuh"

namespace sparse_llm {

constexpr int kCsrRowsPerCta = 8;
constexpr int kCsrRowThreads = 256;
constexpr int kCsrRowWarps = kCsrRowThreads / 32;

// CTAs over `rows` rows, one block of kCsrRowsPerCta each.
inline int64_t csr_row_blocks(int64_t rows) { return (rows + kCsrRowsPerCta - 1) / kCsrRowsPerCta; }

// Rows of this CTA's block (the last block may be short).
__device__ __forceinline__ int row_block_size(int64_t rows, int64_t row0) {
  return static_cast<int>(rows - row0 < kCsrRowsPerCta ? rows - row0 : kCsrRowsPerCta);
}

// Shared-memory view of the block: ptr[0 .. n_rows] = the rows' entry offsets, skip[r] = row r is
// heavy (the dense path owns it), staged = the block's rows of src ([M, dim] bf16) that have
// entries (at high sparsity most blocks have none, and their rows are never read). Ends with a
// barrier.
__device__ __forceinline__ void load_row_block(const int64_t* __restrict__ row_ptr, const uint8_t* __restrict__ heavy,
                                               const __nv_bfloat16* __restrict__ src, int64_t row0, int n_rows,
                                               int dim, int64_t* ptr, bool* skip, __nv_bfloat16* staged) {
  if (threadIdx.x <= n_rows) ptr[threadIdx.x] = row_ptr[row0 + threadIdx.x];
  if (threadIdx.x < n_rows) skip[threadIdx.x] = heavy[row0 + threadIdx.x] != 0;
  __syncthreads();
  const int vecs = dim / kChunk;
  for (int i = threadIdx.x; i < n_rows * vecs; i += kCsrRowThreads) {
    const int r = i / vecs;
    if (ptr[r + 1] > ptr[r])
      reinterpret_cast<uint4*>(staged)[i] = reinterpret_cast<const uint4*>(src + row0 * dim)[i];
  }
  __syncthreads();
}

// Row (0 .. n_rows) of entry e, given the block's offsets.
__device__ __forceinline__ int local_row(const int64_t* ptr, int n_rows, int64_t e) {
  int r = 0;
  while (r + 1 < n_rows && ptr[r + 1] <= e) ++r;
  return r;
}

}  // namespace sparse_llm
