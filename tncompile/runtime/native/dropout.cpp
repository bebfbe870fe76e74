// Dropout with a counter-based generator: y = keep ? x / (1 - p) : 0, keep ~ Bernoulli(1 - p).
//
// PyTorch's CPU dropout draws one float per element from a sequential
// generator (bernoulli_), then divides and multiplies in two more passes and
// keeps a float mask for backward: ~7 ns an element on the machines we
// measure, a quarter of a compressed transformer's training step. Here every
// element's random word comes from Philox4x32-10 (Salmon et al., SC'11, the
// generator of cuRAND, JAX and PyTorch's CUDA dropout) keyed by a 64-bit seed
// and counted by the element's index, so
//   * any thread can produce any block: the result does not depend on how the
//     work is split, and the loop vectorizes (the rounds are independent
//     32 x 32 -> 64-bit products per lane);
//   * one pass writes y and a one-byte mask (a quarter of a float mask) that
//     backward reads.
// An element is dropped when its 32-bit word is below round(p * 2^32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <tuple>

namespace tncompile_native {

namespace {

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;   // Philox4x32 multipliers
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
constexpr int64_t kGroup = 64;  // counters per inner loop: 256 elements, a few vectors of lanes

// Philox4x32-10 of counter (lo, hi, 0, 0) under key (k0, k1): four random words, written to
// w0[0], w1[0], w2[0], w3[0] (callers pass one array per word, so a loop over counters stores whole vectors).
inline void philox(uint32_t lo, uint32_t hi, uint32_t k0, uint32_t k1, uint32_t* w0, uint32_t* w1, uint32_t* w2,
                   uint32_t* w3) {
  uint32_t c0 = lo, c1 = hi, c2 = 0, c3 = 0;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0, p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t h0 = static_cast<uint32_t>(p0 >> 32), l0 = static_cast<uint32_t>(p0);
    const uint32_t h1 = static_cast<uint32_t>(p1 >> 32), l1 = static_cast<uint32_t>(p1);
    c0 = h1 ^ c1 ^ k0;
    c1 = l1;
    c2 = h0 ^ c3 ^ k1;
    c3 = l0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  *w0 = c0; *w1 = c1; *w2 = c2; *w3 = c3;
}

uint32_t drop_threshold(double p) {
  const double t = std::nearbyint(p * 4294967296.0);
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

// Block b holds elements [b B, (b + 1) B), B = 4 kGroup; its element j kGroup + g takes word j of
// counter b kGroup + g.
template <typename T>
void dropout_kernel(const T* xp, T* yp, bool* mp, int64_t n, uint32_t threshold, uint32_t k0, uint32_t k1,
                    T scale) {
  constexpr int64_t B = 4 * kGroup;
  at::parallel_for(0, (n + B - 1) / B, 16, [&](int64_t b0, int64_t b1) {
    alignas(64) uint32_t words[B];
    for (int64_t b = b0; b < b1; ++b) {
#pragma omp simd
      for (int64_t g = 0; g < kGroup; ++g) {
        const uint64_t counter = static_cast<uint64_t>(b * kGroup + g);
        philox(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), k0, k1, words + g,
               words + kGroup + g, words + 2 * kGroup + g, words + 3 * kGroup + g);
      }
      const int64_t e0 = b * B, len = std::min(B, n - e0);
#pragma omp simd
      for (int64_t e = 0; e < len; ++e) {
        const bool keep = words[e] >= threshold;
        mp[e0 + e] = keep;
        yp[e0 + e] = keep ? xp[e0 + e] * scale : T(0);
      }
    }
  });
}

template <typename T>
void masked_scale(const T* gp, const bool* mp, T* dp, int64_t n, T scale) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t e0, int64_t e1) {
#pragma omp simd
    for (int64_t e = e0; e < e1; ++e) dp[e] = mp[e] ? gp[e] * scale : T(0);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> dropout_forward(const at::Tensor& x_, double p, int64_t seed) {
  TORCH_CHECK(x_.device().is_cpu(), "tncompile dropout: CPU tensors only");
  TORCH_CHECK(x_.scalar_type() == at::kFloat || x_.scalar_type() == at::kDouble,
              "tncompile dropout: float32 or float64 only, got ", x_.scalar_type());
  TORCH_CHECK(p >= 0.0 && p < 1.0, "tncompile dropout: p must be in [0, 1), got ", p);
  const auto x = x_.contiguous();
  auto y = at::empty_like(x);
  auto mask = at::empty(x.sizes(), x.options().dtype(at::kBool));
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tncompile_dropout", [&] {
    dropout_kernel<scalar_t>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), mask.data_ptr<bool>(), x.numel(),
                             drop_threshold(p), k0, k1, static_cast<scalar_t>(1.0 / (1.0 - p)));
  });
  return {y, mask};
}

at::Tensor dropout_backward(const at::Tensor& grad_, const at::Tensor& mask_, double scale) {
  TORCH_CHECK(grad_.sizes() == mask_.sizes() && mask_.scalar_type() == at::kBool && grad_.device().is_cpu(),
              "tncompile dropout backward: grad and a bool mask of the same shape, on CPU");
  TORCH_CHECK(grad_.scalar_type() == at::kFloat || grad_.scalar_type() == at::kDouble,
              "tncompile dropout backward: float32 or float64 only, got ", grad_.scalar_type());
  const auto grad = grad_.contiguous(), mask = mask_.contiguous();
  auto dx = at::empty_like(grad);
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "tncompile_dropout_backward", [&] {
    masked_scale<scalar_t>(grad.data_ptr<scalar_t>(), mask.data_ptr<bool>(), dx.data_ptr<scalar_t>(), grad.numel(),
                           static_cast<scalar_t>(scale));
  });
  return dx;
}

}  // namespace tncompile_native

TORCH_LIBRARY_FRAGMENT(tncompile, m) {
  m.def("dropout_forward(Tensor x, float p, int seed) -> (Tensor, Tensor)", tncompile_native::dropout_forward);
  m.def("dropout_backward(Tensor grad, Tensor mask, float scale) -> Tensor", tncompile_native::dropout_backward);
}
