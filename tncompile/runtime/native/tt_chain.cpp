// A whole TT linear over a few rows, forward and backward, in one call each.
//
// At a few tokens a TT layer is ~20 tiny GEMMs plus its gate products; as
// separate PyTorch ops each costs several microseconds of dispatch and
// bookkeeping, which makes the layer slower than the dense matrix-vector
// product it replaces. Here the input walks through the cores one by one
// (the order that is cheapest for a few rows) with every product a
// small_gemm on raw pointers.
//
// Cores: d input cores (r[k-1], m[k], r[k]) then e output cores (r, n, r'),
// r[0] = r[d+e] = 1. Gate k (k = 1 .. d+e-1) scales bond k, the right bond of
// core k-1. Intermediates (u = before the gate, h = u * gate):
//   input core k:  u_k[row] (R_k x r_k) = sum_m h_{k-1}[row, m] (R_k x r_{k-1}) @ G_k[:, m, :]
//                  with h_0 = x viewed (rows, m_1, R_1), R_k = m_{k+1} ... m_d
//   output core j: u[row] (P x n r') = h[row] (P x r) @ G (r x n r'), P = n_1 ... n_{j-1}
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "small_gemm.h"

namespace tncompile_native {

namespace {

struct Chain {
  int64_t rows, n_in, n_cores;
  std::vector<int64_t> left, mode, right;  // per core: r_{k-1}, its mode (m or n), r_k
  std::vector<int64_t> count;              // per core: elements per row of its result u_k
};

Chain describe(const at::Tensor& x, const std::vector<at::Tensor>& cores, const std::vector<at::Tensor>& gates,
               int64_t n_in) {
  Chain c;
  c.n_cores = static_cast<int64_t>(cores.size());
  c.n_in = n_in;
  TORCH_CHECK(n_in >= 1 && n_in < c.n_cores, "tt_chain: need 1 <= input cores < cores");
  TORCH_CHECK(static_cast<int64_t>(gates.size()) == c.n_cores - 1, "tt_chain: one gate per internal bond");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "tt_chain: x must be a CPU matrix (rows, features)");
  c.rows = x.size(0);
  int64_t in_size = 1, prev = 1;
  for (int64_t k = 0; k < c.n_cores; ++k) {
    const auto& g = cores[k];
    TORCH_CHECK(g.dim() == 3 && g.size(0) == prev && g.scalar_type() == x.scalar_type(),
                "tt_chain: core ", k, " must be (", prev, ", mode, rank) of x's dtype, got ", g.sizes());
    c.left.push_back(g.size(0));
    c.mode.push_back(g.size(1));
    c.right.push_back(g.size(2));
    if (k < n_in) in_size *= g.size(1);
    if (k < c.n_cores - 1)
      TORCH_CHECK(gates[k].numel() == g.size(2), "tt_chain: gate ", k, " must have ", g.size(2), " entries");
    prev = g.size(2);
  }
  TORCH_CHECK(prev == 1, "tt_chain: the last core's right rank must be 1");
  TORCH_CHECK(x.size(1) == in_size, "tt_chain: x has ", x.size(1), " features, the input modes make ", in_size);
  int64_t rest = in_size, done = 1;
  for (int64_t k = 0; k < c.n_cores; ++k) {
    if (k < n_in) {
      rest /= c.mode[k];
      c.count.push_back(rest * c.right[k]);
    } else {
      done *= c.mode[k];
      c.count.push_back(done * c.right[k]);
    }
  }
  return c;
}

// rows of "rest" (input side: modes after core k) or "done" (output side: modes before core k) of u_{k-1}
int64_t block_rows(const Chain& c, int64_t k) { return c.count[k - 1] / c.right[k - 1]; }

template <typename T>
void core_forward(const Chain& c, int64_t k, const T* h, const T* g, T* u) {
  const int64_t rl = c.left[k], m = c.mode[k], rr = c.right[k];
  for (int64_t row = 0; row < c.rows; ++row) {
    if (k < c.n_in) {
      const int64_t R = c.count[k] / rr;  // modes after core k
      const T* hr = h + row * m * R * rl;
      for (int64_t i = 0; i < m; ++i)
        small_gemm<T>(hr + i * R * rl, rl, 1, g + i * rr, m * rr, u + row * R * rr, rr, R, rl, rr, i > 0);
    } else {
      const int64_t P = block_rows(c, k);
      small_gemm<T>(h + row * P * rl, rl, 1, g, m * rr, u + row * P * m * rr, m * rr, P, rl, m * rr, false);
    }
  }
}

template <typename T>
void scale_last(const T* u, const T* s, T* h, int64_t n, int64_t r) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < r; ++j) h[i * r + j] = u[i * r + j] * s[j];
}

}  // namespace

