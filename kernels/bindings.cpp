// Torch bindings of the TwELL inference kernels. Every buffer is a torch allocation made here or
// passed in: the extension keeps no state between calls.
#include <tuple>

#include "gate_gemm.h"
#include "kv_cache.cuh"
#include "torch_glue.h"
#include "twell.cuh"

namespace {

using sparse_llm::kTwellSlots;

using sparse_llm_glue::bf16_mut_ptr;
using sparse_llm_glue::bf16_ptr;
using sparse_llm_glue::check_cuda;
using sparse_llm_glue::check_matrix;

using TwellPack = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// (values, cols, counts, row_nnz, heavy), allocated for the pack of an [rows, hidden] matrix.
TwellPack empty_pack(const at::Tensor& like, int64_t rows, int hidden) {
  const int n_tiles = sparse_llm::twell_n_tiles(hidden);
  auto opts = like.options();
  return {at::empty({rows, n_tiles, kTwellSlots}, opts), at::empty({rows, n_tiles, kTwellSlots}, opts.dtype(at::kByte)),
          at::empty({rows, n_tiles}, opts.dtype(at::kInt)), at::empty({rows}, opts.dtype(at::kInt)),
          at::empty({rows}, opts.dtype(at::kBool))};
}

void check_pack_args(const at::Tensor& g, int64_t heavy_threshold) {
  check_matrix(g, "g");
  SL_CHECK_ARG(g.size(1) % 8 == 0, "g: H must be a multiple of 8, got ", g.size(1));
  SL_CHECK_ARG(heavy_threshold >= 0, "heavy_threshold must be >= 0");
}

TwellPack twell_pack(const at::Tensor& g, int64_t heavy_threshold) {
  check_pack_args(g, heavy_threshold);
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t rows = g.size(0);
  const int hidden = static_cast<int>(g.size(1));
  auto pack = empty_pack(g, rows, hidden);
  auto& [values, cols, counts, row_nnz, heavy] = pack;
  check_cuda(sparse_llm::launch_twell_pack(bf16_ptr(g), rows, hidden, static_cast<int>(heavy_threshold),
                                           bf16_mut_ptr(values), cols.data_ptr<uint8_t>(),
                                           counts.data_ptr<int32_t>(), row_nnz.data_ptr<int32_t>(),
                                           reinterpret_cast<uint8_t*>(heavy.data_ptr<bool>()),
                                           c10::cuda::getCurrentCUDAStream().stream()),
             "twell_pack");
  return pack;
}

// The pack of a = relu(g) from a and the gate GEMM's bit mask (see gate_gemm.h).
TwellPack twell_pack_masked(const at::Tensor& a, const at::Tensor& mask, int64_t heavy_threshold) {
  check_pack_args(a, heavy_threshold);
  const int64_t rows = a.size(0);
  const int hidden = static_cast<int>(a.size(1));
  SL_CHECK_ARG(mask.is_cuda() && mask.scalar_type() == at::kInt && mask.is_contiguous() &&
                   mask.sizes() == at::IntArrayRef({rows, 4 * sparse_llm::twell_n_tiles(hidden)}),
               "mask must be a contiguous int32 CUDA tensor of [M, 4 * ceil(H / 128)]");
  const c10::cuda::CUDAGuard guard(a.device());
  auto pack = empty_pack(a, rows, hidden);
  auto& [values, cols, counts, row_nnz, heavy] = pack;
  check_cuda(sparse_llm::launch_twell_pack_masked(
                 bf16_ptr(a), reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>()), rows, hidden,
                 static_cast<int>(heavy_threshold), bf16_mut_ptr(values), cols.data_ptr<uint8_t>(),
                 counts.data_ptr<int32_t>(), row_nnz.data_ptr<int32_t>(),
                 reinterpret_cast<uint8_t*>(heavy.data_ptr<bool>()), c10::cuda::getCurrentCUDAStream().stream()),
             "twell_pack_masked");
  return pack;
}

