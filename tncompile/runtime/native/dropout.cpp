// Dropout with a counter-based generator: y = keep ? x / (1 - p) : 0, keep ~ Bernoulli(1 - p).
//
// PyTorch's CPU dropout draws one float per element from a sequential
// generator (bernoulli_), then divides and multiplies in two more passes and
// keeps a float mask for backward: ~7 ns an element on the machines we
// measure, a quarter of a compressed transformer's training step. Here every
// element's random word comes from Philox4x32-10 (Salmon et al., SC'11, the
// generator of cuRAND, JAX and PyTorch's CUDA dropout; philox.h) keyed by a
// 64-bit seed and counted by the element's index, so
//   * any thread can produce any block: the result does not depend on how the
//     work is split, and it runs a vector of counters at once (the rounds
//     are 32 x 32 -> 64-bit products, one per 64-bit lane);
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
#include <type_traits>

#include "philox.h"
#include "vector_math.h"

namespace tncompile_native {

namespace {

constexpr int64_t kGroup = 64;  // counters per block: 256 elements, a few vectors of lanes

using vmath::F32;
using vmath::I32;
using vmath::kFloats;
typedef uint32_t U32 __attribute__((vector_size(kVectorBytes)));
typedef uint8_t U8 __attribute__((vector_size(kFloats)));  // one mask byte per float lane
static_assert(kGroup % philox::kLanes == 0 && (4 * kGroup) % kFloats == 0, "a block is whole vectors");

using vmath::vload;
using vmath::vstore;

using philox::drop_threshold;

// Block b holds elements [b B, (b + 1) B), B = 4 kGroup; its element j kGroup + g takes word j of
// counter b kGroup + g. Fills words[0, B).
inline void block_words(int64_t b, uint32_t k0, uint32_t k1, uint32_t* words) {
  philox::word_rows(static_cast<uint64_t>(b * kGroup), kGroup, k0, k1, words, kGroup);
}

template <typename T>
inline void select_rows(const T* xp, T* yp, bool* mp, const uint32_t* words, int64_t len, uint32_t threshold,
                        T scale, int64_t start) {
  for (int64_t e = start; e < len; ++e) {
    const bool keep = words[e] >= threshold;
    mp[e] = keep;
    yp[e] = keep ? xp[e] * scale : T(0);
  }
}

template <typename T>
void dropout_kernel(const T* xp, T* yp, bool* mp, int64_t n, uint32_t threshold, uint32_t k0, uint32_t k1,
                    T scale) {
  constexpr int64_t B = 4 * kGroup;
  at::parallel_for(0, (n + B - 1) / B, 16, [&](int64_t b0, int64_t b1) {
    alignas(64) uint32_t words[B];
    for (int64_t b = b0; b < b1; ++b) {
      block_words(b, k0, k1, words);
      const int64_t e0 = b * B, len = std::min(B, n - e0);
      int64_t e = 0;
      if constexpr (std::is_same_v<T, float>) {  // whole vectors: compare, mask, scale; bytes of the mask
        for (; e + kFloats <= len; e += kFloats) {
          const I32 keep = vload<U32>(words + e) >= threshold;  // -1 or 0 per lane
          const F32 y = vload<F32>(xp + e0 + e) * scale;
          vstore(yp + e0 + e, (F32)((I32)y & keep));
          vstore(mp + e0 + e, __builtin_convertvector(keep & 1, U8));
        }
      }
      select_rows<T>(xp + e0, yp + e0, mp + e0, words, len, threshold, scale, e);
    }
  });
}

template <typename T>
void masked_scale(const T* gp, const bool* mp, T* dp, int64_t n, T scale) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t e0, int64_t e1) {
    int64_t e = e0;
    if constexpr (std::is_same_v<T, float>) {
      for (; e + kFloats <= e1; e += kFloats) {
        const F32 keep = __builtin_convertvector(vload<U8>(mp + e), F32);  // 1.0 or 0.0
        vstore(dp + e, vload<F32>(gp + e) * (keep * scale));
      }
    }
    for (; e < e1; ++e) dp[e] = mp[e] ? gp[e] * scale : T(0);
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
