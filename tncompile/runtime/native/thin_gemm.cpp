// The two big GEMMs of a TT layer's wide side, and their backward in one pass.
//
// A TT linear contracted merge-cores-first is  x (M x N_in) -> t = x @ A (M x r)
// -> y = t @ B + bias (M x N_out), with r (a rank, 8-64) much smaller than M and
// the N's. The GEMMs that touch the wide activations are thin:
//
//   expand:  y = t @ B + bias            (M x r) @ (r x N): output-bound
//   project: t = x @ A                   (M x N) @ (N x r): input-bound
//   expand backward: dt = dy @ B^T, dB = t^T @ dy, dbias = 1^T dy
//
// CPU BLAS runs these at a fraction of its square-GEMM speed (packing
// overhead around a tiny r). Here r is padded to whole vectors, rows are
// split across threads, and the expand backward reads dy once, in chunks of
// rows that stay in L2 while both of its products use them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "small_gemm.h"
#include "tensor_checks.h"

namespace tncompile_native {

namespace {

constexpr int64_t kChunkRows = 48;            // rows of dy per chunk: 48 x 3072 fp32 = 590 KB, within L2
constexpr int64_t kStreamElements = 1 << 22;  // outputs from 16 MB (fp32) on bypass the caches

// c (rows x kp) = x (rows x n, row-major) @ wt (n x kp)
template <typename T>
void project_rows(const T* x, const T* wt, T* c, int64_t rows, int64_t n, int64_t kp) {
  small_gemm<T>(x, n, 1, wt, kp, c, kp, rows, n, kp, false);
}

}  // namespace

at::Tensor thin_expand(const at::Tensor& t_, const at::Tensor& w_, const c10::optional<at::Tensor>& bias_) {
  check_cpu_float(t_, "thin_expand");
  check_cpu_float(w_, "thin_expand");
  TORCH_CHECK(t_.size(1) == w_.size(0), "thin_expand: (M x r) @ (r x N) shapes, got ", t_.sizes(), " and ",
              w_.sizes());
  const auto t = t_.contiguous(), w = w_.to(t.scalar_type()).contiguous();
  const int64_t M = t.size(0), K = t.size(1), N = w.size(1);
  at::Tensor bias;
  if (bias_.has_value() && bias_->defined()) {
    TORCH_CHECK(bias_->numel() == N, "thin_expand: bias must have N = ", N, " elements");
    bias = bias_->to(t.scalar_type()).contiguous();
  }
  auto y = at::empty({M, N}, t.options());
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "thin_expand", [&] {
    const scalar_t* tp = t.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const scalar_t* bp = bias.defined() ? bias.data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    const bool stream = M * N >= kStreamElements;
    at::parallel_for(0, (M + MR - 1) / MR, 8, [&](int64_t b0, int64_t b1) {
      streaming_stores = stream;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t m0 = blk * MR, rows = std::min(MR, M - m0);
        small_gemm<scalar_t>(tp + m0 * K, K, 1, wp, N, yp + m0 * N, N, rows, K, N, false, bp);
      }
      if (stream) stream_fence();
      streaming_stores = false;
    });
  });
  return y;
}

at::Tensor thin_project(const at::Tensor& x_, const at::Tensor& w_) {
  check_cpu_float(x_, "thin_project");
  check_cpu_float(w_, "thin_project");
  TORCH_CHECK(x_.size(1) == w_.size(0), "thin_project: (M x N) @ (N x r) shapes, got ", x_.sizes(), " and ",
              w_.sizes());
  const auto x = x_.contiguous();
  const int64_t M = x.size(0), N = x.size(1), K = w_.size(1), KP = padded_rank(K);
  const auto wt = pad_columns(w_.to(x.scalar_type()), KP);
  auto out = at::empty({M, KP}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "thin_project", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = wt.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, (M + kChunkRows - 1) / kChunkRows, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t m0 = c * kChunkRows, rows = std::min(kChunkRows, M - m0);
        project_rows<scalar_t>(xp + m0 * N, wp, op + m0 * KP, rows, N, KP);
      }
    });
  });
  return KP == K ? out : out.narrow(1, 0, K);
}