// (a, mask) of the gate GEMM with the ReLU bit mask, or None where cuBLASLt offers no algorithm.
std::optional<std::tuple<at::Tensor, at::Tensor>> gate_relu_mask(const at::Tensor& x, const at::Tensor& wg,
                                                                 int64_t algo_index) {
  check_matrix(x, "x");
  check_matrix(wg, "wg");
  SL_CHECK_ARG(wg.size(1) == x.size(1), "wg must be [H, D] with D = x.size(1)");
  auto gate = sparse_llm_glue::gate_relu_mask(x, wg, static_cast<int>(algo_index));
  if (!gate) return std::nullopt;
  return std::make_tuple(gate->a, gate->mask);
}

// Sparse path into y (or added into y) for the light rows; heavy rows of y are left as they are.
void twell_updown_into(const at::Tensor& x, const at::Tensor& wu, const at::Tensor& wd_t, const at::Tensor& values,
                       const at::Tensor& cols, const at::Tensor& counts, const at::Tensor& row_nnz,
                       const at::Tensor& heavy, int64_t max_row_nnz, bool accumulate, at::Tensor& y) {
  check_matrix(x, "x");
  check_matrix(wu, "wu");
  check_matrix(wd_t, "wd_t");
  check_matrix(y, "y");
  const int64_t rows = x.size(0);
  const int64_t dim = x.size(1);
  SL_CHECK_ARG(wu.size(1) == dim && wd_t.size(1) == dim && wu.size(0) == wd_t.size(0),
               "wu and wd_t must both be [H, D] with D = x.size(1)");
  SL_CHECK_ARG(y.size(0) == rows && y.size(1) == dim, "y must be [M, D]");
  const int n_tiles = sparse_llm::twell_n_tiles(static_cast<int>(wu.size(0)));
  SL_CHECK_ARG(values.is_contiguous() && values.scalar_type() == at::kBFloat16 &&
                   values.sizes() == at::IntArrayRef({rows, n_tiles, kTwellSlots}),
               "values must be contiguous bf16 [M, n_tiles, slots]");
  SL_CHECK_ARG(cols.is_contiguous() && cols.scalar_type() == at::kByte && cols.sizes() == values.sizes(),
               "cols must be contiguous uint8 shaped like values");
  SL_CHECK_ARG(counts.is_contiguous() && counts.scalar_type() == at::kInt &&
                   counts.sizes() == at::IntArrayRef({rows, n_tiles}),
               "counts must be contiguous int32 [M, n_tiles]");
  SL_CHECK_ARG(row_nnz.is_contiguous() && row_nnz.scalar_type() == at::kInt && row_nnz.numel() == rows,
               "row_nnz must be a contiguous int32 [M]");
  SL_CHECK_ARG(heavy.is_contiguous() && heavy.scalar_type() == at::kBool && heavy.numel() == rows,
               "heavy must be a contiguous bool [M]");
  const c10::cuda::CUDAGuard guard(x.device());
  sparse_llm::TwellView view{bf16_ptr(values), cols.data_ptr<uint8_t>(), counts.data_ptr<int32_t>(),
                             row_nnz.data_ptr<int32_t>(), n_tiles};
  check_cuda(sparse_llm::launch_twell_updown(bf16_ptr(x), bf16_ptr(wu), bf16_ptr(wd_t), view,
                                             reinterpret_cast<const uint8_t*>(heavy.data_ptr<bool>()), rows,
                                             static_cast<int>(dim), static_cast<int>(max_row_nnz), accumulate,
                                             bf16_mut_ptr(y), c10::cuda::getCurrentCUDAStream().stream()),
             "twell_updown");
}

at::Tensor twell_updown(const at::Tensor& x, const at::Tensor& wu, const at::Tensor& wd_t, const at::Tensor& values,
                        const at::Tensor& cols, const at::Tensor& counts, const at::Tensor& row_nnz,
                        const at::Tensor& heavy, int64_t max_row_nnz) {
  at::Tensor y = at::empty_like(x);
  twell_updown_into(x, wu, wd_t, values, cols, counts, row_nnz, heavy, max_row_nnz, /*accumulate=*/false, y);
  return y;
}

at::Tensor transpose(const at::Tensor& t) { return sparse_llm_glue::transpose_bf16(t); }