// -> {y (rows, out features), u_1 .. u_{K-1} (unscaled intermediates, kept for backward)}
std::vector<at::Tensor> tt_chain_forward(const at::Tensor& x_, const std::vector<at::Tensor>& cores_,
                                         const std::vector<at::Tensor>& gates_, const c10::optional<at::Tensor>& bias_,
                                         int64_t n_in) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat || x_.scalar_type() == at::kDouble, "tt_chain: float32/float64 only");
  const auto x = x_.contiguous();
  std::vector<at::Tensor> cores, gates;
  for (const auto& t : cores_) cores.push_back(t.contiguous());
  for (const auto& t : gates_) gates.push_back(t.to(x.scalar_type()).contiguous());
  const Chain c = describe(x, cores, gates, n_in);
  std::vector<at::Tensor> out(1);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tt_chain_forward", [&] {
    at::Tensor h = x;
    for (int64_t k = 0; k < c.n_cores; ++k) {
      auto u = at::empty({c.rows, c.count[k]}, x.options());
      core_forward<scalar_t>(c, k, h.data_ptr<scalar_t>(), cores[k].data_ptr<scalar_t>(), u.data_ptr<scalar_t>());
      if (k == c.n_cores - 1) {
        if (bias_.has_value() && bias_->defined()) u.add_(bias_->to(u.scalar_type()));
        out[0] = u;
      } else {
        out.push_back(u);
        auto scaled = at::empty_like(u);
        scale_last<scalar_t>(u.data_ptr<scalar_t>(), gates[k].data_ptr<scalar_t>(), scaled.data_ptr<scalar_t>(),
                             u.numel() / c.right[k], c.right[k]);
        h = scaled;
      }
    }
  });
  return out;
}

