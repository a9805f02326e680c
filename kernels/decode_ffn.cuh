// The FFN of a decode step (a few rows: one token per sequence) without a host read: the gate,
// a compaction of the active units into fixed segments, then up and down over the active units
// only. Plain CUDA C++: no torch headers, so the .cu compiles with `nvcc -c` alone.
//
// Record: the H units are cut into segments of kDecodeSegUnits; for row m and segment s,
// seg_count[m, s] active units (gate > 0) are listed in unit order as seg_unit[m, s, :] (int32) and
// seg_gate[m, s, :] (relu(gate), fp32). A segment has room for every one of its units, so the record
// cannot overflow: every pattern, all units active included, is computed exactly; only the time
// grows with the number of active units.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace sparse_llm {

constexpr int kDecodeSegUnits = 32;    // units per segment: one warp ballot
// Rows up to which the gate is this file's GEMV; from 3 rows on cuBLAS's GEMM plus the compaction
// win (H100, D = 2048, H = 5632: the GEMV 10.5 us at 1 row but 25.7 us at 8, cuBLAS 10.4 us at 8).
constexpr int kDecodeFusedRows = 2;
constexpr int kDecodeMaxDim = 2048;    // D up to which up/down keep a row's output in registers (no spills)

inline int decode_segments(int hidden) { return (hidden + kDecodeSegUnits - 1) / kDecodeSegUnits; }

// Segments up/down can take: their prefix and the CTA's reduction (4 x kDecodeMaxDim floats) share
// the 48 KiB of shared memory a launch gets without opting in.
constexpr int kDecodeMaxSegments = (48 * 1024 / 4 - 4 * kDecodeMaxDim) - 4;

// Rows up to which the whole FFN is one launch (the kernel takes one row), and segments up to
// which (a finishing CTA's prefix over them lives in static shared memory): H up to 32768.
constexpr int kDecodeOneLaunchRows = 1;
constexpr int kDecodeOneLaunchMaxSegments = 1024;
constexpr int kDecodeFinishers = 8;  // CTAs that add the down projection, a slice of the row each

inline int decode_one_launch_finishers(int n_seg) { return n_seg < kDecodeFinishers ? n_seg : kDecodeFinishers; }

// Whether rows x dim x hidden take the one-launch kernel: one row, a prefix that fits, and each
// finisher's slice at most 32 vectors of 8 (a lane each; few segments mean few finishers).
inline bool decode_one_launch_applies(int64_t rows, int64_t dim, int64_t hidden) {
  const int n_seg = decode_segments(static_cast<int>(hidden));
  return rows <= kDecodeOneLaunchRows && dim <= kDecodeMaxDim && n_seg >= 1 &&
         n_seg <= kDecodeOneLaunchMaxSegments && dim <= 8 * 32 * decode_one_launch_finishers(n_seg);
}

// The whole FFN of one row in one launch, out += y as launch_decode_updown_add defines it. The
// segment CTAs list (unit, h = relu(g) * u rounded to bf16) in the record (seg_count, seg_unit,
// seg_h: as above, h in place of the gate); the last few to arrive (arrivals: one int32, zero on
// entry) wait for the rest and add y, each a slice, in a fixed order into out. dim <= kDecodeMaxDim.
cudaError_t launch_decode_ffn_add(const __nv_bfloat16* x, const __nv_bfloat16* wg,
                                  const __nv_bfloat16* wu, const __nv_bfloat16* wd_t, int rows, int dim, int hidden,
                                  int32_t* seg_count, int32_t* seg_unit, float* seg_h, int32_t* arrivals,
                                  __nv_bfloat16* out, cudaStream_t stream);

// The gate GEMV fused with ReLU and the compaction: g = x Wg^T in fp32 for rows <= kDecodeFusedRows.
// x: [rows, dim] (row stride x_stride elements), wg: [hidden, dim], contiguous bf16, dim % 8 == 0.
cudaError_t launch_decode_gate(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* wg, int rows, int dim,
                               int hidden, int32_t* seg_count, int32_t* seg_unit, float* seg_gate,
                               cudaStream_t stream);

// The compaction alone, of a gate computed elsewhere: g: [rows, hidden] bf16 contiguous.
cudaError_t launch_decode_compact(const __nv_bfloat16* g, int rows, int hidden, int32_t* seg_count,
                                  int32_t* seg_unit, float* seg_gate, cudaStream_t stream);

// Up and down over the active units of each row, then out += y:
//   y[m] = sum over active j of relu(g[m, j]) * (x[m] . Wu[j]) * WdT[j]     (fp32)
//   out[m] = bf16(out[m] + bf16(y[m]))                                       (as a separate add)
// `splits` CTAs share a row's units; their partial sums (partial: [rows, splits, dim] fp32 scratch)
// are added in a fixed order by the row's last CTA to arrive (arrivals: [rows] int32, zero on
// entry), so the result does not depend on timing. dim <= kDecodeMaxDim.
cudaError_t launch_decode_updown_add(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* wu,
                                     const __nv_bfloat16* wd_t, int rows, int dim, int hidden,
                                     const int32_t* seg_count, const int32_t* seg_unit, const float* seg_gate,
                                     int splits, float* partial, int32_t* arrivals, __nv_bfloat16* out,
                                     cudaStream_t stream);

}  // namespace sparse_llm
