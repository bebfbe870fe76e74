// The wide middle of a feed-forward block of two TT linears, fused:
//
//   u = act(t @ W1 + b1) @ W2       t (M x r1), W1 (r1 x F), b1 (F), W2 (F x r2) -> u (M x r2)
//
// A TT linear contracted merge-cores-first is x -> x @ A -> (.) @ B + bias, so
// in `second(act(first(x)))` the F-wide hidden activation (F = 3072 for a
// BERT-base block) sits between first's expand (t @ B1 + b1) and second's
// project ((.) @ A2). Unfused, a training step writes that activation, reads
// it for the activation function, writes and reads the result, and in
// backward does the same with their gradients: ~10 passes over M x F floats,
// where the arithmetic around them (rank r1, r2 <= 64) is small. Here rows are
// taken kRows at a time; a chunk's hidden activation lives in a per-thread
// buffer that stays in cache (kTile hidden units at a time), and backward recomputes it from t instead of
// keeping it (so the block saves only t and u, not two M x F tensors).
//
// Backward, per chunk (y = t W1 + b1, g = act(y)):
//   dW2 += g^T du,   dg = du W2^T,   dy = dg * act'(y),
//   [dW1; db1] += [t, 1]^T dy,   dt = dy W1^T
// with dW1, db1, dW2 accumulated per thread and summed at the end.
//
// The activation runs on each cached chunk: float32 GELU (erf) through
// vector_math.h (within 5e-7 of the exact GELU, as close as PyTorch's own
// float32 GELU, and several times faster than ATen called on small chunks);
// everything else through ATen (at::gelu_, at::relu_, their backward).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "small_gemm.h"
#include "vector_math.h"
#include "tensor_checks.h"

namespace tncompile_native {

namespace {

// Rows per chunk, and hidden units per tile: a chunk's hidden activation is computed kTile units
// at a time, so its buffers (96 x 512 fp32 = 196 KB each), the weight tiles it reads and the weight-
// gradient tiles it accumulates stay in L2 together; the chunk is tall enough that those gradient
// tiles are read and written once per 96 rows, not once per few rows.
constexpr int64_t kRows = 96;
constexpr int64_t kTile = 512;

enum class Act { Gelu, GeluTanh, Relu };

Act parse_activation(c10::string_view name) {
  if (name == "gelu") return Act::Gelu;
  if (name == "gelu_tanh") return Act::GeluTanh;
  if (name == "relu") return Act::Relu;
  TORCH_CHECK(false, "tt_feed_forward: unknown activation '", std::string(name),
              "'; use 'gelu', 'gelu_tanh' or 'relu'");
}

void activate_(at::Tensor& y, Act act) {
  if (act == Act::Gelu && y.scalar_type() == at::kFloat && y.is_contiguous()) {
    vmath::gelu_(y.data_ptr<float>(), y.numel());
    return;
  }
  switch (act) {
    case Act::Gelu: at::gelu_(y, "none"); break;
    case Act::GeluTanh: at::gelu_(y, "tanh"); break;
    case Act::Relu: at::relu_(y); break;
  }
}

// grad (dL/d act(y)) becomes dL/dy, in place
void activation_backward_(at::Tensor& grad, const at::Tensor& y, Act act) {
  switch (act) {
    case Act::Gelu: at::gelu_backward_out(grad, grad, y, "none"); break;
    case Act::GeluTanh: at::gelu_backward_out(grad, grad, y, "tanh"); break;
    case Act::Relu: at::threshold_backward_out(grad, grad, y, 0); break;
  }
}

struct Shapes {
  int64_t M, K1, F, K2;
};

Shapes check_shapes(const at::Tensor& t, const at::Tensor& w1, const c10::optional<at::Tensor>& b1,
                    const at::Tensor& w2, const char* what) {
  check_cpu_float(t, what);
  check_cpu_float(w1, what);
  check_cpu_float(w2, what);
  TORCH_CHECK(w1.scalar_type() == t.scalar_type() && w2.scalar_type() == t.scalar_type(), what,
              ": t, W1 and W2 must share a dtype");
  const Shapes s{t.size(0), t.size(1), w1.size(1), w2.size(1)};
  TORCH_CHECK(w1.size(0) == s.K1 && w2.size(0) == s.F, what, ": need t (M x r1), W1 (r1 x F), W2 (F x r2), got ",
              t.sizes(), ", ", w1.sizes(), ", ", w2.sizes());
  if (b1.has_value() && b1->defined())
    TORCH_CHECK(b1->numel() == s.F && b1->scalar_type() == t.scalar_type(), what, ": b1 must have F = ", s.F,
                " elements of t's dtype");
  return s;
}

// Static split of the row chunks over threads: each part owns one set of buffers.
int64_t parts_for(int64_t chunks) { return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks)); }

}  // namespace