// -> {dx, dcore_0 .. dcore_{K-1}, dgate_0 .. dgate_{K-2}, dbias (undefined when no bias)}
std::vector<at::Tensor> tt_chain_backward(const at::Tensor& grad_, const at::Tensor& x_,
                                          const std::vector<at::Tensor>& cores_, const std::vector<at::Tensor>& gates_,
                                          const std::vector<at::Tensor>& us, bool has_bias, int64_t n_in) {
  const auto x = x_.contiguous();
  const auto grad = grad_.to(x.scalar_type()).contiguous();
  std::vector<at::Tensor> cores, gates;
  for (const auto& t : cores_) cores.push_back(t.contiguous());
  for (const auto& t : gates_) gates.push_back(t.to(x.scalar_type()).contiguous());
  const Chain c = describe(x, cores, gates, n_in);
  TORCH_CHECK(static_cast<int64_t>(us.size()) == c.n_cores - 1, "tt_chain_backward: one saved result per gate");
  std::vector<at::Tensor> d_cores(c.n_cores), d_gates(c.n_cores - 1);
  at::Tensor dx;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tt_chain_backward", [&] {
    at::Tensor g_u = grad;  // gradient of the current core's result u_k
    for (int64_t k = c.n_cores - 1; k >= 0; --k) {
      const int64_t rl = c.left[k], m = c.mode[k], rr = c.right[k];
      // the core's input h (scaled u_{k-1}, or x)
      at::Tensor h;
      if (k == 0) {
        h = x;
      } else {
        h = at::empty_like(us[k - 1]);
        scale_last<scalar_t>(us[k - 1].data_ptr<scalar_t>(), gates[k - 1].data_ptr<scalar_t>(),
                             h.data_ptr<scalar_t>(), h.numel() / rl, rl);
      }
      const scalar_t* hp = h.data_ptr<scalar_t>();
      const scalar_t* gp = g_u.data_ptr<scalar_t>();
      const scalar_t* core = cores[k].data_ptr<scalar_t>();
      // every element of dG is written by the first row's product and accumulated after: no zero fill
      auto d_core = c.rows > 0 ? at::empty_like(cores[k]) : at::zeros_like(cores[k]);
      scalar_t* dcp = d_core.data_ptr<scalar_t>();
      auto g_h = at::empty_like(h);
      scalar_t* ghp = g_h.data_ptr<scalar_t>();
      if (k < c.n_in) {
        const int64_t R = c.count[k] / rr;
        for (int64_t row = 0; row < c.rows; ++row) {
          const scalar_t* gr = gp + row * R * rr;
          for (int64_t i = 0; i < m; ++i) {
            const scalar_t* hi = hp + row * m * R * rl + i * R * rl;
            // dG[:, i, :] += h[row, i]^T (rl x R) @ g_u[row] (R x rr)
            small_gemm<scalar_t>(hi, 1, rl, gr, rr, dcp + i * rr, m * rr, rl, R, rr, row > 0);
            // dh[row, i] = g_u[row] (R x rr) @ G[:, i, :]^T: rows of G[:, i, :] are contiguous over rr
            small_gemm_nt<scalar_t>(gr, rr, core + i * rr, m * rr, ghp + row * m * R * rl + i * R * rl, rl, R, rl,
                                    rr);
          }
        }
      } else {
        const int64_t P = block_rows(c, k);
        for (int64_t row = 0; row < c.rows; ++row) {
          const scalar_t* gr = gp + row * P * m * rr;
          // dG (rl x m rr) += h[row]^T (rl x P) @ g_u[row] (P x m rr)
          small_gemm<scalar_t>(hp + row * P * rl, 1, rl, gr, m * rr, dcp, m * rr, rl, P, m * rr, row > 0);
          // dh[row] (P x rl) = g_u[row] (P x m rr) @ G^T, G (rl x m rr) read row by row
          small_gemm_nt<scalar_t>(gr, m * rr, core, m * rr, ghp + row * P * rl, rl, P, rl, m * rr);
        }
      }
      d_cores[k] = d_core;
      if (k == 0) {
        dx = g_h;
      } else {  // through gate k-1: h = u * s  ->  du = dh * s, ds = sum(dh * u)
        const int64_t n = h.numel() / rl;
        const scalar_t* u = us[k - 1].data_ptr<scalar_t>();
        const scalar_t* s = gates[k - 1].data_ptr<scalar_t>();
        auto d_gate = at::zeros({rl}, x.options());
        scalar_t* ds = d_gate.data_ptr<scalar_t>();
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < rl; ++j) {
            ds[j] += ghp[i * rl + j] * u[i * rl + j];
            ghp[i * rl + j] *= s[j];
          }
        d_gates[k - 1] = d_gate;
        g_u = g_h;
      }
    }
  });
  std::vector<at::Tensor> out{dx};
  out.insert(out.end(), d_cores.begin(), d_cores.end());
  out.insert(out.end(), d_gates.begin(), d_gates.end());
  at::Tensor d_bias;
  if (has_bias) {  // column sums of the output gradient
    d_bias = at::zeros({grad.size(1)}, grad.options());
    AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "tt_chain_bias", [&] {
      const scalar_t* gp = grad.data_ptr<scalar_t>();
      scalar_t* db = d_bias.data_ptr<scalar_t>();
      for (int64_t i = 0; i < grad.size(0); ++i)
        for (int64_t j = 0; j < grad.size(1); ++j) db[j] += gp[i * grad.size(1) + j];
    });
  }
  out.push_back(d_bias);
  return out;
}

