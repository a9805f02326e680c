// Cross-entropy of rows of bf16 logits and its gradient with respect to them, in one kernel: the
// loss's chunks (sparse_llm/loss.py) call it between the logit GEMM and the two gradient GEMMs.
// Plain CUDA C++: no torch headers.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace sparse_llm {

// For each row r of logits [rows, vocab] (row-major, bf16) with label y = labels[r]:
//   loss_rows[r] = logsumexp(logits[r]) - logits[r, y], or 0 where y == ignore_index;
//   if grad is not null: grad[r, c] = (softmax(logits[r])[c] - (c == y)) * s, s = *grad_scale
//   (a device scalar, so that the caller's 1 / (number of labels) needs no host read), or 0 where
//   y == ignore_index.
// All arithmetic in fp32 from the bf16 logits, grad rounded once to bf16. A label outside
// [0, vocab) that is not ignore_index gives a NaN loss and NaN gradient row. grad may be logits
// itself: the gradient then overwrites the logits (the chunked loss needs no second buffer).
cudaError_t launch_cross_entropy_rows(const __nv_bfloat16* logits, int64_t rows, int64_t vocab, const int64_t* labels,
                                      int64_t ignore_index, const float* grad_scale, float* loss_rows,
                                      __nv_bfloat16* grad, cudaStream_t stream);

}  // namespace sparse_llm
