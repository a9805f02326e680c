// One CTA per row of logits: a pass for the row's max and sum of exponentials (online, fp32), then,
// with the row still in L2, a pass writing the gradient. Memory bound: 2 reads and 1 write of the
// bf16 row, where the unfused softmax, one-hot and scaling make several fp32 passes. The gradient
// may overwrite the logits: in the second pass each thread writes only the values it has just
// read, and the label's logit is read before the barrier that ends the first pass (so the
// pointers carry no __restrict__ and the loads no read-only cache).
#include <cmath>

#include "cross_entropy.cuh"
#include "vec.cuh"

namespace sparse_llm {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <int n>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* p, float (&x)[n]) {
  if constexpr (n == kChunk) {
    bf16x8_to_float(*reinterpret_cast<const uint4*>(p), x);
  } else {
#pragma unroll
    for (int i = 0; i < n; ++i) x[i] = __bfloat162float(p[i]);
  }
}

template <int n>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* p, const float (&x)[n]) {
  if constexpr (n == kChunk) {
    *reinterpret_cast<uint4*>(p) = float_to_bf16x8(x);
  } else {
#pragma unroll
    for (int i = 0; i < n; ++i) p[i] = __float2bfloat16_rn(x[i]);
  }
}

// A running logsumexp: max and the sum of exp(x - max) over the values seen.
struct MaxSum {
  float max;
  float sum;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.f};  // nothing but -inf yet: exp(-inf - -inf) would be NaN
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// Adds n values (one vector load) to s: one rescale per vector rather than per value. A NaN value
// reaches the sum through exp (fmaxf skips it), so the row's loss comes out NaN, as torch's does.
template <int n>
__device__ __forceinline__ void accumulate(MaxSum& s, const float (&x)[n]) {
  float m = s.max;
#pragma unroll
  for (int i = 0; i < n; ++i) m = fmaxf(m, x[i]);
  if (m == -INFINITY) return;
  s.sum *= expf(s.max - m);
  s.max = m;
#pragma unroll
  for (int i = 0; i < n; ++i) s.sum += expf(x[i] - m);
}

__device__ MaxSum block_combine(MaxSum s) {
  __shared__ MaxSum warp_part[kWarps];
  __shared__ MaxSum total;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, s.max, offset), __shfl_xor_sync(0xffffffffu, s.sum, offset)};
    s = combine(s, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_part[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kWarps ? warp_part[lane] : MaxSum{-INFINITY, 0.f};
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const MaxSum other{__shfl_xor_sync(0xffffffffu, s.max, offset), __shfl_xor_sync(0xffffffffu, s.sum, offset)};
      s = combine(s, other);
    }
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// kVec: bf16 values per load (kChunk: 16-byte loads, needs vocab % 8 == 0 and aligned rows; 1: any).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_rows_kernel(const __nv_bfloat16* logits, int64_t vocab, const int64_t* __restrict__ labels,
                              int64_t ignore_index, const float* __restrict__ grad_scale,
                              float* __restrict__ loss_rows, __nv_bfloat16* grad) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* in = logits + row * vocab;
  const int64_t n_vec = vocab / kVec;
  const int64_t label = labels[row];
  const bool ignored = label == ignore_index;
  const bool in_range = label >= 0 && label < vocab;
  // Read before block_combine's barrier: in place, the second pass may overwrite it.
  const float label_logit = threadIdx.x == 0 && in_range ? __bfloat162float(in[label]) : 0.f;

  MaxSum s{-INFINITY, 0.f};
  for (int64_t v = threadIdx.x; v < n_vec; v += kThreads) {
    float x[kVec];
    load_bf16<kVec>(in + v * kVec, x);
    accumulate(s, x);
  }
  s = block_combine(s);
  const float lse = s.max + logf(s.sum);

  if (threadIdx.x == 0) loss_rows[row] = ignored ? 0.f : (in_range ? lse - label_logit : NAN);
  if (grad == nullptr) return;
  const float scale = ignored ? 0.f : (in_range ? *grad_scale : NAN);
  __nv_bfloat16* out = grad + row * vocab;
  for (int64_t v = threadIdx.x; v < n_vec; v += kThreads) {
    float x[kVec];
    load_bf16<kVec>(in + v * kVec, x);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float one_hot = v * kVec + i == label ? 1.f : 0.f;
      x[i] = (expf(x[i] - lse) - one_hot) * scale;
    }
    store_bf16<kVec>(out + v * kVec, x);
  }
}

}  // namespace

cudaError_t launch_cross_entropy_rows(const __nv_bfloat16* logits, int64_t rows, int64_t vocab, const int64_t* labels,
                                      int64_t ignore_index, const float* grad_scale, float* loss_rows,
                                      __nv_bfloat16* grad, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (vocab <= 0 || rows > 0x7fffffff) return cudaErrorInvalidValue;
  const bool aligned = vocab % kChunk == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                       (grad == nullptr || reinterpret_cast<uintptr_t>(grad) % 16 == 0);
  const dim3 grid(static_cast<unsigned>(rows));
  if (aligned) {
    cross_entropy_rows_kernel<kChunk>
        <<<grid, kThreads, 0, stream>>>(logits, vocab, labels, ignore_index, grad_scale, loss_rows, grad);
  } else {
    cross_entropy_rows_kernel<1>
        <<<grid, kThreads, 0, stream>>>(logits, vocab, labels, ignore_index, grad_scale, loss_rows, grad);
  }
  return cudaGetLastError();
}

}  // namespace sparse_llm
