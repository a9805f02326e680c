// Torch bindings of the training kernels: the FFN training forward (gate GEMM, CSR pack, sparse
// up/down) and backward (per-row and per-unit kernels), with heavy rows on a dense GEMM path. The
// records passed between them are the CSR records of csr.cuh (one for the light rows, one for the
// heavy rows); the extension keeps no state between calls.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>
#include <limits>
#include <optional>
#include <tuple>

#include "csr.cuh"
#include "torch_glue.h"

namespace {

using sparse_llm_glue::bf16_mut_ptr;
using sparse_llm_glue::bf16_ptr;
using sparse_llm_glue::check_cuda;
using sparse_llm_glue::check_matrix;
using sparse_llm_glue::current_stream;

void check_weights(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                   at::ScalarType weight_dtype = at::kBFloat16) {
  check_matrix(x, "x");
  check_matrix(wg, "wg", weight_dtype);
  check_matrix(wu, "wu", weight_dtype);
  check_matrix(wd, "wd", weight_dtype);
  const int64_t dim = x.size(1), hidden = wg.size(0);
  SL_CHECK_ARG(wg.size(1) == dim && wu.sizes() == wg.sizes() && wd.size(0) == dim && wd.size(1) == hidden,
               "weights must be wg, wu: [H, D] and wd: [D, H] with D = x.size(1)");
  SL_CHECK_ARG(dim % 8 == 0 && dim <= sparse_llm::kMaxTrainDim, "D must be a multiple of 8 and at most ",
               sparse_llm::kMaxTrainDim, ", got ", dim);
  SL_CHECK_ARG(hidden % 8 == 0, "H must be a multiple of 8, got ", hidden);
  SL_CHECK_ARG(hidden <= sparse_llm::kMaxColumnSortHidden, "H must be at most ", sparse_llm::kMaxColumnSortHidden,
               ", got ", hidden);
}

void check_record(const at::Tensor& x, const at::Tensor& nnz, const at::Tensor& cols, const at::Tensor& a_vals,
                  const at::Tensor& u_vals) {
  SL_CHECK_ARG(nnz.is_cuda() && nnz.scalar_type() == at::kLong && nnz.dim() == 1 && nnz.size(0) == x.size(0) &&
                   nnz.is_contiguous(),
               "nnz_per_token must be a contiguous int64 CUDA tensor of M elements");
  SL_CHECK_ARG(cols.is_cuda() && cols.scalar_type() == at::kInt && cols.dim() == 1 && cols.is_contiguous(),
               "cols must be a contiguous int32 CUDA vector");
  for (const at::Tensor* t : {&a_vals, &u_vals})
    SL_CHECK_ARG(t->is_cuda() && t->scalar_type() == at::kBFloat16 && t->sizes() == cols.sizes() && t->is_contiguous(),
                 "a_vals and u_vals must be contiguous bf16 CUDA vectors shaped like cols");
}

// Rows with more than heavy_threshold active units are heavy (the dense path owns them), the
// others light; each kind's record has its own row offsets (csr.cuh). Two launches
// (launch_csr_split_rows) make all of it.
struct RowSplit {
  at::Tensor heavy;        // [M] bool
  at::Tensor light_ptr;    // [M + 1] int64, heavy rows empty
  at::Tensor heavy_ptr;    // [M + 1] int64, light rows empty
  at::Tensor heavy_rows;   // forward only: [M] int64, the heavy rows in order, then unspecified
  at::Tensor active_rows;  // forward only: [M] int64, the rows with an active unit in order, then unspecified
  at::Tensor sizes;        // forward only: [5] int64: light entries, heavy rows, heavy entries, active rows, then
                           // the dense units (written by light_pass)
};

// The training forward queues the dense path of its first heavy_gemm_rows(M / kEarlyHeavyRowsPer)
// heavy rows before its host read (see there).
constexpr int64_t kEarlyHeavyRowsPer = 64;

const uint8_t* mask_ptr(const at::Tensor& heavy) { return reinterpret_cast<const uint8_t*>(heavy.data_ptr<bool>()); }

// heavy_list undefined: the forward's split by threshold, with its lists and sizes; else the
// backward's, from the forward's heavy rows.
RowSplit split_rows(const at::Tensor& nnz, int64_t threshold, const at::Tensor& heavy_list, cudaStream_t stream) {
  const int64_t rows = nnz.size(0);
  const bool forward = !heavy_list.defined();
  RowSplit split{at::empty({rows}, nnz.options().dtype(at::kBool)), at::empty({rows + 1}, nnz.options()),
                 at::empty({rows + 1}, nnz.options())};
  if (forward) {
    split.heavy_rows = at::empty({rows}, nnz.options());
    split.active_rows = at::empty({rows}, nnz.options());
    split.sizes = at::empty({5}, nnz.options());
  }
  const auto optional_ptr = [](at::Tensor& t) { return t.defined() ? t.data_ptr<int64_t>() : nullptr; };
  const sparse_llm::RowSplitView view{reinterpret_cast<uint8_t*>(split.heavy.data_ptr<bool>()),
                                      split.light_ptr.data_ptr<int64_t>(),
                                      split.heavy_ptr.data_ptr<int64_t>(),
                                      optional_ptr(split.heavy_rows),
                                      optional_ptr(split.active_rows),
                                      optional_ptr(split.sizes)};
  at::Tensor tile_scratch = at::empty({sparse_llm::csr_split_tiles(rows), 4}, nnz.options());
  check_cuda(sparse_llm::launch_csr_split_rows(nnz.data_ptr<int64_t>(), rows, threshold,
                                               forward ? nullptr : heavy_list.data_ptr<int64_t>(),
                                               forward ? 0 : heavy_list.size(0), tile_scratch.data_ptr<int64_t>(),
                                               view, stream),
             "csr_split_rows");
  return split;
}

// out = a @ b (`overwrite`: out is written whole and not read, so it may hold anything before) or
// out += a @ b, in out's dtype: a float out takes the product of bf16 a and b unrounded. An out in
// a's dtype is only overwritten (a sum of products goes through a float out, rounded once).
void add_product(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool overwrite) {
  if (out.scalar_type() != a.scalar_type()) {
    at::addmm_out(out, out, a, b, out.scalar_type(), /*beta=*/overwrite ? 0 : 1, /*alpha=*/1);
    return;
  }
  TORCH_INTERNAL_ASSERT(overwrite, "add_product adds into a float out only");
  at::mm_out(out, a, b);
}

// The heavy rows' dense path on the rows list[0, n), or on the first min(*count, n) of them where
// count (on the device) is given: u = x[list] @ Wu^T and y[list] = bf16(relu(g[list]) * u) @ Wd^T,
// both GEMMs over `padded` rows (zero past the rows). Returns u ([padded, H]): the heavy record
// takes its values at the rows' entries.
at::Tensor heavy_rows_up_down(const at::Tensor& x, const at::Tensor& g, const at::Tensor& wu, const at::Tensor& wd_t,
                              const at::Tensor& list, const int64_t* count, int64_t n, int64_t padded, at::Tensor& y,
                              cudaStream_t stream) {
  const int64_t* rows = list.data_ptr<int64_t>();
  const at::Tensor u = at::mm(sparse_llm_glue::gather_rows(x, list, n, padded, count), wu.t());
  at::Tensor h = at::empty_like(u);
  check_cuda(sparse_llm::launch_gate_mul_rows(bf16_ptr(g), rows, count, n, static_cast<int>(g.size(1)), bf16_ptr(u),
                                              bf16_mut_ptr(h), stream),
             "gate_mul_rows");
  const at::Tensor y_rows = at::mm(h, wd_t);
  check_cuda(sparse_llm::launch_scatter_rows(y_rows.data_ptr(), rows, count, n, y.size(1) * y.element_size(),
                                             y.data_ptr(), stream),
             "scatter_rows");
  return u;
}

// t[list]: one launch of our gather where t allows it (contiguous, 16-byte rows), else index_select.
at::Tensor rows_of(const at::Tensor& t, const at::Tensor& list) {
  const bool gatherable = t.dim() == 2 && t.is_contiguous() && (t.size(1) * t.element_size()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return gatherable ? sparse_llm_glue::gather_rows(t, list, list.size(0), list.size(0)) : t.index_select(0, list);
}

void check_forward_args(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                        const std::optional<at::Tensor>& keep, int64_t heavy_threshold, int64_t dense_min_fires) {
  check_weights(x, wg, wu, wd);
  SL_CHECK_ARG(heavy_threshold >= 0, "heavy_threshold must be >= 0");
  SL_CHECK_ARG(dense_min_fires >= 0, "dense_min_fires must be >= 0 (0: no dense units), got ", dense_min_fires);
  SL_CHECK_ARG(!keep.has_value() || (keep->dim() == 2 && keep->size(0) == x.size(0) && keep->device() == x.device()),
               "keep must be a 2-D tensor with x's rows, on x's device");
}

// The part of the training forward that needs no size read: the gate GEMM, the count (with the
// fire counts), the split, and the light rows' record and output with their L1 partial sums in
// l1_partial[0, updown_blocks) (the caller sizes it: `extra_l1_slots` more slots for its own).
struct LightPass {
  at::Tensor g;           // [M, H] = x Wg^T
  at::Tensor nnz;         // [M] int64
  at::Tensor fire_long;   // [H] int64
  RowSplit split;         // with the forward's lists and sizes ([5] on the device)
  at::Tensor dense_units;  // [H] int32: the units with dense_min_fires light entries or more, then unspecified
  at::Tensor wd_t;        // [H, D]
  at::Tensor y;           // [M, D]: the light rows written
  at::Tensor cols_cap;    // [M * width]: the light record, room for width entries a row (its most)
  at::Tensor a_cap;
  at::Tensor u_cap;
  at::Tensor l1_partial;  // [updown_blocks + extra_l1_slots] float
  int64_t updown_blocks;
};

// after_split(split) runs right after the split and the dense units are queued (the exact path
// queues its host read there). dense_min_fires: the light rows' fire count from which a unit is a
// dense unit of the backward (0: none).
template <typename AfterSplit>
LightPass light_pass(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                     int64_t heavy_threshold, int64_t dense_min_fires, int64_t extra_l1_slots, cudaStream_t stream,
                     AfterSplit after_split) {
  const int64_t rows = x.size(0);
  const int dim = static_cast<int>(x.size(1));
  const int hidden = static_cast<int>(wg.size(0));
  LightPass pass;
  pass.g = at::mm(x, wg.t());
  pass.nnz = at::empty({rows}, x.options().dtype(at::kLong));
  // Light rows hold at most `width` entries: the count stages that many of every row, so the light
  // record needs no second read of g, and its capacity is known before any host read.
  const int width = static_cast<int>(std::min<int64_t>(heavy_threshold, hidden));
  at::Tensor stage_cols = at::empty({rows * width}, x.options().dtype(at::kInt));
  at::Tensor stage_a = at::empty({rows * width}, x.options());
  at::Tensor fire = at::zeros({hidden}, x.options().dtype(at::kInt));
  check_cuda(sparse_llm::launch_csr_count(bf16_ptr(pass.g), rows, hidden, width, pass.nnz.data_ptr<int64_t>(),
                                          stage_cols.data_ptr<int32_t>(), bf16_mut_ptr(stage_a),
                                          fire.data_ptr<int32_t>(), stream),
             "csr_count");
  pass.split = split_rows(pass.nnz, heavy_threshold, at::Tensor(), stream);
  // The light record, counting each unit's light entries: the dense units are those with many (a
  // unit's entries on heavy rows go through the heavy rows' GEMMs whatever it is).
  const int64_t capacity = rows * width;
  pass.cols_cap = at::empty({capacity}, x.options().dtype(at::kInt));
  pass.a_cap = at::empty({capacity}, x.options());
  pass.u_cap = at::empty({capacity}, x.options());
  const int64_t* light_ptr = pass.split.light_ptr.data_ptr<int64_t>();
  at::Tensor light_fires = at::zeros({hidden}, x.options().dtype(at::kInt));
  check_cuda(sparse_llm::launch_csr_fill_light(stage_cols.data_ptr<int32_t>(), bf16_ptr(stage_a), width, rows,
                                               light_ptr, pass.cols_cap.data_ptr<int32_t>(), bf16_mut_ptr(pass.a_cap),
                                               light_fires.data_ptr<int32_t>(), stream),
             "csr_fill_light");
  pass.dense_units = at::empty({hidden}, x.options().dtype(at::kInt));
  check_cuda(sparse_llm::launch_select_dense_units(light_fires.data_ptr<int32_t>(), hidden, dense_min_fires,
                                                   pass.dense_units.data_ptr<int32_t>(),
                                                   pass.split.sizes.data_ptr<int64_t>() + 4, stream),
             "select_dense_units");
  after_split(pass.split);
  pass.wd_t = sparse_llm_glue::transpose_bf16(wd);
  pass.y = at::empty_like(x);

  // Light rows, with their L1 share.
  pass.updown_blocks = sparse_llm::csr_updown_blocks(rows);
  pass.l1_partial = at::empty({pass.updown_blocks + extra_l1_slots}, x.options().dtype(at::kFloat));
  check_cuda(sparse_llm::launch_csr_updown(bf16_ptr(x), bf16_ptr(wu), bf16_ptr(pass.wd_t), light_ptr,
                                           pass.cols_cap.data_ptr<int32_t>(), bf16_ptr(pass.a_cap),
                                           mask_ptr(pass.split.heavy), rows, dim, bf16_mut_ptr(pass.u_cap),
                                           bf16_mut_ptr(pass.y), pass.l1_partial.data_ptr<float>(), stream),
             "csr_updown");
  pass.fire_long = fire.to(at::kLong);
  return pass;
}

float inverse_rows(int64_t rows) { return static_cast<float>(1.0 / static_cast<double>(std::max<int64_t>(rows, 1))); }

// (y, l1, nnz_per_token, fire_counts, active_rows, kept_rows, cols, a_vals, u_vals, heavy_rows,
// heavy_cols, heavy_a, heavy_u, dense_units): the outputs of the reference op (active_rows: the rows
// with an active unit; kept_rows: keep's rows there, or [0, D] without keep) with the light rows'
// record (csr.cuh), then the heavy rows' indices and record (they size the backward's GEMMs, so it
// needs no host read), then the dense units (int32, ascending: those that fired on at least
// dense_min_fires light rows, 0 for none), whose weight-gradient rows the backward takes by GEMMs.
//
// The host reads the record sizes once, without draining the queue: the light rows' record has a
// capacity known in advance (threshold entries a row), and the first heavy rows' GEMMs take a fixed
// row count, so both are queued before the host waits, and the GPU runs them while it does. After
// the read come the outputs of exact size (the records, keep's rows) and the heavy rows past the
// first ones; the GPU idles through each launch made there, so they are few.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
ffn_train_forward(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                  const std::optional<at::Tensor>& keep, int64_t heavy_threshold, int64_t dense_min_fires) {
  check_forward_args(x, wg, wu, wd, keep, heavy_threshold, dense_min_fires);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream();
  const int64_t rows = x.size(0);
  const int hidden = static_cast<int>(wg.size(0));
  // The one host read: (light entries, heavy rows, heavy entries, active rows, dense units). It
  // waits only for the GEMM, the count, the split, the light record's fill and the dense units'
  // list: everything after them is queued before it and runs while the host reads.
  std::optional<sparse_llm_glue::EarlyHostRead> sizes;
  LightPass pass = light_pass(x, wg, wu, wd, heavy_threshold, dense_min_fires, 0, stream,
                              [&](const RowSplit& split) { sizes.emplace(split.sizes, stream); });
  const RowSplit& split = pass.split;
  const at::Tensor& g = pass.g;
  const at::Tensor& wd_t = pass.wd_t;
  at::Tensor& y = pass.y;
  const at::Tensor &cols_cap = pass.cols_cap, &a_cap = pass.a_cap, &u_cap = pass.u_cap;
  const at::Tensor& nnz = pass.nnz;
  const at::Tensor& fire_long = pass.fire_long;
  const double inv_rows = inverse_rows(rows);
  at::Tensor l1 = at::empty({}, x.options().dtype(at::kFloat));  // mean over rows of sum |h|
  check_cuda(sparse_llm::launch_csr_l1_finish(pass.l1_partial.data_ptr<float>(), pass.updown_blocks,
                                              static_cast<float>(inv_rows), l1.data_ptr<float>(), stream),
             "csr_l1_finish");

  // The first heavy rows' dense path, queued before the read too: its kernels read the number of
  // heavy rows on the device, and its GEMMs take `early` rows whatever it is (zero rows past it).
  // At >= 99% sparsity that covers a layer's few heavy rows: the GPU spends a few microseconds on
  // GEMM rows of zeros, where after the read the host would spend tens on these launches while the
  // GPU waited. Heavy rows past `early` take the same path after the read.
  const int64_t early = sparse_llm_glue::heavy_gemm_rows((rows + kEarlyHeavyRowsPer - 1) / kEarlyHeavyRowsPer);
  const int64_t* heavy_count = split.sizes.data_ptr<int64_t>() + 1;
  const int64_t* heavy_list = split.heavy_rows.data_ptr<int64_t>();
  const at::Tensor early_u =
      early > 0 ? heavy_rows_up_down(x, g, wu, wd_t, split.heavy_rows, heavy_count, early, early, y, stream)
                : at::Tensor();

  const int64_t* host_sizes = sizes->values().data_ptr<int64_t>();
  const int64_t light_total = host_sizes[0], n_heavy = host_sizes[1], heavy_total = host_sizes[2];
  const at::Tensor active_rows = split.active_rows.narrow(0, 0, host_sizes[3]);
  // Exact-size copies: the backward's sort walks the whole record, and autograd would otherwise
  // keep the capacity alive.
  const at::Tensor cols = sparse_llm_glue::prefix_copy(cols_cap, light_total);
  const at::Tensor a_vals = sparse_llm_glue::prefix_copy(a_cap, light_total);
  const at::Tensor u_vals = sparse_llm_glue::prefix_copy(u_cap, light_total);

  const at::Tensor heavy_rows = split.heavy_rows.narrow(0, 0, n_heavy);
  at::Tensor heavy_cols = at::empty({heavy_total}, cols.options());
  at::Tensor heavy_a = at::empty({heavy_total}, x.options());
  at::Tensor heavy_u = at::empty({heavy_total}, x.options());
  if (n_heavy > 0) {
    const int64_t* heavy_ptr = split.heavy_ptr.data_ptr<int64_t>();
    check_cuda(sparse_llm::launch_csr_fill_heavy(bf16_ptr(g), rows, hidden, heavy_ptr, heavy_cols.data_ptr<int32_t>(),
                                                 bf16_mut_ptr(heavy_a), stream),
               "csr_fill_heavy");
    check_cuda(sparse_llm::launch_csr_gather_rows(bf16_ptr(early_u), heavy_list, std::min(n_heavy, early), hidden,
                                                  heavy_ptr, heavy_cols.data_ptr<int32_t>(), bf16_mut_ptr(heavy_u),
                                                  stream),
               "csr_gather_rows");
    if (n_heavy > early) {
      const at::Tensor rest = heavy_rows.narrow(0, early, n_heavy - early);
      const int64_t n_rest = rest.size(0);
      const at::Tensor u = heavy_rows_up_down(x, g, wu, wd_t, rest, /*count=*/nullptr, n_rest,
                                              sparse_llm_glue::heavy_gemm_rows(n_rest), y, stream);
      check_cuda(sparse_llm::launch_csr_gather_rows(bf16_ptr(u), rest.data_ptr<int64_t>(), n_rest, hidden, heavy_ptr,
                                                    heavy_cols.data_ptr<int32_t>(), bf16_mut_ptr(heavy_u), stream),
                 "csr_gather_rows");
    }
    check_cuda(sparse_llm::launch_add_abs_product_sum(bf16_ptr(heavy_a), bf16_ptr(heavy_u), heavy_total,
                                                      static_cast<float>(inv_rows), l1.data_ptr<float>(), stream),
               "add_abs_product_sum");
  }
  const at::Tensor kept_rows =
      keep.has_value() ? rows_of(*keep, active_rows) : at::empty({0, x.size(1)}, x.options());
  return {y,      l1,         nnz,        fire_long, active_rows, kept_rows, cols,
          a_vals, u_vals, heavy_rows, heavy_cols, heavy_a, heavy_u, pass.dense_units.narrow(0, 0, host_sizes[4])};
}

// CTAs of the capacity path's heavy-row kernels (each writes one L1 partial sum).
constexpr int kGateL1Blocks = 264;
constexpr int kOverflowBlocks = 132;
// The fields of the capacity path's host sizes (pinned int64): the forward's five sizes, then a
// flag the GPU sets to 1 once they are there (the host sets -1 before queuing the copies).
constexpr int64_t kHostSizes = 5;
constexpr int64_t kHostSizeFields = kHostSizes + 1;

// The training forward with no host read (the capacity path): the reference op's outputs, the heavy
// rows' record at capacities the caller gives on the host, `capacities` = (heavy rows, heavy entries)
// as a CPU int64 tensor, plus `host_sizes`: a pinned CPU int64 [6] into which the GPU copies the
// forward's true sizes (light entries, heavy rows, heavy entries, active rows, dense units) and then
// a 1 in the last field; the dense units come whole ([H], the first of them the list). The light record needs no capacity: a light row holds at most `width` entries, so the
// whole record fits the M x width buffers the light pass fills, returned as they are (entries past
// the light size unspecified). y and l1 are exact whatever the capacities (heavy rows past the
// heavy-row capacity are computed from g by launch_heavy_overflow_updown); the heavy record is
// complete where its sizes fit their capacities, which the backward checks on host_sizes (read
// there, long after the GPU wrote it in steady state) before it reads the record
// (ops/ffn/training.py rebuilds an overflowed one). active_rows are all rows (their number is not
// read), kept_rows a copy of keep.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
ffn_train_forward_capacity(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                           const std::optional<at::Tensor>& keep, int64_t heavy_threshold, int64_t dense_min_fires,
                           const at::Tensor& capacities) {
  check_forward_args(x, wg, wu, wd, keep, heavy_threshold, dense_min_fires);
  SL_CHECK_ARG(capacities.device().is_cpu() && capacities.scalar_type() == at::kLong && capacities.numel() == 2 &&
                   capacities.is_contiguous(),
               "capacities must be a contiguous CPU int64 tensor of 2 elements (heavy rows, heavy entries)");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream();
  const int64_t rows = x.size(0);
  const int dim = static_cast<int>(x.size(1));
  const int hidden = static_cast<int>(wg.size(0));
  const int64_t* cap = capacities.data_ptr<int64_t>();
  // Capacities past what the data can hold buy nothing: the heavy rows are at most M, their entries
  // at most H a row.
  const int64_t heavy_cap = std::clamp<int64_t>(cap[0], 0, rows);
  const int64_t heavy_entries_cap = std::clamp<int64_t>(cap[1], 0, heavy_cap * hidden);

  const int64_t gate_slot = 0, overflow_slot = kGateL1Blocks;
  LightPass pass = light_pass(x, wg, wu, wd, heavy_threshold, dense_min_fires, kGateL1Blocks + kOverflowBlocks,
                              stream, [](const RowSplit&) {});
  const RowSplit& split = pass.split;
  float* l1_partial = pass.l1_partial.data_ptr<float>();
  const int64_t* heavy_count = split.sizes.data_ptr<int64_t>() + 1;
  const int64_t* heavy_list = split.heavy_rows.data_ptr<int64_t>();

  // The first min(heavy rows, heavy_cap) heavy rows: GEMMs of a fixed row count (zero rows past the
  // count), the gate fused with their L1 share.
  const int64_t padded = sparse_llm_glue::heavy_gemm_rows(heavy_cap);
  at::Tensor heavy_u_dense;
  if (padded > 0) {
    heavy_u_dense = at::mm(sparse_llm_glue::gather_rows(x, split.heavy_rows, heavy_cap, padded, heavy_count), wu.t());
    at::Tensor h = at::empty_like(heavy_u_dense);
    check_cuda(sparse_llm::launch_gate_mul_rows_l1(bf16_ptr(pass.g), heavy_list, heavy_count, padded, hidden,
                                                   bf16_ptr(heavy_u_dense), bf16_mut_ptr(h),
                                                   l1_partial + pass.updown_blocks + gate_slot,
                                                   kGateL1Blocks, stream),
               "gate_mul_rows_l1");
    const at::Tensor y_rows = at::mm(h, pass.wd_t);
    check_cuda(sparse_llm::launch_scatter_rows(y_rows.data_ptr(), heavy_list, heavy_count, heavy_cap,
                                               pass.y.size(1) * pass.y.element_size(), pass.y.data_ptr(), stream),
               "scatter_rows");
  } else {
    pass.l1_partial.narrow(0, pass.updown_blocks + gate_slot, kGateL1Blocks).zero_();
  }
  // Heavy rows past the capacity (none in steady state: the kernel reads the count and returns).
  check_cuda(sparse_llm::launch_heavy_overflow_updown(bf16_ptr(x), bf16_ptr(pass.g), bf16_ptr(wu), bf16_ptr(pass.wd_t),
                                                      heavy_list, heavy_count, heavy_cap, dim, hidden,
                                                      bf16_mut_ptr(pass.y), l1_partial + pass.updown_blocks +
                                                      overflow_slot, kOverflowBlocks, stream),
             "heavy_overflow_updown");
  at::Tensor l1 = at::empty({}, x.options().dtype(at::kFloat));
  check_cuda(sparse_llm::launch_csr_l1_finish(l1_partial, pass.l1_partial.size(0), inverse_rows(rows),
                                              l1.data_ptr<float>(), stream),
             "csr_l1_finish");

  // The light record whole (the backward cuts it to its size); the heavy one at its capacities:
  // entries past a capacity are not written (the backward then finds the size over the capacity on
  // host_sizes and rebuilds the record).
  const at::Tensor &cols = pass.cols_cap, &a_vals = pass.a_cap, &u_vals = pass.u_cap;
  const at::Tensor heavy_rows = split.heavy_rows.narrow(0, 0, heavy_cap).clone();
  at::Tensor heavy_cols = at::empty({heavy_entries_cap}, cols.options());
  at::Tensor heavy_a = at::empty({heavy_entries_cap}, x.options());
  at::Tensor heavy_u = at::empty({heavy_entries_cap}, x.options());
  if (heavy_entries_cap > 0) {
    const int64_t* heavy_ptr = split.heavy_ptr.data_ptr<int64_t>();
    check_cuda(sparse_llm::launch_csr_fill_heavy(bf16_ptr(pass.g), rows, hidden, heavy_ptr,
                                                 heavy_cols.data_ptr<int32_t>(), bf16_mut_ptr(heavy_a), stream,
                                                 heavy_entries_cap),
               "csr_fill_heavy");
    check_cuda(sparse_llm::launch_csr_gather_rows(bf16_ptr(heavy_u_dense), heavy_list, heavy_cap, hidden, heavy_ptr,
                                                  heavy_cols.data_ptr<int32_t>(), bf16_mut_ptr(heavy_u), stream,
                                                  heavy_count, heavy_entries_cap),
               "csr_gather_rows");
  }
  const at::Tensor active_rows = at::arange(rows, pass.nnz.options());
  const at::Tensor kept_rows = keep.has_value() ? keep->clone() : at::empty({0, dim}, x.options());

  // The sizes to the host, then the flag: stream order puts the flag after the sizes.
  at::Tensor host_sizes =
      at::empty({kHostSizeFields}, pass.nnz.options().device(at::kCPU).pinned_memory(true));
  host_sizes.fill_(-1);
  host_sizes.narrow(0, 0, kHostSizes).copy_(split.sizes, /*non_blocking=*/true);
  host_sizes.narrow(0, kHostSizes, 1).copy_(at::ones({1}, pass.nnz.options()), /*non_blocking=*/true);
  return {pass.y,     l1,         pass.nnz, pass.fire_long, active_rows,      kept_rows, cols, a_vals, u_vals,
          heavy_rows, heavy_cols, heavy_a,  heavy_u,        pass.dense_units, host_sizes};
}

// Waits until the GPU has written a capacity forward's host sizes (their last field set), then
// returns the five sizes. In steady state the backward calls this long after the forward's kernels
// ran, so it returns at once; it never drains the queue.
std::vector<int64_t> wait_host_sizes(const at::Tensor& host_sizes) {
  SL_CHECK_ARG(host_sizes.device().is_cpu() && host_sizes.scalar_type() == at::kLong &&
                   host_sizes.numel() == kHostSizeFields && host_sizes.is_contiguous(),
               "host_sizes must be a capacity forward's pinned int64 sizes");
  const volatile int64_t* fields = host_sizes.data_ptr<int64_t>();
  const cudaStream_t stream = current_stream();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t spins = 0; fields[kHostSizeFields - 1] != 1; ++spins) {
    if (spins % 1024 == 1023) {
      std::this_thread::yield();
      // A kernel that failed before the copies leaves the flag unset for good: its error, not a hang.
      // (A stream query waits for nothing.)
      const cudaError_t status = cudaStreamQuery(stream);
      if (status != cudaSuccess && status != cudaErrorNotReady) check_cuda(status, "the training forward");
      SL_CHECK_ARG(std::chrono::steady_clock::now() - start < std::chrono::seconds(600),
                   "the training forward's sizes never reached the host (a failed kernel before them?)");
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  std::vector<int64_t> sizes(kHostSizes);
  for (int64_t i = 0; i < kHostSizes; ++i) sizes[i] = fields[i];
  return sizes;
}

// The weight gradients' share of a record's entries, by the per-unit kernel over the entries in
// column order (each unit's rows of dWg, dWu and dWd^T accumulated in registers: no atomics,
// deterministic): written whole, or added to dwg, dwu, dwd_t where `accumulate` (after the heavy
// rows' GEMMs wrote them). dg, du: float32 at the record's entries.
// dense_slot: optional ([H] int32), the units it gives a slot are skipped (the dense units').
void unit_weight_grads(const at::Tensor& x, const at::Tensor& grad_y, const int64_t* row_ptr, const at::Tensor& cols,
                       const at::Tensor& dg, const at::Tensor& du, const at::Tensor& a_vals, const at::Tensor& u_vals,
                       int hidden, bool accumulate, const int32_t* dense_slot, at::Tensor& dwg, at::Tensor& dwu,
                       at::Tensor& dwd_t, cudaStream_t stream) {
  const int64_t rows = x.size(0), total = cols.size(0);
  const int dim = static_cast<int>(x.size(1));
  // Column order of the entries (stable: rows ascending within a unit) and each unit's range.
  const sparse_llm::ColumnOrderScratch order_scratch = sparse_llm::csr_column_order_scratch(total, hidden);
  at::Tensor order_counts = at::empty({2, order_scratch.count_ints}, cols.options());  // counts, offsets
  at::Tensor scan_temp = at::empty({order_scratch.scan_bytes}, x.options().dtype(at::kByte));
  at::Tensor unit_ptr = at::empty({hidden + 1}, x.options().dtype(at::kLong));
  at::Tensor csc_rows = at::empty({total}, cols.options());
  at::Tensor csc_entry = at::empty({total}, cols.options());
  check_cuda(sparse_llm::launch_csr_column_order(row_ptr, rows, cols.data_ptr<int32_t>(), total, hidden, order_scratch,
                                                 order_counts[0].data_ptr<int32_t>(),
                                                 order_counts[1].data_ptr<int32_t>(), scan_temp.data_ptr(),
                                                 unit_ptr.data_ptr<int64_t>(), csc_rows.data_ptr<int32_t>(),
                                                 csc_entry.data_ptr<int32_t>(), stream),
             "csr_column_order");
  const int64_t* unit_ptr_d = unit_ptr.data_ptr<int64_t>();
  const int32_t* csc_rows_d = csc_rows.data_ptr<int32_t>();
  const int32_t* csc_entry_d = csc_entry.data_ptr<int32_t>();
  at::Tensor long_units = at::empty({hidden + 1}, cols.options());  // the units with many entries, then their count
  int32_t* long_d = long_units.data_ptr<int32_t>();
  check_cuda(dwg.scalar_type() == at::kFloat
                 ? sparse_llm::launch_csr_backward_units(
                       bf16_ptr(x), bf16_ptr(grad_y), unit_ptr_d, csc_rows_d, csc_entry_d, dg.data_ptr<float>(),
                       du.data_ptr<float>(), bf16_ptr(a_vals), bf16_ptr(u_vals), hidden, dim, total, accumulate,
                       dense_slot, long_d, dwg.data_ptr<float>(), dwu.data_ptr<float>(), dwd_t.data_ptr<float>(),
                       stream)
                 : sparse_llm::launch_csr_backward_units(
                       bf16_ptr(x), bf16_ptr(grad_y), unit_ptr_d, csc_rows_d, csc_entry_d, dg.data_ptr<float>(),
                       du.data_ptr<float>(), bf16_ptr(a_vals), bf16_ptr(u_vals), hidden, dim, total, accumulate,
                       dense_slot, long_d, bf16_mut_ptr(dwg), bf16_mut_ptr(dwu), bf16_mut_ptr(dwd_t), stream),
             "csr_backward_units");
}

// The heavy rows' backward takes them this many at a time: each chunk's dense [rows, H] tensors (a,
// u, dh: 3 x 44 MB at H = 5632) are freed before the next chunk's, where all of a step's rows at once
// (a layer turning sparse at L0 100-170 has nearly every row heavy) held 0.55 GB more and set a whole
// run's peak. A multiple of kHeavyRowsGranule; a step's layers past it (L0 60 and up) pay one more
// read and write of the three weight gradients a chunk.
constexpr int64_t kHeavyBackwardChunkRows = 4096;

// The heavy rows' share of the backward: their rows of dx, and the weight gradients written whole
// (the light rows' share is added after). Padded rows (kHeavyRowsGranule) are zero in x_h, gy_h, a_h
// and u_h: they add nothing. Chunks after the first add into the weight gradients (bf16 ones through
// an fp32 sum, so that chunking rounds them once, as one GEMM does).
void heavy_rows_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& heavy_rows,
                         const at::Tensor& heavy_ptr, const at::Tensor& heavy_cols, const at::Tensor& heavy_a,
                         const at::Tensor& heavy_u, const at::Tensor& wg_c, const at::Tensor& wu_c,
                         const at::Tensor& wd_t, const at::Tensor& l1_grad, at::Tensor& dx, at::Tensor& dwg,
                         at::Tensor& dwu, at::Tensor& dwd_t, cudaStream_t stream) {
  const int64_t n_heavy = heavy_rows.size(0);
  const int64_t rows = x.size(0);
  const int hidden = static_cast<int>(wg_c.size(0));
  const bool chunked = n_heavy > kHeavyBackwardChunkRows;
  const bool sum_in_float = chunked && dwg.scalar_type() != at::kFloat;
  at::Tensor gwg = sum_in_float ? at::empty(dwg.sizes(), dwg.options().dtype(at::kFloat)) : dwg;
  at::Tensor gwu = sum_in_float ? at::empty(dwu.sizes(), dwu.options().dtype(at::kFloat)) : dwu;
  at::Tensor gwd_t = sum_in_float ? at::empty(dwd_t.sizes(), dwd_t.options().dtype(at::kFloat)) : dwd_t;
  for (int64_t start = 0; start < n_heavy; start += kHeavyBackwardChunkRows) {
    const at::Tensor list = heavy_rows.narrow(0, start, std::min(kHeavyBackwardChunkRows, n_heavy - start));
    const int64_t n = list.size(0);
    const at::Tensor x_h = sparse_llm_glue::gather_rows_padded(x, list);
    const at::Tensor gy_h = sparse_llm_glue::gather_rows_padded(grad_y, list);
    const int64_t padded = x_h.size(0);
    at::Tensor a_h = at::zeros({padded, hidden}, x.options());  // then du
    at::Tensor u_h = at::zeros({padded, hidden}, x.options());  // then h
    check_cuda(sparse_llm::launch_csr_scatter_rows(list.data_ptr<int64_t>(), n, hidden, heavy_ptr.data_ptr<int64_t>(),
                                                   heavy_cols.data_ptr<int32_t>(), bf16_ptr(heavy_a),
                                                   bf16_ptr(heavy_u), bf16_mut_ptr(a_h), bf16_mut_ptr(u_h), stream),
               "csr_scatter_rows");
    at::Tensor dh = at::mm(gy_h, wd_t.t());  // then dg
    check_cuda(sparse_llm::launch_heavy_backward_elementwise(n, hidden, l1_grad.data_ptr<float>(), rows,
                                                             bf16_mut_ptr(dh), bf16_mut_ptr(a_h), bf16_mut_ptr(u_h),
                                                             stream),
               "heavy_backward_elementwise");
    at::Tensor dx_h = at::mm(dh, wg_c);
    dx_h.addmm_(a_h, wu_c);
    dx.index_copy_(0, list, dx_h.narrow(0, 0, n));
    const bool first = start == 0;
    add_product(gwg, dh.t(), x_h, first);
    add_product(gwu, a_h.t(), x_h, first);
    add_product(gwd_t, u_h.t(), gy_h, first);
  }
  if (sum_in_float) {
    dwg.copy_(gwg);
    dwu.copy_(gwu);
    dwd_t.copy_(gwd_t);
  }
}

// The dense units go through the GEMMs this many at a time: their block stays [M, 3 x 1024] bf16
// (100 MB at M = 16384) however many there are (up to 64 / DENSE_UNIT_ROW_SHARE: 4096 at 1/64).
constexpr int64_t kDenseUnitChunk = 1024;

// The dense units' share of the weight gradients (kernels/csr_dense_units.cu), kDenseUnitChunk units
// at a time: their light entries' dg, du and h scattered into an [M, 3 * width] block (width: the
// chunk's count rounded up to the GEMM granule, the extra columns zero), then two GEMMs over all M
// rows (dWg's and dWu's rows from x, dWd^T's from grad_y, float32), their rows written into the
// gradients (added where `accumulate`: the heavy rows' GEMMs wrote them first). Returns the units'
// slots ([H] int32, -1 off them), by which the per-unit kernels skip them.
at::Tensor dense_unit_weight_grads(const at::Tensor& x, const at::Tensor& grad_y, const int64_t* row_ptr,
                                   const at::Tensor& cols, const at::Tensor& dg, const at::Tensor& du,
                                   const at::Tensor& a_vals, const at::Tensor& u_vals, const at::Tensor& units,
                                   int hidden, bool accumulate, at::Tensor& dwg, at::Tensor& dwu, at::Tensor& dwd_t,
                                   cudaStream_t stream) {
  const int64_t rows = x.size(0), n = units.size(0), dim = x.size(1);
  at::Tensor slot = at::empty({hidden}, cols.options());
  check_cuda(sparse_llm::launch_dense_unit_slots(units.data_ptr<int32_t>(), n, hidden, slot.data_ptr<int32_t>(),
                                                 stream),
             "dense_unit_slots");
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  for (int64_t first = 0; first < n; first += kDenseUnitChunk) {
    const int64_t count = std::min(kDenseUnitChunk, n - first);
    const int64_t width = sparse_llm_glue::heavy_gemm_rows(count);  // a multiple of 64: cuBLAS's fast shapes
    at::Tensor block = at::empty({rows, 3 * width}, x.options());
    check_cuda(cudaMemsetAsync(block.data_ptr(), 0, block.nbytes(), stream), "cudaMemsetAsync");
    check_cuda(sparse_llm::launch_scatter_dense_units(row_ptr, rows, cols.data_ptr<int32_t>(), dg.data_ptr<float>(),
                                                      du.data_ptr<float>(), bf16_ptr(a_vals), bf16_ptr(u_vals),
                                                      slot.data_ptr<int32_t>(), first, count, static_cast<int>(width),
                                                      bf16_mut_ptr(block), stream),
               "scatter_dense_units");
    at::Tensor gu = at::empty({2 * width, dim}, f32), d = at::empty({width, dim}, f32);
    add_product(gu, block.narrow(1, 0, 2 * width).t(), x, /*overwrite=*/true);
    add_product(d, block.narrow(1, 2 * width, width).t(), grad_y, /*overwrite=*/true);
    const int32_t* units_d = units.data_ptr<int32_t>() + first;
    check_cuda(dwg.scalar_type() == at::kFloat
                   ? sparse_llm::launch_put_dense_unit_rows(units_d, count, static_cast<int>(width),
                                                            static_cast<int>(dim), gu.data_ptr<float>(),
                                                            d.data_ptr<float>(), accumulate, dwg.data_ptr<float>(),
                                                            dwu.data_ptr<float>(), dwd_t.data_ptr<float>(), stream)
                   : sparse_llm::launch_put_dense_unit_rows(units_d, count, static_cast<int>(width),
                                                            static_cast<int>(dim), gu.data_ptr<float>(),
                                                            d.data_ptr<float>(), accumulate, bf16_mut_ptr(dwg),
                                                            bf16_mut_ptr(dwu), bf16_mut_ptr(dwd_t), stream),
               "put_dense_unit_rows");
  }
  return slot;
}

// (dx, dWg, dWu, dWd) of <grad_y, y> + grad_l1 * l1, from the forward's records. Light rows: the
// per-row kernel (dh, dg, du, dx) and the per-unit kernel (weight gradients); heavy rows: GEMMs on
// the gathered rows, to whose weight gradients the per-unit kernel adds the light rows', except on
// dense_units (int32 [n], the forward's list: distinct units, not checked), whose share GEMMs over
// all rows add (above): every row of x must be finite, rows without entries too (zero there times a
// NaN is NaN). The weights come in bf16, or in float (the master weights under bf16 autocast): the kernels read
// bf16 casts of them, and the weight gradients come out in the weights' dtype, accumulated in fp32.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ffn_train_backward(
    const at::Tensor& grad_y, const at::Tensor& grad_l1, const at::Tensor& x, const at::Tensor& wg,
    const at::Tensor& wu, const at::Tensor& wd, const at::Tensor& nnz, const at::Tensor& cols,
    const at::Tensor& a_vals, const at::Tensor& u_vals, const at::Tensor& heavy_rows, const at::Tensor& heavy_cols,
    const at::Tensor& heavy_a, const at::Tensor& heavy_u, const at::Tensor& dense_units) {
  const at::ScalarType grad_dtype = wg.scalar_type();
  SL_CHECK_ARG(grad_dtype == at::kBFloat16 || grad_dtype == at::kFloat, "weights must be bfloat16 or float32, got ",
               grad_dtype);
  check_weights(x, wg, wu, wd, grad_dtype);
  check_matrix(grad_y, "grad_y");
  SL_CHECK_ARG(grad_y.sizes() == x.sizes(), "grad_y must be shaped like x");
  SL_CHECK_ARG(grad_l1.is_cuda() && grad_l1.numel() == 1, "grad_l1 must be a one-element CUDA tensor");
  check_record(x, nnz, cols, a_vals, u_vals);
  check_record(x, nnz, heavy_cols, heavy_a, heavy_u);
  SL_CHECK_ARG(heavy_rows.is_cuda() && heavy_rows.scalar_type() == at::kLong && heavy_rows.dim() == 1 &&
                   heavy_rows.is_contiguous(),
               "heavy_rows must be a contiguous int64 CUDA vector");
  SL_CHECK_ARG(dense_units.device() == x.device() && dense_units.scalar_type() == at::kInt && dense_units.dim() == 1 &&
                   dense_units.is_contiguous() && dense_units.size(0) <= wg.size(0),
               "dense_units must be a contiguous int32 vector of at most H units on x's device");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream();
  const int64_t rows = x.size(0);
  const int64_t total = cols.size(0);
  const int64_t n_heavy = heavy_rows.size(0);
  const int dim = static_cast<int>(x.size(1));
  const int hidden = static_cast<int>(wg.size(0));

  // With no heavy rows the list's data_ptr may be null (a fresh empty tensor), which the split reads
  // as "by threshold": a threshold no row exceeds keeps every row light then, as the forward had it.
  const RowSplit split =
      split_rows(nnz, n_heavy > 0 ? 0 : std::numeric_limits<int64_t>::max(), heavy_rows, stream);
  const int64_t* row_ptr = split.light_ptr.data_ptr<int64_t>();
  const at::Tensor wg_c = wg.to(at::kBFloat16), wu_c = wu.to(at::kBFloat16);  // no copy when bf16
  const at::Tensor wd_t = sparse_llm_glue::transpose_as(wd, at::kBFloat16);
  const at::Tensor l1_grad = grad_l1.to(at::kFloat).reshape({1}).contiguous();
  at::Tensor dg = at::empty({total}, x.options().dtype(at::kFloat));
  at::Tensor du = at::empty({total}, x.options().dtype(at::kFloat));
  at::Tensor dx = at::empty_like(x);
  check_cuda(sparse_llm::launch_csr_backward_rows(bf16_ptr(grad_y), bf16_ptr(wg_c), bf16_ptr(wu_c), bf16_ptr(wd_t),
                                                  row_ptr, cols.data_ptr<int32_t>(), bf16_ptr(a_vals), bf16_ptr(u_vals),
                                                  mask_ptr(split.heavy), l1_grad.data_ptr<float>(), rows, dim,
                                                  dg.data_ptr<float>(), du.data_ptr<float>(), bf16_mut_ptr(dx), stream),
             "csr_backward_rows");

  at::Tensor dwg = at::empty_like(wg);
  at::Tensor dwu = at::empty_like(wu);
  at::Tensor dwd_t = at::empty({hidden, dim}, wd.options());
  // Heavy rows first: their GEMMs write the weight gradients whole (no read of them), and the
  // per-unit kernel then adds the light rows' sums to the units they touch only. Adding the GEMMs
  // to the kernel's rows instead read and wrote the three [H, D] gradients once more (fp32 under
  // autocast: ~100 us a layer on an H100, however few the heavy rows).
  if (n_heavy > 0) heavy_rows_backward(grad_y, x, heavy_rows, split.heavy_ptr, heavy_cols, heavy_a, heavy_u, wg_c, wu_c,
                                       wd_t, l1_grad, dx, dwg, dwu, dwd_t, stream);
  // The light entries' share (the dense units' by GEMMs, the others' by the per-unit kernels): added
  // to the heavy rows' GEMMs where there were any.
  const at::Tensor slot = dense_units.size(0) > 0
                              ? dense_unit_weight_grads(x, grad_y, row_ptr, cols, dg, du, a_vals, u_vals, dense_units,
                                                        hidden, n_heavy > 0, dwg, dwu, dwd_t, stream)
                              : at::Tensor();
  unit_weight_grads(x, grad_y, row_ptr, cols, dg, du, a_vals, u_vals, hidden, n_heavy > 0,
                    slot.defined() ? slot.data_ptr<int32_t>() : nullptr, dwg, dwu, dwd_t, stream);
  return {dx, dwg, dwu, sparse_llm_glue::transpose_as(dwd_t, grad_dtype)};
}

// The record of every row's active entries of g [M, H] bf16 at the offsets row_ptr [M + 1] (int64,
// the exclusive prefix sum of the rows' counts): (cols [total] int32, a_vals [total] bf16), each
// row's units ascending; entries past `total` are not written.
std::tuple<at::Tensor, at::Tensor> csr_fill_record(const at::Tensor& g, const at::Tensor& row_ptr, int64_t total) {
  check_matrix(g, "g");
  SL_CHECK_ARG(g.size(1) % 8 == 0, "g must have a multiple of 8 columns, got ", g.size(1));
  SL_CHECK_ARG(row_ptr.is_cuda() && row_ptr.scalar_type() == at::kLong && row_ptr.dim() == 1 &&
                   row_ptr.numel() == g.size(0) + 1 && row_ptr.is_contiguous(),
               "row_ptr must be a contiguous int64 CUDA vector of M + 1 offsets");
  SL_CHECK_ARG(row_ptr.device() == g.device(), "row_ptr must be on g's device");
  SL_CHECK_ARG(total >= 0, "total must be >= 0, got ", total);
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor cols = at::empty({total}, g.options().dtype(at::kInt));
  at::Tensor a_vals = at::empty({total}, g.options());
  if (total > 0)
    check_cuda(sparse_llm::launch_csr_fill_heavy(bf16_ptr(g), g.size(0), static_cast<int>(g.size(1)),
                                                 row_ptr.data_ptr<int64_t>(), cols.data_ptr<int32_t>(),
                                                 bf16_mut_ptr(a_vals), current_stream(), total),
               "csr_fill_heavy");
  return {cols, a_vals};
}

// (dWg, dWu, dWd) in `grad_dtype` (bf16 or float) from a record of every row's active entries
// (row_ptr [M + 1], cols, a_vals, u_vals: the training forward's, which the kernels trust: offsets
// from 0 ending at cols' length, columns in [0, hidden)) and dg, du (float32) at them, with x and
// grad_y [M, D] bf16: the per-unit kernel alone, for a backward whose dh, dg, du and dx come from
// elsewhere (design 2's tile kernels, docs/kernels.md).
std::tuple<at::Tensor, at::Tensor, at::Tensor> csr_weight_grads(const at::Tensor& x, const at::Tensor& grad_y,
                                                                const at::Tensor& row_ptr, const at::Tensor& cols,
                                                                const at::Tensor& a_vals, const at::Tensor& u_vals,
                                                                const at::Tensor& dg, const at::Tensor& du,
                                                                int64_t hidden, at::ScalarType grad_dtype) {
  SL_CHECK_ARG(grad_dtype == at::kBFloat16 || grad_dtype == at::kFloat, "grad_dtype must be bfloat16 or float32, got ",
               grad_dtype);
  check_matrix(x, "x");
  check_matrix(grad_y, "grad_y");
  SL_CHECK_ARG(grad_y.sizes() == x.sizes(), "grad_y must be shaped like x");
  SL_CHECK_ARG(x.size(1) <= sparse_llm::kMaxTrainDim && x.size(1) % 8 == 0, "D must be a multiple of 8, at most ",
               sparse_llm::kMaxTrainDim);
  SL_CHECK_ARG(hidden > 0 && hidden <= sparse_llm::kMaxColumnSortHidden, "hidden must be in [1, ",
               sparse_llm::kMaxColumnSortHidden, "], got ", hidden);
  SL_CHECK_ARG(cols.numel() < (int64_t{1} << 31), "the record must hold fewer than 2^31 entries, got ", cols.numel());
  for (const at::Tensor* t : {&grad_y, &row_ptr, &cols, &a_vals, &u_vals, &dg, &du})
    SL_CHECK_ARG(t->device() == x.device(), "every input must be on x's device");
  SL_CHECK_ARG(row_ptr.is_cuda() && row_ptr.scalar_type() == at::kLong && row_ptr.dim() == 1 &&
                   row_ptr.numel() == x.size(0) + 1 && row_ptr.is_contiguous(),
               "row_ptr must be a contiguous int64 CUDA vector of M + 1 offsets");
  const int64_t total = cols.numel();
  SL_CHECK_ARG(cols.is_cuda() && cols.scalar_type() == at::kInt && cols.dim() == 1 && cols.is_contiguous(),
               "cols must be a contiguous int32 CUDA vector");
  for (const at::Tensor* t : {&a_vals, &u_vals})
    SL_CHECK_ARG(t->is_cuda() && t->scalar_type() == at::kBFloat16 && t->numel() == total && t->is_contiguous(),
                 "a_vals and u_vals must be contiguous bf16 CUDA vectors like cols");
  for (const at::Tensor* t : {&dg, &du})
    SL_CHECK_ARG(t->is_cuda() && t->scalar_type() == at::kFloat && t->numel() == total && t->is_contiguous(),
                 "dg and du must be contiguous float32 CUDA vectors like cols");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream();
  const int64_t dim = x.size(1);
  const at::TensorOptions out = x.options().dtype(grad_dtype);
  at::Tensor dwg = at::empty({hidden, dim}, out), dwu = at::empty({hidden, dim}, out);
  at::Tensor dwd_t = at::empty({hidden, dim}, out);
  unit_weight_grads(x, grad_y, row_ptr.data_ptr<int64_t>(), cols, dg, du, a_vals, u_vals, static_cast<int>(hidden),
                    /*accumulate=*/false, /*dense_slot=*/nullptr, dwg, dwu, dwd_t, stream);
  return {dwg, dwu, sparse_llm_glue::transpose_as(dwd_t, grad_dtype)};
}

}  // namespace

