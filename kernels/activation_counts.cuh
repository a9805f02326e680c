// Per-row and per-column counts of the positive entries of a [rows, hidden] bf16 matrix: the FFN
// statistics (L0 per token, fire count per unit) of the dense path, in one pass over the matrix.
// Plain CUDA C++: no torch headers.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace sparse_llm {

// The widest matrix the kernel takes: one int32 counter per column in shared memory (48 KiB).
constexpr int kMaxCountColumns = 12288;

// row_counts[r] = #{c : a[r, c] > 0} (int64); col_counts[c] += #{r : a[r, c] > 0} (int32, zeroed by
// the caller). Needs hidden % 8 == 0, hidden <= kMaxCountColumns and a 16-byte aligned. NaN is not
// positive.
cudaError_t launch_activation_counts(const __nv_bfloat16* a, int64_t rows, int hidden, int64_t* row_counts,
                                     int32_t* col_counts, cudaStream_t stream);

}  // namespace sparse_llm