std::vector<at::Tensor> thin_expand_backward(const at::Tensor& g_, const at::Tensor& t_, const at::Tensor& w_,
                                             bool need_t, bool need_w, bool need_bias) {
  check_cpu_float(g_, "thin_expand_backward");
  check_cpu_float(t_, "thin_expand_backward");
  check_cpu_float(w_, "thin_expand_backward");
  const int64_t M = g_.size(0), N = g_.size(1), K = t_.size(1);
  TORCH_CHECK(t_.size(0) == M && w_.size(0) == K && w_.size(1) == N,
              "thin_expand_backward: need dy (M x N), t (M x r), B (r x N), got ", g_.sizes(), ", ", t_.sizes(),
              ", ", w_.sizes());
  const auto g = g_.contiguous();
  const auto opts = g.options();
  const int64_t KP = padded_rank(K);
  at::Tensor wt, te;
  if (need_t) wt = pad_columns(w_.t().to(g.scalar_type()), KP);  // B^T (N x KP)
  const int64_t KE = K + (need_bias ? 1 : 0);  // t with a ones column: the bias gradient is one more row of dB
  if (need_w || need_bias) {
    te = at::empty({M, KE}, opts);
    te.narrow(1, 0, K).copy_(t_);
    if (need_bias) te.select(1, K).fill_(1);
    if (!need_w) te.narrow(1, 0, K).zero_();
  }
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks));
  at::Tensor gt = need_t ? at::empty({M, KP}, opts) : at::Tensor();
  at::Tensor gw = te.defined() ? at::zeros({parts, KE, N}, opts) : at::Tensor();  // one accumulator per thread
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "thin_expand_backward", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* wtp = need_t ? wt.data_ptr<scalar_t>() : nullptr;
    const scalar_t* tep = te.defined() ? te.data_ptr<scalar_t>() : nullptr;
    scalar_t* gtp = need_t ? gt.data_ptr<scalar_t>() : nullptr;
    scalar_t* gwp = gw.defined() ? gw.data_ptr<scalar_t>() : nullptr;
    const int64_t per = (chunks + parts - 1) / parts;
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t part = p0; part < p1; ++part) {
        for (int64_t c = part * per; c < std::min(chunks, (part + 1) * per); ++c) {
          const int64_t m0 = c * kChunkRows, rows = std::min(kChunkRows, M - m0);
          const scalar_t* gc = gp + m0 * N;
          if (gtp) project_rows<scalar_t>(gc, wtp, gtp + m0 * KP, rows, N, KP);   // dt = dy @ B^T
          if (gwp)  // [dB; dbias] += [t, 1]^T @ dy, while the chunk is still in cache
            small_gemm<scalar_t>(tep + m0 * KE, 1, KE, gc, N, gwp + part * KE * N, N, KE, rows, N, true);
        }
      }
    });
  });
  at::Tensor d_t, d_w, d_bias;
  if (need_t) d_t = KP == K ? gt : gt.narrow(1, 0, K);
  if (gw.defined()) {
    const auto total = gw.sum(0);
    if (need_w) d_w = total.narrow(0, 0, K);
    if (need_bias) d_bias = total.select(0, K);
  }
  return {d_t, d_w, d_bias};
}

}  // namespace tncompile_native

TORCH_LIBRARY_FRAGMENT(tncompile, m) {
  m.def("thin_expand(Tensor t, Tensor w, Tensor? bias) -> Tensor", tncompile_native::thin_expand);
  m.def("thin_project(Tensor x, Tensor w) -> Tensor", tncompile_native::thin_project);
  m.def("thin_expand_backward(Tensor g, Tensor t, Tensor w, bool need_t, bool need_w, bool need_bias) -> Tensor[]",
        tncompile_native::thin_expand_backward);
}
