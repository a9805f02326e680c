// Helpers shared by the torch bindings (bindings.cpp, train_bindings.cpp): pointer casts, input
// checks with clear messages (raised in Python as ValueError, see errors.h), the transposes as
// torch ops, and an early host read.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "errors.h"
#include "twell.cuh"

namespace sparse_llm_glue {

inline const __nv_bfloat16* bf16_ptr(const at::Tensor& t) {
  return reinterpret_cast<const __nv_bfloat16*>(t.data_ptr<at::BFloat16>());
}
inline __nv_bfloat16* bf16_mut_ptr(at::Tensor& t) { return reinterpret_cast<__nv_bfloat16*>(t.data_ptr<at::BFloat16>()); }

inline void check_matrix(const at::Tensor& t, const char* name, at::ScalarType dtype = at::kBFloat16) {
  SL_CHECK_ARG(t.is_cuda(), name, " must be a CUDA tensor");
  SL_CHECK_ARG(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  SL_CHECK_ARG(t.dim() == 2, name, " must be 2-D, got shape ", t.sizes());
  SL_CHECK_ARG(t.is_contiguous(), name, " must be contiguous");
  SL_CHECK_ARG(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw KernelError(c10::str(what, " failed: ", cudaGetErrorString(err)));
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// The dense path's GEMMs run on the heavy rows gathered into a buffer whose row count is rounded
// up to kHeavyRowsGranule, the extra rows zero: their shapes then repeat from call to call and
// cuBLAS's heuristic cache answers (a new shape, every step with a data-dependent row count, cost
// ~0.1-0.4 ms of CPU per GEMM, and the step's GPU waited for it).
constexpr int64_t kHeavyRowsGranule = 64;

// rows[list[i]] for i < n (or i < min(*count, n) where count, on the device, is given), then zero
// rows up to `padded`: [padded, cols], in one launch (no ATen index_select and its half-dozen ops).
// rows: a contiguous 2-D CUDA tensor of any dtype, 16-byte aligned, whose rows are a multiple of 16
// bytes; list: int64 on the device, at least n long.
inline at::Tensor gather_rows(const at::Tensor& rows, const at::Tensor& list, int64_t n, int64_t padded,
                              const int64_t* count = nullptr) {
  SL_CHECK_ARG(rows.is_cuda() && rows.dim() == 2 && rows.is_contiguous(),
               "gather_rows takes a contiguous 2-D CUDA tensor");
  const int64_t row_bytes = rows.size(1) * rows.element_size();
  SL_CHECK_ARG(row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0,
               "gather_rows needs 16-byte aligned rows of a multiple of 16 bytes");
  at::Tensor out = at::empty({padded, rows.size(1)}, rows.options());
  check_cuda(sparse_llm::launch_gather_rows_padded(rows.data_ptr(), list.data_ptr<int64_t>(), count, n, padded,
                                                   row_bytes, out.data_ptr(), current_stream()),
             "gather_rows_padded");
  return out;
}

// Row counts of the heavy rows' GEMMs: rounded up to the granule.
inline int64_t heavy_gemm_rows(int64_t n) {
  return (n + kHeavyRowsGranule - 1) / kHeavyRowsGranule * kHeavyRowsGranule;
}

// The heavy rows gathered for their GEMMs: rows[list], zero rows up to the granule.
inline at::Tensor gather_rows_padded(const at::Tensor& rows, const at::Tensor& list) {
  return gather_rows(rows, list, list.size(0), heavy_gemm_rows(list.size(0)));
}

// The first n elements of a contiguous vector, copied (one memcpy, no ATen copy kernel).
inline at::Tensor prefix_copy(const at::Tensor& t, int64_t n) {
  at::Tensor out = at::empty({n}, t.options());
  if (n > 0)
    check_cuda(cudaMemcpyAsync(out.data_ptr(), t.data_ptr(), n * t.element_size(), cudaMemcpyDeviceToDevice,
                               current_stream()),
               "cudaMemcpyAsync");
  return out;
}

// A host read of a few device values that does not wait for the whole queue: the constructor
// queues their copy into pinned memory and marks the stream there; the caller queues more work,
// then values() waits only for the copy, so the GPU stays busy with that work while the host reads.
class EarlyHostRead {
 public:
  EarlyHostRead(const at::Tensor& device_values, cudaStream_t stream)
      : host_(at::empty(device_values.sizes(), device_values.options().device(at::kCPU).pinned_memory(true))) {
    host_.copy_(device_values, /*non_blocking=*/true);
    check_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(ready_, stream), "cudaEventRecord");
  }
  EarlyHostRead(const EarlyHostRead&) = delete;
  EarlyHostRead& operator=(const EarlyHostRead&) = delete;
  ~EarlyHostRead() { cudaEventDestroy(ready_); }

  // The values on the host (a pinned CPU tensor shaped like the device values).
  const at::Tensor& values() {
    check_cuda(cudaEventSynchronize(ready_), "cudaEventSynchronize");
    return host_;
  }

 private:
  at::Tensor host_;
  cudaEvent_t ready_ = nullptr;
};

inline at::Tensor transpose_bf16(const at::Tensor& t) {
  check_matrix(t, "t");
  const c10::cuda::CUDAGuard guard(t.device());
  at::Tensor out = at::empty({t.size(1), t.size(0)}, t.options());
  check_cuda(sparse_llm::launch_transpose_bf16(bf16_ptr(t), t.size(0), t.size(1), bf16_mut_ptr(out), current_stream()),
             "transpose");
  return out;
}

// t transposed into `dtype`, in one pass: a bf16 t to bf16, a float t to bf16 or float.
inline at::Tensor transpose_as(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == at::kBFloat16 && dtype == at::kBFloat16) return transpose_bf16(t);
  SL_CHECK_ARG(t.is_cuda() && t.dim() == 2 && t.is_contiguous() && t.scalar_type() == at::kFloat,
               "transpose_as takes a contiguous 2-D bf16 or float CUDA tensor, got ", t.scalar_type());
  SL_CHECK_ARG(dtype == at::kBFloat16 || dtype == at::kFloat, "transpose_as writes bf16 or float");
  const c10::cuda::CUDAGuard guard(t.device());
  at::Tensor out = at::empty({t.size(1), t.size(0)}, t.options().dtype(dtype));
  const float* src = t.data_ptr<float>();
  const cudaError_t err =
      dtype == at::kFloat
          ? sparse_llm::launch_transpose(src, t.size(0), t.size(1), out.data_ptr<float>(), current_stream())
          : sparse_llm::launch_transpose(src, t.size(0), t.size(1), bf16_mut_ptr(out), current_stream());
  check_cuda(err, "transpose");
  return out;
}

}  // namespace sparse_llm_glue
