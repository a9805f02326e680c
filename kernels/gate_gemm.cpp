// The gate GEMM with cuBLASLt's RELU_AUX epilogue: a = relu(x @ wg^T) plus one bit per element
// (g >= 0), written by the GEMM itself. The TwELL pack then reads the bits (1/16 of a's bytes)
// and only the active values of a, instead of all of g: the dense pack read 1.4 GB per layer of
// a 1B prefill of 64 x 1920 tokens.
#include "gate_gemm.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "errors.h"
#include "twell.cuh"

#if __has_include(<cublasLt.h>)
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>
#define SPARSE_LLM_HAVE_CUBLASLT 1
#endif

namespace sparse_llm_glue {

#ifdef SPARSE_LLM_HAVE_CUBLASLT
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's recommendation on Hopper
constexpr int kMaxAlgos = 8;

void check_lt(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw KernelError(c10::str("cuBLASLt ", what, " failed with status ", static_cast<int>(status)));
}

// Owns the cuBLASLt descriptors of one call.
struct LtCall {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w_layout = nullptr, x_layout = nullptr, a_layout = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  LtCall() = default;
  LtCall(const LtCall&) = delete;
  LtCall& operator=(const LtCall&) = delete;
  ~LtCall() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    for (cublasLtMatrixLayout_t layout : {w_layout, x_layout, a_layout})
      if (layout) cublasLtMatrixLayoutDestroy(layout);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

template <typename T>
void set_op(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  check_lt(cublasLtMatmulDescSetAttribute(op, attribute, &value, sizeof(value)), "MatmulDescSetAttribute");
}

}  // namespace

std::optional<GateWithMask> gate_relu_mask(const at::Tensor& x, const at::Tensor& wg, int algo_index) {
  SL_CHECK_ARG(algo_index >= 0 && algo_index < kMaxAlgos, "algo_index must be in [0, ", kMaxAlgos, ")");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), dim = x.size(1), hidden = wg.size(0);
  const int64_t mask_words = 4 * sparse_llm::twell_n_tiles(static_cast<int>(hidden));
  GateWithMask out{at::empty({rows, hidden}, x.options()), at::empty({rows, mask_words}, x.options().dtype(at::kInt))};
  if (rows == 0) return out;

  // cuBLAS is column-major: a^T [H, M] = op_T(wg^T [D, H]) @ x^T [D, M], both stored as given.
  LtCall call;
  check_lt(cublasLtMatmulDescCreate(&call.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  set_op(call.op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_op(call.op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set_op(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_RELU_AUX);
  set_op(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, out.mask.data_ptr());
  // In bits: one column of a^T (a row of a) per 4 * n_tiles words; a multiple of 128 as required.
  set_op(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(mask_words * 32));
  check_lt(cublasLtMatrixLayoutCreate(&call.w_layout, CUDA_R_16BF, dim, hidden, dim), "MatrixLayoutCreate");
  check_lt(cublasLtMatrixLayoutCreate(&call.x_layout, CUDA_R_16BF, dim, rows, dim), "MatrixLayoutCreate");
  check_lt(cublasLtMatrixLayoutCreate(&call.a_layout, CUDA_R_16BF, hidden, rows, hidden), "MatrixLayoutCreate");
  check_lt(cublasLtMatmulPreferenceCreate(&call.preference), "MatmulPreferenceCreate");
  const uint64_t workspace_bytes = kWorkspaceBytes;
  check_lt(cublasLtMatmulPreferenceSetAttribute(call.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &workspace_bytes, sizeof(workspace_bytes)),
           "MatmulPreferenceSetAttribute");

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristics[kMaxAlgos] = {};
  int found = 0;
  const cublasStatus_t searched =
      cublasLtMatmulAlgoGetHeuristic(handle, call.op, call.w_layout, call.x_layout, call.a_layout, call.a_layout,
                                     call.preference, kMaxAlgos, heuristics, &found);
  if (searched != CUBLAS_STATUS_SUCCESS || found <= algo_index) return std::nullopt;
  const cublasLtMatmulHeuristicResult_t& heuristic = heuristics[algo_index];

  const at::Tensor workspace = at::empty({static_cast<int64_t>(kWorkspaceBytes)}, x.options().dtype(at::kByte));
  const float alpha = 1.0f, beta = 0.0f;
  check_lt(cublasLtMatmul(handle, call.op, &alpha, wg.data_ptr(), call.w_layout, x.data_ptr(), call.x_layout, &beta,
                          out.a.data_ptr(), call.a_layout, out.a.data_ptr(), call.a_layout, &heuristic.algo,
                          workspace.data_ptr(), kWorkspaceBytes, c10::cuda::getCurrentCUDAStream().stream()),
           "Matmul");
  return out;
}

#else  // no cuBLASLt headers in this build: the callers use at::mm and the dense pack

std::optional<GateWithMask> gate_relu_mask(const at::Tensor&, const at::Tensor&, int) { return std::nullopt; }

#endif

}  // namespace sparse_llm_glue
