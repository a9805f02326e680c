// Torch bindings of the training kernels: the FFN training forward (gate GEMM, CSR pack, sparse
// up/down) and backward (per-row and per-unit kernels), with heavy rows on a dense GEMM path. The record passed between them is the
// CSR record of csr.cuh; the extension keeps no state between calls.
#include <tuple>

#include "csr.cuh"
#include "torch_glue.h"

namespace {

using sparse_llm_glue::bf16_mut_ptr;
using sparse_llm_glue::bf16_ptr;
using sparse_llm_glue::check_cuda;
using sparse_llm_glue::check_matrix;
using sparse_llm_glue::current_stream;

void check_weights(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd) {
  check_matrix(x, "x");
  check_matrix(wg, "wg");
  check_matrix(wu, "wu");
  check_matrix(wd, "wd");
  const int64_t dim = x.size(1), hidden = wg.size(0);
  TORCH_CHECK(wg.size(1) == dim && wu.sizes() == wg.sizes() && wd.size(0) == dim && wd.size(1) == hidden,
              "weights must be wg, wu: [H, D] and wd: [D, H] with D = x.size(1)");
  TORCH_CHECK(dim % 8 == 0 && dim <= sparse_llm::kMaxTrainDim, "D must be a multiple of 8 and at most ",
              sparse_llm::kMaxTrainDim, ", got ", dim);
  TORCH_CHECK(hidden % 8 == 0, "H must be a multiple of 8, got ", hidden);
}

void check_record(const at::Tensor& x, const at::Tensor& nnz, const at::Tensor& cols, const at::Tensor& a_vals,
                  const at::Tensor& u_vals) {
  TORCH_CHECK(nnz.is_cuda() && nnz.scalar_type() == at::kLong && nnz.dim() == 1 && nnz.size(0) == x.size(0) &&
                  nnz.is_contiguous(),
              "nnz_per_token must be a contiguous int64 CUDA tensor of M elements");
  TORCH_CHECK(cols.is_cuda() && cols.scalar_type() == at::kInt && cols.dim() == 1 && cols.is_contiguous(),
              "cols must be a contiguous int32 CUDA vector");
  for (const at::Tensor* t : {&a_vals, &u_vals})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kBFloat16 && t->sizes() == cols.sizes() && t->is_contiguous(),
                "a_vals and u_vals must be contiguous bf16 CUDA vectors shaped like cols");
}

// row_ptr [M + 1] int64 = exclusive prefix sum of the row counts.
at::Tensor row_offsets(const at::Tensor& nnz) {
  at::Tensor ptr = at::zeros({nnz.size(0) + 1}, nnz.options());
  at::Tensor tail = ptr.narrow(0, 1, nnz.size(0));
  if (nnz.size(0) > 0) at::cumsum_out(tail, nnz, 0);
  return ptr;
}

// The split of the rows between the sparse kernels and the dense path: rows with more than
// heavy_threshold active units are heavy. `list` holds the heavy rows' indices, in order.
struct RowSplit {
  at::Tensor row_ptr;  // [M + 1] int64
  at::Tensor heavy;    // [M] bool
  at::Tensor list;     // [n_heavy] int64
  int64_t total = 0;   // active entries
  int64_t n_heavy = 0;
};

// The host reads the two sizes (entries, heavy rows) in one copy: they size the record and the
// dense path's GEMMs.
RowSplit split_rows(const at::Tensor& nnz, int64_t heavy_threshold, cudaStream_t stream) {
  RowSplit split;
  const int64_t rows = nnz.size(0);
  split.row_ptr = row_offsets(nnz);
  split.heavy = nnz.gt(heavy_threshold);
  const at::Tensor pos = at::cumsum(split.heavy, 0, at::kInt);
  at::Tensor list = at::empty({rows}, nnz.options());
  if (rows > 0)
    check_cuda(sparse_llm::launch_compact_rows(reinterpret_cast<const uint8_t*>(split.heavy.data_ptr<bool>()),
                                               pos.data_ptr<int32_t>(), rows, list.data_ptr<int64_t>(), stream),
               "compact_rows");
  const at::Tensor sizes =
      rows > 0 ? at::stack({split.row_ptr[rows], pos[rows - 1].to(at::kLong)}).cpu() : at::zeros({2}, at::kLong);
  split.total = sizes[0].item<int64_t>();
  split.n_heavy = sizes[1].item<int64_t>();
  split.list = list.narrow(0, 0, split.n_heavy);
  return split;
}

const uint8_t* heavy_ptr(const RowSplit& split) {
  return reinterpret_cast<const uint8_t*>(split.heavy.data_ptr<bool>());
}

