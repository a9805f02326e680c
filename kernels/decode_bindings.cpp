// Torch binding of the decode FFN (decode_ffn.cuh): out += ffn(x) for a few rows, with no host read,
// so that a decode step can be captured in a CUDA graph.
#include <algorithm>

#include "decode_ffn.cuh"
#include "torch_glue.h"

namespace {

using sparse_llm_glue::bf16_mut_ptr;
using sparse_llm_glue::bf16_ptr;
using sparse_llm_glue::check_cuda;
using sparse_llm_glue::check_matrix;

// CTAs that share one row's active units (8 warps each): a single row spreads its ~30 units over
// 128 warps; in a batch the slowest row sets the time, and a row's count has a long tail (the
// tokens with many active units), so a batch of 64 still gives each row 8 CTAs (measured on an
// H100 at 64 rows: 55 us with 2 a row, the heavy rows' CTAs running long after the rest).
int decode_splits(int64_t rows) { return static_cast<int>(std::clamp<int64_t>(512 / std::max<int64_t>(rows, 1), 1, 16)); }
constexpr int64_t kMaxSplits = 64;  // of an explicit `splits` (a CUDA grid's x extent takes far more)

// out += relu(x Wg^T) * (x Wu^T) Wd^T in place; x: [M, D]; wg, wu, wd_t (= Wd^T): [H, D]; out: M x D
// values, contiguous; all bf16 on one GPU. Exact for every pattern (decode_ffn.cuh: the record holds
// every unit). `splits`: 0 for the default plan (one row: the whole FFN in one launch; more: the
// gate, then up/down over decode_splits' CTAs a row); else up/down as its own launch over that
// many CTAs a row, whatever the rows (a speed knob, for tuning and comparison: each value gives an
// exact result, in its own fixed summation order).
void ffn_decode_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
                     const at::Tensor& wd_t, int64_t splits) {
  check_matrix(x, "x");
  check_matrix(wg, "wg");
  check_matrix(wu, "wu");
  check_matrix(wd_t, "wd_t");
  const int64_t rows = x.size(0), dim = x.size(1), hidden = wg.size(0);
  SL_CHECK_ARG(wg.size(1) == dim && wu.sizes() == wg.sizes() && wd_t.sizes() == wg.sizes(),
               "wg, wu and wd_t must all be [H, D] with D = x.size(1) = ", dim, "; got ", wg.sizes(), ", ", wu.sizes(),
               ", ", wd_t.sizes());
  SL_CHECK_ARG(dim % 8 == 0 && dim <= sparse_llm::kDecodeMaxDim, "D must be a multiple of 8, at most ",
               sparse_llm::kDecodeMaxDim, ", got ", dim);
  SL_CHECK_ARG(out.is_cuda() && out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.numel() == x.numel() &&
                   out.dim() >= 1 && out.size(-1) == dim,
               "out must be a contiguous bf16 CUDA tensor of M x D = ", rows, " x ", dim, " values");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&wg, &wu, &wd_t, &out})
    SL_CHECK_ARG(t->device() == x.device(), "every tensor must be on x's device ", x.device());
  SL_CHECK_ARG(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0, "out must be 16-byte aligned");
  SL_CHECK_ARG(rows <= 65535, "at most 65535 rows (a CUDA grid's y extent), got ", rows);
  SL_CHECK_ARG(sparse_llm::decode_segments(static_cast<int>(hidden)) <= sparse_llm::kDecodeMaxSegments,
               "H must be at most ", sparse_llm::kDecodeMaxSegments * sparse_llm::kDecodeSegUnits, ", got ", hidden);
  SL_CHECK_ARG(splits >= 0 && splits <= kMaxSplits, "splits must be in [0, ", kMaxSplits, "], got ", splits);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = sparse_llm_glue::current_stream();
  const int n_seg = sparse_llm::decode_segments(static_cast<int>(hidden));
  auto opts = x.options();
  at::Tensor seg_count = at::empty({rows, n_seg}, opts.dtype(at::kInt));
  at::Tensor seg_unit = at::empty({rows, n_seg, sparse_llm::kDecodeSegUnits}, opts.dtype(at::kInt));
  at::Tensor seg_gate = at::empty({rows, n_seg, sparse_llm::kDecodeSegUnits}, opts.dtype(at::kFloat));
  if (splits == 0 && sparse_llm::decode_one_launch_applies(rows, dim, hidden)) {
    at::Tensor arrivals = at::zeros({1}, opts.dtype(at::kInt));
    check_cuda(sparse_llm::launch_decode_ffn_add(bf16_ptr(x), bf16_ptr(wg), bf16_ptr(wu), bf16_ptr(wd_t),
                                                 static_cast<int>(rows), static_cast<int>(dim),
                                                 static_cast<int>(hidden), seg_count.data_ptr<int32_t>(),
                                                 seg_unit.data_ptr<int32_t>(), seg_gate.data_ptr<float>(),
                                                 arrivals.data_ptr<int32_t>(), bf16_mut_ptr(out), stream),
               "decode_ffn_add");
    return;
  }
  const int row_splits = splits > 0 ? static_cast<int>(splits) : decode_splits(rows);
  at::Tensor partial = at::empty({rows, row_splits, dim}, opts.dtype(at::kFloat));
  at::Tensor arrivals = at::zeros({rows}, opts.dtype(at::kInt));
  if (rows <= sparse_llm::kDecodeFusedRows) {
    check_cuda(sparse_llm::launch_decode_gate(bf16_ptr(x), dim, bf16_ptr(wg), static_cast<int>(rows),
                                              static_cast<int>(dim), static_cast<int>(hidden),
                                              seg_count.data_ptr<int32_t>(), seg_unit.data_ptr<int32_t>(),
                                              seg_gate.data_ptr<float>(), stream),
               "decode_gate");
  } else {  // enough rows for cuBLAS's GEMM to beat the GEMV; its bf16 gate is then compacted
    const at::Tensor g = at::mm(x, wg.t());
    check_cuda(sparse_llm::launch_decode_compact(bf16_ptr(g), static_cast<int>(rows), static_cast<int>(hidden),
                                                 seg_count.data_ptr<int32_t>(), seg_unit.data_ptr<int32_t>(),
                                                 seg_gate.data_ptr<float>(), stream),
               "decode_compact");
  }
  check_cuda(sparse_llm::launch_decode_updown_add(bf16_ptr(x), dim, bf16_ptr(wu), bf16_ptr(wd_t),
                                                  static_cast<int>(rows), static_cast<int>(dim),
                                                  static_cast<int>(hidden), seg_count.data_ptr<int32_t>(),
                                                  seg_unit.data_ptr<int32_t>(), seg_gate.data_ptr<float>(), row_splits,
                                                  partial.data_ptr<float>(), arrivals.data_ptr<int32_t>(),
                                                  bf16_mut_ptr(out), stream),
             "decode_updown_add");
}

}  // namespace

void register_decode_ops(pybind11::module_& m) {
  m.def("ffn_decode_add_", sparse_llm_glue::guarded<&ffn_decode_add_>,
        "out += the exact FFN of a few rows x, in place, with no host read (CUDA-graph capturable); "
        "wd_t is Wd^T ([H, D]); splits: 0 for the default plan, else up/down as its own launch over that "
        "many CTAs a row",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("wg"), pybind11::arg("wu"), pybind11::arg("wd_t"),
        pybind11::arg("splits") = 0);
  m.attr("decode_max_dim") = sparse_llm::kDecodeMaxDim;
}