// The whole layer as one autograd node, built in C++: at a few rows the per-call
// cost of a Python autograd.Function (apply, saved-tensor unpacking, the Python
// backward) is as large as the arithmetic.
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// An autograd node handle: std::shared_ptr up to torch 2.11, c10::intrusive_ptr since
// (whichever Node::getptr() returns).
using NodePtr = decltype(std::declval<torch::autograd::Node&>().getptr());

template <typename T>
auto make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<T>();
  else
    return c10::make_intrusive<T>();
}

struct TTChainBackward : public torch::autograd::Node {
  SavedVariable x;
  std::vector<SavedVariable> cores, gates, us;
  bool has_bias = false;
  int64_t n_in = 0;

  std::string name() const override { return "TTChainBackward"; }

  void release_variables() override {
    x.reset_data();
    for (auto* list : {&cores, &gates, &us})
      for (auto& v : *list) v.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    auto unpack = [&](const std::vector<SavedVariable>& saved) {
      std::vector<at::Tensor> out;
      out.reserve(saved.size());
      for (const auto& v : saved) out.push_back(v.unpack(getptr()));
      return out;
    };
    const auto input = x.unpack(getptr());
    const auto& grad = grads[0];
    const auto grad2d = grad.defined() ? grad.reshape({grad.size(0), -1}) : at::Tensor();
    const auto x2d = input.reshape({input.size(0), -1});
    variable_list out(num_outputs());
    if (!grad.defined()) return out;
    auto results = tt_chain_backward(grad2d, x2d, unpack(cores), unpack(gates), unpack(us), has_bias, n_in);
    out[0] = results[0].reshape(input.sizes());
    for (size_t i = 1; i < out.size(); ++i)
      if (should_compute_output(i) && results[i].defined()) out[i] = results[i];
    return out;
  }
};

}  // namespace

// x (rows, ...) -> y (rows, out features); the autograd node holds x, the
// parameters and the intermediates
at::Tensor tt_chain(const at::Tensor& x, at::TensorList cores, at::TensorList gates,
                    const c10::optional<at::Tensor>& bias, int64_t n_in) {
  std::vector<at::Tensor> outs;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    outs = tt_chain_forward(x.reshape({x.size(0), -1}), cores.vec(), gates.vec(), bias, n_in);
  }
  at::Tensor y = outs[0];
  const at::Tensor bias_t = bias.has_value() ? *bias : at::Tensor();
  if (torch::autograd::compute_requires_grad(x, cores, gates, bias_t)) {
    auto node = make_node<TTChainBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, cores, gates, bias_t));
    node->x = SavedVariable(x, false);
    for (const auto& c : cores) node->cores.emplace_back(c, false);
    for (const auto& g : gates) node->gates.emplace_back(g, false);
    for (size_t i = 1; i < outs.size(); ++i) node->us.emplace_back(outs[i], false);
    node->has_bias = bias_t.defined();
    node->n_in = n_in;
    torch::autograd::set_history(y, node);
  }
  return y;
}

}  // namespace tncompile_native

TORCH_LIBRARY_FRAGMENT(tncompile, m) {
  m.def("tt_chain(Tensor x, Tensor[] cores, Tensor[] gates, Tensor? bias, int n_in) -> Tensor");
  m.def("tt_chain_forward(Tensor x, Tensor[] cores, Tensor[] gates, Tensor? bias, int n_in) -> Tensor[]",
        tncompile_native::tt_chain_forward);
  m.def("tt_chain_backward(Tensor grad, Tensor x, Tensor[] cores, Tensor[] gates, Tensor[] us, bool has_bias, "
        "int n_in) -> Tensor[]",
        tncompile_native::tt_chain_backward);
}

TORCH_LIBRARY_IMPL(tncompile, Autograd, m) { m.impl("tt_chain", tncompile_native::tt_chain); }
TORCH_LIBRARY_IMPL(tncompile, CPU, m) { m.impl("tt_chain", tncompile_native::tt_chain); }