// From this many rows on, the gate GEMM with the ReLU bit mask plus the masked pack beat plain
// cuBLAS plus the dense pack (H200, D = 2048, H = 5632, ms: 4.49 vs 4.63 at 122880 rows and 0.2
// non-zeros per token, 4.59 vs 4.67 at 30; below, cuBLASLt's ReLU-aux kernels lose more than the
// pack saves: 0.65 vs 0.58 at 16384 rows). Either way the result is exact.
constexpr int64_t kMaskedGateMinRows = 65536;

// The whole inference FFN into y (y = ffn(x), or y += ffn(x) with `accumulate`): gate GEMM
// (cuBLASLt with the ReLU bit mask, else cuBLAS), TwELL pack, sparse up/down for the light rows
// and dense GEMMs on the gathered heavy rows: exact for any pattern. The heavy-row count sizes
// those GEMMs, so the host reads it, while the sparse kernel keeps the GPU busy.
void ffn_forward_into(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                      const c10::optional<at::Tensor>& cached_wd_t, int64_t heavy_threshold, bool accumulate,
                      at::Tensor& y) {
  check_matrix(x, "x");
  check_matrix(wg, "wg");
  check_matrix(wd, "wd");
  check_matrix(y, "y");
  SL_CHECK_ARG(y.sizes() == x.sizes(), "y must be shaped like x");
  SL_CHECK_ARG(wg.sizes() == wu.sizes(), "wg and wu must have the same shape [H, D]");
  SL_CHECK_ARG(heavy_threshold >= 0 && heavy_threshold <= sparse_llm::kMaxLightRowNnz,
               "heavy_threshold must be in [0, ", sparse_llm::kMaxLightRowNnz, "]");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t rows = x.size(0);
  const int hidden = static_cast<int>(wg.size(0));
  if (rows == 0) return;
  const at::Tensor wd_t = cached_wd_t.has_value() ? *cached_wd_t : transpose(wd);
  // g: relu(x @ wg^T) on the masked path, x @ wg^T otherwise; the heavy rows' gate takes relu(g).
  at::Tensor g;
  TwellPack pack;
  std::optional<sparse_llm_glue::GateWithMask> gate;
  if (rows >= kMaskedGateMinRows) gate = sparse_llm_glue::gate_relu_mask(x, wg);
  if (gate) {
    g = gate->a;
    pack = twell_pack_masked(g, gate->mask, heavy_threshold);
  } else {
    g = at::mm(x, wg.t());
    pack = twell_pack(g, heavy_threshold);
  }
  auto& [values, cols, counts, row_nnz, heavy] = pack;

  const at::Tensor pos = at::cumsum(heavy, 0, at::kInt);
  at::Tensor heavy_list = at::empty({rows}, x.options().dtype(at::kLong));
  check_cuda(sparse_llm::launch_compact_rows(reinterpret_cast<const uint8_t*>(heavy.data_ptr<bool>()),
                                             pos.data_ptr<int32_t>(), rows, heavy_list.data_ptr<int64_t>(), stream),
             "compact_rows");
  sparse_llm_glue::EarlyHostRead heavy_count(pos.narrow(0, rows - 1, 1), stream);
  twell_updown_into(x, wu, wd_t, values, cols, counts, row_nnz, heavy, heavy_threshold, accumulate, y);
  const int64_t n_heavy = heavy_count.values().data_ptr<int32_t>()[0];
  if (n_heavy > 0) {
    const at::Tensor heavy_rows = heavy_list.narrow(0, 0, n_heavy);
    at::Tensor h = at::mm(sparse_llm_glue::gather_rows_padded(x, heavy_rows), wu.t());  // u, then h in place
    check_cuda(sparse_llm::launch_gate_mul_rows(bf16_ptr(g), heavy_list.data_ptr<int64_t>(), /*count=*/nullptr,
                                                n_heavy, hidden, bf16_ptr(h), bf16_mut_ptr(h), stream),
               "gate_mul_rows");
    const at::Tensor y_heavy = at::mm(h, wd_t).narrow(0, 0, n_heavy);
    if (accumulate)
      y.index_add_(0, heavy_rows, y_heavy);  // unique rows: one bf16 rounding of the sum, as an add
    else
      y.index_copy_(0, heavy_rows, y_heavy);
  }
}