at::Tensor ffn_forward(const at::Tensor& t_, const at::Tensor& w1_, const c10::optional<at::Tensor>& b1_,
                       const at::Tensor& w2_, c10::string_view activation) {
  const Shapes s = check_shapes(t_, w1_, b1_, w2_, "tt_feed_forward");
  const Act act = parse_activation(activation);
  const auto t = t_.contiguous(), w1 = w1_.contiguous();
  const int64_t K2P = padded_rank(s.K2);
  const auto w2p = pad_columns(w2_, K2P);
  const auto b1 = (b1_.has_value() && b1_->defined()) ? b1_->contiguous() : at::Tensor();
  auto out = at::empty({s.M, K2P}, t.options());
  const int64_t chunks = (s.M + kRows - 1) / kRows, parts = parts_for(chunks), per = (chunks + parts - 1) / parts;
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "ffn_forward", [&] {
    const scalar_t* tp = t.data_ptr<scalar_t>();
    const scalar_t* w1p = w1.data_ptr<scalar_t>();
    const scalar_t* w2pp = w2p.data_ptr<scalar_t>();
    const scalar_t* bp = b1.defined() ? b1.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      auto hidden = at::empty({kRows * std::min(kTile, s.F)}, t.options());
      scalar_t* hp = hidden.data_ptr<scalar_t>();
      for (int64_t part = p0; part < p1; ++part)
        for (int64_t c = part * per; c < std::min(chunks, (part + 1) * per); ++c) {
          const int64_t m0 = c * kRows, rows = std::min(kRows, s.M - m0);
          for (int64_t f0 = 0; f0 < s.F; f0 += kTile) {  // u = sum over tiles of act(t W1[:, tile] + b1) W2[tile]
            const int64_t fw = std::min(kTile, s.F - f0);
            small_gemm<scalar_t>(tp + m0 * s.K1, s.K1, 1, w1p + f0, s.F, hp, fw, rows, s.K1, fw, false,
                                 bp ? bp + f0 : nullptr);
            auto h = hidden.narrow(0, 0, rows * fw);
            activate_(h, act);
            small_gemm<scalar_t>(hp, fw, 1, w2pp + f0 * K2P, K2P, op + m0 * K2P, K2P, rows, fw, K2P, f0 > 0);
          }
        }
    });
  });
  return K2P == s.K2 ? out : out.narrow(1, 0, s.K2);
}

