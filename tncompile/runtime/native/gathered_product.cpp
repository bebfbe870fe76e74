// Gathered batched product of a TTM lookup, fused with its gathers and scatters.
//
//   out[t] = L[i[t]] @ R[j[t]]           L (M_L, N_L, r), R (M_R, r, N_R), out (T, N_L, N_R)
//   dL[i[t]] += dout[t] @ R[j[t]]^T      dR[j[t]] += L[i[t]]^T @ dout[t]
//
// The half tables L and R are small (they sit in cache); the gathered slices
// L[i], R[j] are not materialized, and the backward accumulates straight into
// per-thread copies of dL and dR instead of writing one product per id and
// scattering it. Each product is a small GEMM (small_gemm.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "small_gemm.h"

namespace tncompile_native {

void check_gathered(const at::Tensor& left, const at::Tensor& right, const at::Tensor& i, const at::Tensor& j) {
  TORCH_CHECK(left.device().is_cpu() && right.device().is_cpu(), "gathered_product: CPU tensors only");
  TORCH_CHECK(left.dim() == 3 && right.dim() == 3 && left.size(2) == right.size(1),
              "gathered_product: need L (M_L, N_L, r) and R (M_R, r, N_R), got ", left.sizes(), " and ",
              right.sizes());
  TORCH_CHECK(left.scalar_type() == right.scalar_type(), "gathered_product: L and R dtypes differ");
  TORCH_CHECK(i.scalar_type() == at::kLong && j.scalar_type() == at::kLong && i.dim() == 1 &&
                  j.sizes() == i.sizes(),
              "gathered_product: i and j must be int64 vectors of one length");
  if (i.numel()) {
    TORCH_CHECK(i.min().item<int64_t>() >= 0 && i.max().item<int64_t>() < left.size(0) &&
                    j.min().item<int64_t>() >= 0 && j.max().item<int64_t>() < right.size(0),
                "gathered_product: index out of range");
  }
}

at::Tensor gathered_product(const at::Tensor& left, const at::Tensor& right, const at::Tensor& i,
                            const at::Tensor& j) {
  check_gathered(left, right, i, j);
  const auto L = left.contiguous(), R = right.contiguous(), I = i.contiguous(), J = j.contiguous();
  const int64_t n = I.numel(), nl = L.size(1), rank = L.size(2), nr = R.size(2);
  auto out = at::empty({n, nl, nr}, L.options());
  AT_DISPATCH_FLOATING_TYPES(L.scalar_type(), "gathered_product", [&] {
    const scalar_t* l = L.data_ptr<scalar_t>();
    const scalar_t* r = R.data_ptr<scalar_t>();
    const int64_t* ii = I.data_ptr<int64_t>();
    const int64_t* jj = J.data_ptr<int64_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        small_gemm<scalar_t>(l + ii[t] * nl * rank, rank, 1, r + jj[t] * rank * nr, nr, o + t * nl * nr, nr,
                             nl, rank, nr, false);
    });
  });
  return out;
}

std::vector<at::Tensor> gathered_product_backward(const at::Tensor& grad, const at::Tensor& left,
                                                  const at::Tensor& right, const at::Tensor& i,
                                                  const at::Tensor& j, bool need_left, bool need_right) {
  check_gathered(left, right, i, j);
  const int64_t n = i.numel(), nl = left.size(1), rank = left.size(2), nr = right.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == n && grad.size(1) == nl && grad.size(2) == nr,
              "gathered_product_backward: grad must be (T, N_L, N_R)");
  const auto G = grad.to(left.scalar_type()).contiguous(), L = left.contiguous();
  const auto I = i.contiguous(), J = j.contiguous();
  // dL's products have r columns: R[j]^T and dL's accumulators are padded with zero columns
  // to a whole number of the GEMM's narrowest vector (30 -> 32 fp32), so no column runs scalar
  const int64_t rank_pad = AT_DISPATCH_FLOATING_TYPES(L.scalar_type(), "gathered_rank_pad", [&] {
    return round_up(rank, narrowest_lanes<scalar_t>());
  });
  at::Tensor RT;  // (M_R, N_R, r_pad): R[j]^T row-major
  if (need_left) {
    RT = at::zeros({right.size(0), nr, rank_pad}, L.options());
    RT.narrow(2, 0, rank).copy_(right.transpose(1, 2));
  }
  // one private accumulator per thread, summed at the end (no atomics, deterministic per thread count)
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + 15) / 16));
  at::Tensor gl, gr;
  if (need_left) gl = at::zeros({threads, left.size(0), nl, rank_pad}, L.options());
  if (need_right) gr = at::zeros({threads, right.size(0), rank, nr}, L.options());
  const int64_t l_size = left.size(0) * nl * rank_pad, r_size = right.numel();
  AT_DISPATCH_FLOATING_TYPES(L.scalar_type(), "gathered_product_backward", [&] {
    const scalar_t* g = G.data_ptr<scalar_t>();
    const scalar_t* l = L.data_ptr<scalar_t>();
    const scalar_t* rt = need_left ? RT.data_ptr<scalar_t>() : nullptr;
    const int64_t* ii = I.data_ptr<int64_t>();
    const int64_t* jj = J.data_ptr<int64_t>();
    scalar_t* gl_p = need_left ? gl.data_ptr<scalar_t>() : nullptr;
    scalar_t* gr_p = need_right ? gr.data_ptr<scalar_t>() : nullptr;
    const int64_t chunk = (n + threads - 1) / threads;
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      for (int64_t part = first; part < last; ++part) {
        for (int64_t t = part * chunk; t < std::min(n, (part + 1) * chunk); ++t) {
          const scalar_t* gt = g + t * nl * nr;
          if (gl_p)  // dL[i] += dout[t] (N_L x N_R) @ R[j]^T (N_R x r_pad)
            small_gemm<scalar_t>(gt, nr, 1, rt + jj[t] * nr * rank_pad, rank_pad,
                                 gl_p + part * l_size + ii[t] * nl * rank_pad, rank_pad, nl, nr, rank_pad, true);
          if (gr_p)  // dR[j] += L[i]^T (r x N_L) @ dout[t] (N_L x N_R)
            small_gemm<scalar_t>(l + ii[t] * nl * rank, 1, rank, gt, nr,
                                 gr_p + part * r_size + jj[t] * rank * nr, nr, rank, nl, nr, true);
        }
      }
    });
  });
  at::Tensor d_left;
  if (need_left) {
    d_left = gl.sum(0);
    if (rank_pad != rank) d_left = d_left.narrow(2, 0, rank).contiguous();
  }
  return {d_left, need_right ? gr.sum(0) : at::Tensor()};
}

}  // namespace tncompile_native

TORCH_LIBRARY_FRAGMENT(tncompile, m) {
  m.def("gathered_product(Tensor left, Tensor right, Tensor i, Tensor j) -> Tensor",
        tncompile_native::gathered_product);
  m.def("gathered_product_backward(Tensor grad, Tensor left, Tensor right, Tensor i, Tensor j, "
        "bool need_left, bool need_right) -> Tensor[]",
        tncompile_native::gathered_product_backward);
}