at::Tensor ffn_forward(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                       const c10::optional<at::Tensor>& cached_wd_t, int64_t heavy_threshold) {
  at::Tensor y = at::empty_like(x);
  ffn_forward_into(x, wg, wu, wd, cached_wd_t, heavy_threshold, /*accumulate=*/false, y);
  return y;
}

// out += ffn(x) in place: rows with no active unit are not touched at all. out: [..., D]
// contiguous, x: [M, D] with M = out's rows.
void ffn_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
              const c10::optional<at::Tensor>& cached_wd_t, int64_t heavy_threshold) {
  SL_CHECK_ARG(out.dim() >= 1 && out.is_contiguous(), "out must be contiguous");
  at::Tensor out_rows = out.view({-1, out.size(-1)});
  ffn_forward_into(x, wg, wu, wd, cached_wd_t, heavy_threshold, /*accumulate=*/true, out_rows);
}

// k_cache[layer, b, c:c + T] = rope(k[b]) and v_cache[...] = v[b], in place (kv_cache.cuh), with
// c = start for every row, or c = columns[b] (int64 [B] on the device, start 0: no host read; the
// caller keeps them in range, and a row whose columns fall outside the cache is never written).
// Caches: [layers, B, max_len, heads, head_dim], contiguous; k, v: [B, T, heads, head_dim] with
// the same strides, contiguous but for the token stride (e.g. views of one q|k|v tensor);
// cos, sin: T x head_dim values shared by the rows or B x T x head_dim, contiguous; all bf16.
void write_rope(at::Tensor& k_cache, at::Tensor& v_cache, int64_t layer, int64_t start,
                const std::optional<at::Tensor>& columns, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& cos, const at::Tensor& sin) {
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&k_cache, "k_cache"}, {&v_cache, "v_cache"},
                                {&k, "k"}, {&v, "v"}, {&cos, "cos"}, {&sin, "sin"}})
    SL_CHECK_ARG(t->is_cuda() && t->scalar_type() == at::kBFloat16, name, " must be a bf16 CUDA tensor");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &v_cache, &cos, &sin})
    SL_CHECK_ARG(t->is_contiguous(), "the caches, cos and sin must be contiguous");
  SL_CHECK_ARG(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes(),
               "k_cache and v_cache must both be [layers, B, max_len, heads, head_dim]");
  const int64_t batch = k_cache.size(1), max_len = k_cache.size(2), heads = k_cache.size(3), head_dim = k_cache.size(4);
  SL_CHECK_ARG(k.dim() == 4 && k.size(0) == batch && k.size(2) == heads && k.size(3) == head_dim && v.sizes() == k.sizes(),
               "k and v must be [B, T, heads, head_dim] matching the cache, got ", k.sizes(), " and ", v.sizes());
  const int64_t token_stride = k.stride(1);
  SL_CHECK_ARG(k.strides() == v.strides() && k.stride(3) == 1 && k.stride(2) == head_dim &&
                   k.stride(0) == k.size(1) * token_stride && token_stride >= heads * head_dim && token_stride % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0,
               "k and v must share 16-byte aligned strides, contiguous but for the token stride, got ", k.strides(),
               " and ", v.strides());
  const int64_t tokens = k.size(1);
  SL_CHECK_ARG(layer >= 0 && layer < k_cache.size(0), "layer ", layer, " out of range");
  SL_CHECK_ARG(start >= 0 && start + tokens <= max_len, "columns [", start, ", ", start + tokens,
               ") exceed the cache's ", max_len);
  SL_CHECK_ARG(!columns.has_value() || (columns->is_cuda() && columns->device() == k.device() &&
                                        columns->scalar_type() == at::kLong && columns->dim() == 1 &&
                                        columns->size(0) == batch && columns->is_contiguous()),
               "columns must be a contiguous int64 vector of B = ", batch, " start columns on k's device");
  SL_CHECK_ARG(head_dim % 16 == 0, "head_dim must be a multiple of 16, got ", head_dim);
  const bool shared = cos.numel() == tokens * head_dim;
  SL_CHECK_ARG((shared || cos.numel() == batch * tokens * head_dim) && sin.sizes() == cos.sizes(),
               "cos and sin must hold T x head_dim or B x T x head_dim values");
  const c10::cuda::CUDAGuard guard(k.device());
  const int64_t layer_offset = layer * batch * max_len * heads * head_dim + start * heads * head_dim;
  check_cuda(sparse_llm::launch_kv_cache_write_rope(
                 bf16_ptr(k), bf16_ptr(v), token_stride, bf16_ptr(cos), bf16_ptr(sin), shared ? 0 : tokens * head_dim, batch,
                 tokens, static_cast<int>(heads), static_cast<int>(head_dim),
                 columns.has_value() ? columns->data_ptr<int64_t>() : nullptr, max_len,
                 bf16_mut_ptr(k_cache) + layer_offset, bf16_mut_ptr(v_cache) + layer_offset, max_len * heads * head_dim,
                 c10::cuda::getCurrentCUDAStream().stream()),
             "kv_cache_write_rope");
}

