// Torch binding of the activation-count kernel (activation_counts.cuh): the dense path's FFN
// statistics.
#include <tuple>

#include "activation_counts.cuh"
#include "torch_glue.h"

namespace {

// (positive entries per row [M] int64, per column [H] int64) of a: [M, H] bf16.
std::tuple<at::Tensor, at::Tensor> activation_counts(const at::Tensor& a) {
  sparse_llm_glue::check_matrix(a, "a");
  SL_CHECK_ARG(a.size(1) % 8 == 0 && a.size(1) <= sparse_llm::kMaxCountColumns,
               "a must have a multiple of 8 columns, at most ", sparse_llm::kMaxCountColumns, ", got ", a.size(1));
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor row_counts = at::empty({a.size(0)}, a.options().dtype(at::kLong));
  at::Tensor col_counts = at::zeros({a.size(1)}, a.options().dtype(at::kInt));
  sparse_llm_glue::check_cuda(
      sparse_llm::launch_activation_counts(sparse_llm_glue::bf16_ptr(a), a.size(0), static_cast<int>(a.size(1)),
                                           row_counts.data_ptr<int64_t>(), col_counts.data_ptr<int32_t>(),
                                           sparse_llm_glue::current_stream()),
      "activation_counts");
  return {row_counts, col_counts.to(at::kLong)};
}

}  // namespace

void register_count_ops(pybind11::module_& m) {
  m.def("activation_counts", sparse_llm_glue::guarded<&activation_counts>,
        "(positive entries per row, per column) of a bf16 [M, H] matrix, int64, in one pass");
}