// (y, l1, nnz_per_token, fire_counts, cols, a_vals, u_vals, heavy_rows): the outputs of the
// reference op, with the record in the layout of csr.cuh, plus the heavy rows' indices (they size
// the backward's GEMMs, so it needs no host read). Light rows go through the CSR kernels; heavy
// rows through GEMMs on the gathered rows, whose u values are copied into the record.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
ffn_train_forward(
    const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd, int64_t heavy_threshold) {
  check_weights(x, wg, wu, wd);
  TORCH_CHECK(heavy_threshold >= 0, "heavy_threshold must be >= 0");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream();
  const int64_t rows = x.size(0);
  const int dim = static_cast<int>(x.size(1));
  const int hidden = static_cast<int>(wg.size(0));

  const at::Tensor g = at::mm(x, wg.t());
  at::Tensor nnz = at::empty({rows}, x.options().dtype(at::kLong));
  check_cuda(sparse_llm::launch_csr_count(bf16_ptr(g), rows, hidden, nnz.data_ptr<int64_t>(), stream), "csr_count");
  // Launched before the host read of the sizes, so that the GPU has them queued meanwhile.
  const at::Tensor wd_t = sparse_llm_glue::transpose_bf16(wd);
  at::Tensor fire = at::zeros({hidden}, x.options().dtype(at::kInt));
  at::Tensor y = at::empty_like(x);
  const RowSplit split = split_rows(nnz, heavy_threshold, stream);
  const int64_t* row_ptr = split.row_ptr.data_ptr<int64_t>();

  at::Tensor cols = at::empty({split.total}, x.options().dtype(at::kInt));
  at::Tensor a_vals = at::empty({split.total}, x.options());
  at::Tensor u_vals = at::empty({split.total}, x.options());
  check_cuda(sparse_llm::launch_csr_fill(bf16_ptr(g), rows, hidden, row_ptr, cols.data_ptr<int32_t>(),
                                         bf16_mut_ptr(a_vals), fire.data_ptr<int32_t>(), stream),
             "csr_fill");
  check_cuda(sparse_llm::launch_csr_updown(bf16_ptr(x), bf16_ptr(wu), bf16_ptr(wd_t), row_ptr,
                                           cols.data_ptr<int32_t>(), bf16_ptr(a_vals), heavy_ptr(split), rows, dim,
                                           bf16_mut_ptr(u_vals), bf16_mut_ptr(y), stream),
             "csr_updown");
  if (split.n_heavy > 0) {
    at::Tensor u = at::mm(sparse_llm_glue::gather_rows_padded(x, split.list), wu.t());  // [padded, H]; then h
    check_cuda(sparse_llm::launch_csr_gather_rows(bf16_ptr(u), split.list.data_ptr<int64_t>(), split.n_heavy, hidden,
                                                  row_ptr, cols.data_ptr<int32_t>(), bf16_mut_ptr(u_vals), stream),
               "csr_gather_rows");
    check_cuda(sparse_llm::launch_gate_mul_rows(bf16_ptr(g), split.list.data_ptr<int64_t>(), split.n_heavy, hidden,
                                                bf16_mut_ptr(u), stream),
               "gate_mul_rows");
    y.index_copy_(0, split.list, at::mm(u, wd_t).narrow(0, 0, split.n_heavy));
  }
  // l1 = mean over rows of sum |h|, with h = a * u in fp32 as the kernels use it.
  const at::Tensor l1 = rows > 0 ? (a_vals.to(at::kFloat) * u_vals.to(at::kFloat)).abs().sum() / static_cast<double>(rows)
                                 : at::zeros({}, x.options().dtype(at::kFloat));
  return {y, l1, nnz, fire.to(at::kLong), cols, a_vals, u_vals, split.list};
}

