// Torch binding of the cross-entropy row kernel (cross_entropy.cuh), used by the chunked loss.
#include <optional>
#include <tuple>

#include "cross_entropy.cuh"
#include "torch_glue.h"

namespace {

// (loss of each row, gradient w.r.t. the logits scaled by grad_scale or an empty [0, V] tensor
// without it); see launch_cross_entropy_rows. With in_place (and grad_scale) the gradient is
// written over the logits, and returned as them.
std::tuple<at::Tensor, at::Tensor> cross_entropy_rows(const at::Tensor& logits, const at::Tensor& labels,
                                                      int64_t ignore_index, const std::optional<at::Tensor>& grad_scale,
                                                      bool in_place) {
  SL_CHECK_ARG(logits.is_cuda() && logits.scalar_type() == at::kBFloat16 && logits.dim() == 2 && logits.is_contiguous(),
               "logits must be a contiguous 2-D bfloat16 CUDA tensor, got ", logits.scalar_type(), " of shape ",
               logits.sizes());
  SL_CHECK_ARG(labels.scalar_type() == at::kLong && labels.dim() == 1 && labels.size(0) == logits.size(0) &&
                   labels.device() == logits.device() && labels.is_contiguous(),
               "labels must be contiguous int64 [rows] on the logits' device, got ", labels.scalar_type(), " of shape ",
               labels.sizes());
  if (grad_scale.has_value()) {
    SL_CHECK_ARG(grad_scale->scalar_type() == at::kFloat && grad_scale->numel() == 1 &&
                     grad_scale->device() == logits.device(),
                 "grad_scale must be one float32 value on the logits' device");
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor loss_rows = at::empty({rows}, logits.options().dtype(at::kFloat));
  SL_CHECK_ARG(!in_place || grad_scale.has_value(), "in_place needs grad_scale");
  at::Tensor grad = !grad_scale.has_value() ? at::empty({0, vocab}, logits.options())
                    : in_place              ? logits
                                            : at::empty_like(logits);
  sparse_llm_glue::check_cuda(
      sparse_llm::launch_cross_entropy_rows(
          sparse_llm_glue::bf16_ptr(logits), rows, vocab, labels.data_ptr<int64_t>(), ignore_index,
          grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr, loss_rows.data_ptr<float>(),
          grad_scale.has_value() ? sparse_llm_glue::bf16_mut_ptr(grad) : nullptr, sparse_llm_glue::current_stream()),
      "cross_entropy_rows");
  return {loss_rows, grad};
}

}  // namespace

void register_loss_ops(pybind11::module_& m) {
  m.def("cross_entropy_rows", sparse_llm_glue::guarded<&cross_entropy_rows>,
        "(per-row cross-entropy of bf16 logits, its gradient w.r.t. the logits times grad_scale or an empty "
        "tensor when grad_scale is None); in_place writes the gradient over the logits");
}