void register_train_ops(pybind11::module_& m) {
  m.def("ffn_train_forward", sparse_llm_glue::guarded<&ffn_train_forward>,
        "exact sparse training forward: (y, l1, nnz_per_token, fire_counts, active_rows, kept_rows, cols, a_vals, "
        "u_vals, heavy_rows, heavy_cols, heavy_a, heavy_u, dense_units); rows with more than heavy_threshold active "
        "units take the dense path, and units that fired on at least dense_min_fires light rows (0: none) the "
        "backward's GEMMs");
  m.def("ffn_train_forward_capacity", sparse_llm_glue::guarded<&ffn_train_forward_capacity>,
        "the training forward with no host read: the light record whole, the heavy one at the given capacities "
        "(heavy rows, heavy entries), the dense units whole, then host_sizes (pinned) where the GPU writes the true "
        "sizes and a ready flag");
  m.def("wait_host_sizes", sparse_llm_glue::guarded<&wait_host_sizes>,
        "the five sizes a capacity forward wrote to host_sizes, once they are there");
  m.def("csr_fill_record", sparse_llm_glue::guarded<&csr_fill_record>,
        "(cols int32, a_vals bf16): the record of every row's active entries of g at the offsets row_ptr, the "
        "first `total`");
  m.def("csr_weight_grads", sparse_llm_glue::guarded<&csr_weight_grads>,
        "(dWg, dWu, dWd) in grad_dtype from a record of every row's active entries and dg, du at them: the "
        "per-unit kernel alone");
  m.def("ffn_train_backward", sparse_llm_glue::guarded<&ffn_train_backward>,
        "exact sparse training backward from the forward's records: (dx, dWg, dWu, dWd), the weight gradients "
        "in the weights' dtype (bf16 or float32)");
}