// (dx, dWg, dWu, dWd) of <grad_y, y> + grad_l1 * l1, from the forward's record. Light rows: the
// per-row kernel (dh, dg, du, dx) and the per-unit kernel (weight gradients); heavy rows: GEMMs on
// the gathered rows, added to the weight gradients.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ffn_train_backward(
    const at::Tensor& grad_y, const at::Tensor& grad_l1, const at::Tensor& x, const at::Tensor& wg,
    const at::Tensor& wu, const at::Tensor& wd, const at::Tensor& nnz, const at::Tensor& cols,
    const at::Tensor& a_vals, const at::Tensor& u_vals, const at::Tensor& heavy_rows) {
  check_weights(x, wg, wu, wd);
  check_matrix(grad_y, "grad_y");
  TORCH_CHECK(grad_y.sizes() == x.sizes(), "grad_y must be shaped like x");
  TORCH_CHECK(grad_l1.is_cuda() && grad_l1.numel() == 1, "grad_l1 must be a one-element CUDA tensor");
  check_record(x, nnz, cols, a_vals, u_vals);
  TORCH_CHECK(heavy_rows.is_cuda() && heavy_rows.scalar_type() == at::kLong && heavy_rows.dim() == 1 &&
                  heavy_rows.is_contiguous(),
              "heavy_rows must be a contiguous int64 CUDA vector");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream();
  const int64_t rows = x.size(0);
  const int64_t total = cols.size(0);
  const int64_t n_heavy = heavy_rows.size(0);
  const int dim = static_cast<int>(x.size(1));
  const int hidden = static_cast<int>(wg.size(0));

  const at::Tensor row_ptr_t = row_offsets(nnz);
  const int64_t* row_ptr = row_ptr_t.data_ptr<int64_t>();
  const at::Tensor heavy = at::zeros({rows}, nnz.options().dtype(at::kBool)).index_fill_(0, heavy_rows, true);
  const uint8_t* heavy_mask = reinterpret_cast<const uint8_t*>(heavy.data_ptr<bool>());
  const at::Tensor wd_t = sparse_llm_glue::transpose_bf16(wd);
  const at::Tensor l1_grad = grad_l1.to(at::kFloat).reshape({1}).contiguous();
  at::Tensor dg = at::empty({total}, x.options().dtype(at::kFloat));
  at::Tensor du = at::empty({total}, x.options().dtype(at::kFloat));
  at::Tensor dx = at::empty_like(x);
  check_cuda(sparse_llm::launch_csr_backward_rows(bf16_ptr(grad_y), bf16_ptr(wg), bf16_ptr(wu), bf16_ptr(wd_t), row_ptr,
                                                  cols.data_ptr<int32_t>(), bf16_ptr(a_vals), bf16_ptr(u_vals),
                                                  heavy_mask, l1_grad.data_ptr<float>(), rows, dim,
                                                  dg.data_ptr<float>(), du.data_ptr<float>(), bf16_mut_ptr(dx), stream),
             "csr_backward_rows");

  // Column order of the light rows' entries (stable: rows ascending within a unit) and each
  // unit's range; heavy rows' entries get the key H, past every unit.
  const at::Tensor entry_rows = at::repeat_interleave(at::arange(rows, nnz.options()), nnz, /*dim=*/0, total);
  const at::Tensor keys = at::where(heavy.index_select(0, entry_rows), hidden, cols);
  const auto [sorted_keys, order] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor unit_ptr =
      at::searchsorted(sorted_keys, at::arange(hidden + 1, cols.options()), /*out_int32=*/false, /*right=*/false);
  const at::Tensor csc_rows = entry_rows.index_select(0, order).to(at::kInt);
  const at::Tensor csc_entry = order.to(at::kInt);

  at::Tensor dwg = at::empty_like(wg);
  at::Tensor dwu = at::empty_like(wu);
  at::Tensor dwd_t = at::empty({hidden, dim}, wd.options());
  check_cuda(sparse_llm::launch_csr_backward_units(bf16_ptr(x), bf16_ptr(grad_y), unit_ptr.data_ptr<int64_t>(),
                                                   csc_rows.data_ptr<int32_t>(), csc_entry.data_ptr<int32_t>(),
                                                   dg.data_ptr<float>(), du.data_ptr<float>(), bf16_ptr(a_vals),
                                                   bf16_ptr(u_vals), hidden, dim, bf16_mut_ptr(dwg),
                                                   bf16_mut_ptr(dwu), bf16_mut_ptr(dwd_t), stream),
             "csr_backward_units");

  if (n_heavy > 0) {
    // Padded rows (kHeavyRowsGranule) are zero in x_h, gy_h, a_h and u_h: they add nothing.
    const at::Tensor x_h = sparse_llm_glue::gather_rows_padded(x, heavy_rows);
    const at::Tensor gy_h = sparse_llm_glue::gather_rows_padded(grad_y, heavy_rows);
    const int64_t padded = x_h.size(0);
    at::Tensor a_h = at::zeros({padded, hidden}, x.options());  // then du
    at::Tensor u_h = at::zeros({padded, hidden}, x.options());  // then h
    check_cuda(sparse_llm::launch_csr_scatter_rows(heavy_rows.data_ptr<int64_t>(), n_heavy, hidden, row_ptr,
                                                   cols.data_ptr<int32_t>(), bf16_ptr(a_vals), bf16_ptr(u_vals),
                                                   bf16_mut_ptr(a_h), bf16_mut_ptr(u_h), stream),
               "csr_scatter_rows");
    at::Tensor dh = at::mm(gy_h, wd);  // then dg
    check_cuda(sparse_llm::launch_heavy_backward_elementwise(n_heavy, hidden, l1_grad.data_ptr<float>(), rows,
                                                             bf16_mut_ptr(dh), bf16_mut_ptr(a_h), bf16_mut_ptr(u_h),
                                                             stream),
               "heavy_backward_elementwise");
    at::Tensor dx_h = at::mm(dh, wg);
    dx_h.addmm_(a_h, wu);
    dx.index_copy_(0, heavy_rows, dx_h.narrow(0, 0, n_heavy));
    dwg.addmm_(dh.t(), x_h);
    dwu.addmm_(a_h.t(), x_h);
    dwd_t.addmm_(u_h.t(), gy_h);
  }
  return {dx, dwg, dwu, sparse_llm_glue::transpose_bf16(dwd_t)};
}

}  // namespace

void register_train_ops(pybind11::module_& m) {
  m.def("ffn_train_forward", &ffn_train_forward,
        "exact sparse training forward: (y, l1, nnz_per_token, fire_counts, cols, a_vals, u_vals, heavy_rows); "
        "rows with more than heavy_threshold active units take the dense path");
  m.def("ffn_train_backward", &ffn_train_backward,
        "exact sparse training backward from the forward's record and heavy rows: (dx, dWg, dWu, dWd)");
}
