// Torch binding of design 2's plan (tile_plan.cuh): each tile's union of active units, from g.
#include <tuple>
#include <utility>

#include "tile_plan.cuh"
#include "torch_glue.h"

namespace {

constexpr int64_t kMaxTile = int64_t{1} << 30;  // the kernels take the tile as an int

// (units [tiles, hidden], counts [tiles]) from the tiles' unit bits [tiles, hidden / 32].
std::pair<at::Tensor, at::Tensor> compact_tiles(const at::Tensor& bits, int64_t tiles, int64_t hidden,
                                               cudaStream_t stream) {
  at::Tensor units = at::empty({tiles, hidden}, bits.options());
  at::Tensor counts = at::empty({tiles}, bits.options());
  sparse_llm_glue::check_cuda(
      sparse_llm::launch_tile_union_compact(reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>()), tiles,
                                            static_cast<int>(hidden), units.data_ptr<int32_t>(),
                                            counts.data_ptr<int32_t>(), stream),
      "tile_union_compact");
  return {units, counts};
}

// (units [tiles, H] int32: tile t's active units ascending in its first counts[t] entries,
//  counts [tiles] int32, then with row_layout the rows' words [M, H / 32] and their ranks (int32,
//  tile_plan.cuh), else two empty tensors) of g: [M, H] bf16, tiles of `tile` rows (the last
//  possibly short).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tile_union_plan(const at::Tensor& g, int64_t tile,
                                                                           bool row_layout) {
  sparse_llm_glue::check_matrix(g, "g");
  const int64_t rows = g.size(0), hidden = g.size(1);
  SL_CHECK_ARG(hidden % 32 == 0 && hidden <= sparse_llm::kTilePlanMaxHidden,
               "g must have a multiple of 32 columns, at most ", sparse_llm::kTilePlanMaxHidden, ", got ", hidden);
  SL_CHECK_ARG(tile > 0 && tile <= kMaxTile && tile % sparse_llm::kTilePlanRowsPerCta == 0,
               "tile must be a positive multiple of ", sparse_llm::kTilePlanRowsPerCta, ", at most ", kMaxTile,
               ", got ", tile);
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t tiles = (rows + tile - 1) / tile;
  const at::TensorOptions ints = g.options().dtype(at::kInt);
  at::Tensor bits = at::zeros({tiles, hidden / 32}, ints);
  at::Tensor row_words = at::empty({row_layout ? rows : 0, hidden / 32}, ints);
  at::Tensor row_ranks = at::empty({row_layout ? rows : 0, hidden / 32}, ints);
  uint32_t* bit_words = reinterpret_cast<uint32_t*>(bits.data_ptr<int32_t>());
  const cudaStream_t stream = sparse_llm_glue::current_stream();
  sparse_llm_glue::check_cuda(
      sparse_llm::launch_tile_union_bits(
          sparse_llm_glue::bf16_ptr(g), rows, static_cast<int>(hidden), static_cast<int>(tile), bit_words,
          row_layout ? reinterpret_cast<uint32_t*>(row_words.data_ptr<int32_t>()) : nullptr,
          row_layout ? row_ranks.data_ptr<int32_t>() : nullptr, stream),
      "tile_union_bits");
  auto [units, counts] = compact_tiles(bits, tiles, hidden, stream);
  return {units, counts, row_words, row_ranks};
}

// The same from a record of every row's active entries (row_ptr [M + 1] int64 from 0, non-decreasing,
// ending at cols' length; cols int32 in [0, hidden), ascending within a row: the training forward's
// record, which the kernels trust rather than read on the host) of an [M, hidden] activation: a
// row's ranks only at its words with an entry. A column out of range is skipped, not written.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tile_union_plan_from_record(const at::Tensor& row_ptr,
                                                                                       const at::Tensor& cols,
                                                                                       int64_t hidden, int64_t tile) {
  SL_CHECK_ARG(row_ptr.is_cuda() && row_ptr.scalar_type() == at::kLong && row_ptr.dim() == 1 &&
                   row_ptr.numel() >= 1 && row_ptr.is_contiguous(),
               "row_ptr must be a contiguous 1-D CUDA int64 tensor of M + 1 offsets");
  SL_CHECK_ARG(cols.is_cuda() && cols.scalar_type() == at::kInt && cols.dim() == 1 && cols.is_contiguous(),
               "cols must be a contiguous 1-D CUDA int32 tensor");
  SL_CHECK_ARG(row_ptr.device() == cols.device(), "row_ptr and cols must be on one device");
  SL_CHECK_ARG(hidden > 0 && hidden % 32 == 0 && hidden <= sparse_llm::kTilePlanMaxHidden,
               "hidden must be a positive multiple of 32, at most ", sparse_llm::kTilePlanMaxHidden, ", got ", hidden);
  SL_CHECK_ARG(tile > 0 && tile <= kMaxTile, "tile must be in [1, ", kMaxTile, "], got ", tile);
  const c10::cuda::CUDAGuard guard(row_ptr.device());
  const int64_t rows = row_ptr.numel() - 1, tiles = (rows + tile - 1) / tile;
  const at::TensorOptions ints = cols.options();
  at::Tensor bits = at::empty({tiles, hidden / 32}, ints);
  at::Tensor row_words = at::zeros({rows, hidden / 32}, ints);
  at::Tensor row_ranks = at::empty({rows, hidden / 32}, ints);
  uint32_t* bit_words = reinterpret_cast<uint32_t*>(bits.data_ptr<int32_t>());
  const cudaStream_t stream = sparse_llm_glue::current_stream();
  sparse_llm_glue::check_cuda(
      sparse_llm::launch_tile_layout_from_record(
          row_ptr.data_ptr<int64_t>(), cols.data_ptr<int32_t>(), rows, static_cast<int>(hidden),
          static_cast<int>(tile), bit_words, reinterpret_cast<uint32_t*>(row_words.data_ptr<int32_t>()),
          row_ranks.data_ptr<int32_t>(), stream),
      "tile_layout_from_record");
  auto [units, counts] = compact_tiles(bits, tiles, hidden, stream);
  return {units, counts, row_words, row_ranks};
}

}  // namespace

void register_tile_ops(pybind11::module_& m) {
  m.def("tile_union_plan", sparse_llm_glue::guarded<&tile_union_plan>,
        "(units [tiles, H] int32, counts [tiles] int32, row words, row ranks): each tile of `tile` rows' units "
        "with g > 0 on any of its rows, ascending, on the device; with row_layout also each row's active units "
        "as 32-unit words and each word's rank in the row (else empty)");
  m.def("tile_union_plan_from_record", sparse_llm_glue::guarded<&tile_union_plan_from_record>,
        "the same plan and row layout from a record (row_ptr, cols) of an [M, hidden] activation; a row's "
        "ranks only at its words with an entry");
}