std::vector<at::Tensor> ffn_backward(const at::Tensor& du_, const at::Tensor& t_, const at::Tensor& w1_,
                                     const c10::optional<at::Tensor>& b1_, const at::Tensor& w2_,
                                     c10::string_view activation, bool need_t, bool need_w1, bool need_b1,
                                     bool need_w2) {
  const Shapes s = check_shapes(t_, w1_, b1_, w2_, "tt_feed_forward backward");
  check_cpu_float(du_, "tt_feed_forward backward");
  TORCH_CHECK(du_.size(0) == s.M && du_.size(1) == s.K2, "tt_feed_forward backward: du must be (", s.M, " x ", s.K2,
              "), got ", du_.sizes());
  const Act act = parse_activation(activation);
  const auto opts = t_.options();
  const auto t = t_.contiguous(), w1 = w1_.contiguous();
  const int64_t K2P = padded_rank(s.K2);
  const auto du = pad_columns(du_.to(t.scalar_type()), K2P);  // whole vectors for dW2's columns
  const auto w2t = w2_.t().contiguous();  // (r2 x F): dg = du @ W2^T as a row-major product
  const auto b1 = (b1_.has_value() && b1_->defined()) ? b1_->contiguous() : at::Tensor();
  const int64_t K1P = padded_rank(s.K1);
  const auto w1t = need_t ? pad_columns(w1.t(), K1P) : at::Tensor();  // (F x r1 padded)
  need_b1 = need_b1 && b1.defined();
  // t with a ones column: db1 is one more row of dW1's product
  const int64_t KE = s.K1 + (need_b1 ? 1 : 0);
  at::Tensor te;
  if (need_w1 || need_b1) {
    te = at::empty({s.M, KE}, opts);
    if (need_w1) te.narrow(1, 0, s.K1).copy_(t); else te.narrow(1, 0, s.K1).zero_();
    if (need_b1) te.select(1, s.K1).fill_(1);
  }
  const int64_t chunks = (s.M + kRows - 1) / kRows, parts = parts_for(chunks), per = (chunks + parts - 1) / parts;
  auto dt = need_t ? at::empty({s.M, K1P}, opts) : at::Tensor();
  auto acc1 = te.defined() ? at::zeros({parts, KE, s.F}, opts) : at::Tensor();   // per-thread [dW1; db1]
  auto acc2 = need_w2 ? at::zeros({parts, s.F, K2P}, opts) : at::Tensor();        // per-thread dW2
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "ffn_backward", [&] {
    const scalar_t* tp = t.data_ptr<scalar_t>();
    const scalar_t* w1p = w1.data_ptr<scalar_t>();
    const scalar_t* w2tp = w2t.data_ptr<scalar_t>();
    const scalar_t* w1tp = need_t ? w1t.data_ptr<scalar_t>() : nullptr;
    const scalar_t* bp = b1.defined() ? b1.data_ptr<scalar_t>() : nullptr;
    const scalar_t* dup = du.data_ptr<scalar_t>();
    const scalar_t* tep = te.defined() ? te.data_ptr<scalar_t>() : nullptr;
    scalar_t* dtp = need_t ? dt.data_ptr<scalar_t>() : nullptr;
    scalar_t* a1p = acc1.defined() ? acc1.data_ptr<scalar_t>() : nullptr;
    scalar_t* a2p = need_w2 ? acc2.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      const int64_t tile = std::min(kTile, s.F);
      auto pre = at::empty({kRows * tile}, opts), work = at::empty({kRows * tile}, opts);
      scalar_t* yp = pre.data_ptr<scalar_t>();
      scalar_t* wp = work.data_ptr<scalar_t>();
      // float GELU: act(y) into the work buffer and act'(y) over y in one pass
      constexpr bool kFloat = std::is_same_v<scalar_t, float>;
      const bool both = act == Act::Gelu && kFloat;
      for (int64_t part = p0; part < p1; ++part)
        for (int64_t c = part * per; c < std::min(chunks, (part + 1) * per); ++c) {
          const int64_t m0 = c * kRows, rows = std::min(kRows, s.M - m0);
          const scalar_t* duc = dup + m0 * K2P;
          for (int64_t f0 = 0; f0 < s.F; f0 += kTile) {  // hidden units [f0, f0 + fw) of the chunk's rows
            const int64_t fw = std::min(kTile, s.F - f0), n = rows * fw;
            auto y = pre.narrow(0, 0, n), g = work.narrow(0, 0, n);
            small_gemm<scalar_t>(tp + m0 * s.K1, s.K1, 1, w1p + f0, s.F, yp, fw, rows, s.K1, fw, false,
                                 bp ? bp + f0 : nullptr);
            if (both) vmath::gelu_and_derivative_(reinterpret_cast<float*>(yp), reinterpret_cast<float*>(wp), n);
            if (need_w2) {  // dW2[tile] += act(y)^T du
              if (!both) {
                g.copy_(y);
                activate_(g, act);
              }
              small_gemm<scalar_t>(wp, 1, fw, duc, K2P, a2p + (part * s.F + f0) * K2P, K2P, fw, rows, K2P, true);
            }
            if (!need_t && !tep) continue;
            // dg = du W2[tile]^T, then dy = dg * act'(y), in the work buffer
            small_gemm<scalar_t>(duc, K2P, 1, w2tp + f0, s.F, wp, fw, rows, s.K2, fw, false);
            if (both) {
              for (int64_t e = 0; e < n; ++e) wp[e] *= yp[e];
            } else {
              activation_backward_(g, y, act);
            }
            if (tep)  // [dW1; db1][:, tile] += [t, 1]^T dy
              small_gemm<scalar_t>(tep + m0 * KE, 1, KE, wp, fw, a1p + part * KE * s.F + f0, s.F, KE, rows, fw,
                                   true);
            if (need_t)  // dt += dy W1[:, tile]^T
              small_gemm<scalar_t>(wp, fw, 1, w1tp + f0 * K1P, K1P, dtp + m0 * K1P, K1P, rows, fw, K1P, f0 > 0);
          }
        }
    });
  });
  at::Tensor d_t, d_w1, d_b1, d_w2;
  if (need_t) d_t = K1P == s.K1 ? dt : dt.narrow(1, 0, s.K1);
  if (acc1.defined()) {
    const auto total = acc1.sum(0);
    if (need_w1) d_w1 = total.narrow(0, 0, s.K1);
    if (need_b1) d_b1 = total.select(0, s.K1);
  }
  if (need_w2) d_w2 = acc2.sum(0).narrow(1, 0, s.K2);
  return {d_t, d_w1, d_b1, d_w2};
}

}  // namespace tncompile_native

TORCH_LIBRARY_FRAGMENT(tncompile, m) {
  m.def("ffn_forward(Tensor t, Tensor w1, Tensor? b1, Tensor w2, str activation) -> Tensor",
        tncompile_native::ffn_forward);
  m.def("ffn_backward(Tensor du, Tensor t, Tensor w1, Tensor? b1, Tensor w2, str activation, bool need_t, "
        "bool need_w1, bool need_b1, bool need_w2) -> Tensor[]",
        tncompile_native::ffn_backward);
}
