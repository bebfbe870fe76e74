// ATen-side helpers shared by the native kernels: argument checks and rank padding.
#pragma once

#include <ATen/ATen.h>

namespace tncompile_native {

inline void check_cpu_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, what,
              ": float32 or float64 only, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2, what, ": 2-D matrices only, got ", t.sizes());
}

inline int64_t padded_rank(int64_t r) {
  constexpr int64_t L = 8;  // 8 fp32 = a half (AVX-512) or whole (AVX2) vector block of small_gemm
  return (r + L - 1) / L * L;
}

// (N x r) -> (N x cols), zero columns appended, contiguous
inline at::Tensor pad_columns(const at::Tensor& m, int64_t cols) {
  auto out = at::zeros({m.size(0), cols}, m.options());
  out.narrow(1, 0, m.size(1)).copy_(m);
  return out;
}

}  // namespace tncompile_native
