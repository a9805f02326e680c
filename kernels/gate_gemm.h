// The gate GEMM of the inference FFN with a ReLU bit mask (cuBLASLt epilogue), for the masked
// TwELL pack (launch_twell_pack_masked in twell.cuh).
#pragma once

#include <optional>

#include <torch/extension.h>

namespace sparse_llm_glue {

struct GateWithMask {
  at::Tensor a;     // [M, H] bf16: relu(x @ wg^T)
  at::Tensor mask;  // [M, 4 * n_tiles] int32: bit j of word w of a row set where g[row, 32 w + j] >= 0
                    // (so wherever a > 0); the bits past H are not written
};

// a = relu(x @ wg^T) and its bit mask in one cuBLASLt GEMM, by the algo_index-th algorithm of
// cuBLASLt's heuristic (0: its first choice; the others are for benchmarks). nullopt where cuBLASLt
// is not in the build or offers no such algorithm (the caller then runs at::mm and the dense pack).
// x: [M, D], wg: [H, D], bf16, contiguous, checked by the caller.
std::optional<GateWithMask> gate_relu_mask(const at::Tensor& x, const at::Tensor& wg, int algo_index = 0);

}  // namespace sparse_llm_glue