void kv_cache_write_rope(at::Tensor& k_cache, at::Tensor& v_cache, int64_t layer, int64_t start, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin) {
  write_rope(k_cache, v_cache, layer, start, std::nullopt, k, v, cos, sin);
}

void kv_cache_write_rope_columns(at::Tensor& k_cache, at::Tensor& v_cache, int64_t layer, const at::Tensor& columns,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                 const at::Tensor& sin) {
  write_rope(k_cache, v_cache, layer, 0, columns, k, v, cos, sin);
}

}  // namespace

// The training ops (train_bindings.cpp), the loss's (loss_bindings.cpp), the activation counts
// (counts_bindings.cpp), the decode FFN (decode_bindings.cpp) and design 2's tile plan (tile_bindings.cpp).
void register_train_ops(pybind11::module_& m);
void register_decode_ops(pybind11::module_& m);
void register_loss_ops(pybind11::module_& m);
void register_count_ops(pybind11::module_& m);
void register_tile_ops(pybind11::module_& m);

// Every function goes through guarded (errors.h): a failed check raises a Python exception.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using sparse_llm_glue::guarded;
  m.doc() = "sparse-llm TwELL inference and training kernels (Hopper)";
  m.def("twell_pack", guarded<&twell_pack>,
        "pack relu(g) into TwELL; returns (values, cols, counts, row_nnz, heavy)");
  m.def("twell_pack_masked", guarded<&twell_pack_masked>, "twell_pack of a = relu(g) from a and its ReLU bit mask");
  m.def("gate_relu_mask", guarded<&gate_relu_mask>, "(relu(x @ wg^T), ReLU bit mask) by cuBLASLt, or None",
        pybind11::arg("x"), pybind11::arg("wg"), pybind11::arg("algo_index") = 0);
  m.def("twell_updown", guarded<&twell_updown>, "sparse gated up/down projection of the light rows");
  m.def("ffn_forward", guarded<&ffn_forward>, "exact TwELL inference FFN; wd_t (Wd^T) may be None");
  m.def("ffn_add_", guarded<&ffn_add_>,
        "out += the exact TwELL inference FFN of x, in place; wd_t (Wd^T) may be None");
  m.def("transpose", guarded<&transpose>, "bf16 matrix transpose");
  m.attr("masked_gate_min_rows") = kMaskedGateMinRows;
  m.def("kv_cache_write_rope", guarded<&kv_cache_write_rope>,
        "rope(k) and v into the KV cache's columns [start, start + T)");
  m.def("kv_cache_write_rope_columns", guarded<&kv_cache_write_rope_columns>,
        "rope(k) and v into the KV cache, row b at columns [columns[b], columns[b] + T), no host read");
  register_train_ops(m);
  register_loss_ops(m);
  register_count_ops(m);
  register_decode_ops(m);
  register_tile_ops(m);
}
