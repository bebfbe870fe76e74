// Scaled dot-product attention with dropout, forward and backward, one (batch, head) at a time.
//
//   P = softmax(scale q k^T + mask)     (L x S per head)
//   out = dropout(P) v                  (L x F)
//
// PyTorch's CPU attention runs this as separate ops when dropout is on (its
// flash kernel takes no dropout): two batched matmuls that first copy
// head-transposed q, k and v into contiguous tensors, a softmax pass, a
// dropout pass that writes the dropped weights and a mask, and as many again
// backward. Here one head's scores stay in L2 from q k^T to the product with
// v; q, k, v, the output and the gradients are read and written in place
// through their strides (the output and gradients as (batch, length, heads,
// width), the layout the projections next to them use, so reshaping them back
// to (batch, length, embed) is free); the only tensor kept for backward is P,
// with the dropout mask in its sign bits (the weights are >= 0; a dropped
// weight is saved negated), so no mask is stored and none is drawn again.
// The mask comes from Philox (philox.h): element j of row r of head bh takes
// word j / G of counter (bh L + r) G + j % G, G = ceil(S / 4), and is dropped
// when the word is below round(p 2^32), as in dropout.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "philox.h"
#include "small_gemm.h"
#include "vector_math.h"

namespace tncompile_native {

namespace {

using vmath::F32;
using vmath::kFloats;
using vmath::vload;
using vmath::vstore;

// dst (cols x rows, leading dimension ldd) <- src^T, src (rows x cols) with row stride lds:
// 4 x 4 tiles transposed in SSE registers where the type is float, element by element elsewhere
template <typename T>
void transpose_into(const T* src, int64_t lds, int64_t rows, int64_t cols, T* dst, int64_t ldd) {
  int64_t r0 = 0;
#if defined(__SSE__)
  if constexpr (std::is_same_v<T, float>) {
    for (; r0 + 4 <= rows; r0 += 4) {
      const float* s0 = src + r0 * lds;
      int64_t c0 = 0;
      for (; c0 + 4 <= cols; c0 += 4) {
        __m128 a = _mm_loadu_ps(s0 + c0), b = _mm_loadu_ps(s0 + lds + c0), c = _mm_loadu_ps(s0 + 2 * lds + c0),
               d = _mm_loadu_ps(s0 + 3 * lds + c0);
        _MM_TRANSPOSE4_PS(a, b, c, d);
        _mm_storeu_ps(dst + c0 * ldd + r0, a);
        _mm_storeu_ps(dst + (c0 + 1) * ldd + r0, b);
        _mm_storeu_ps(dst + (c0 + 2) * ldd + r0, c);
        _mm_storeu_ps(dst + (c0 + 3) * ldd + r0, d);
      }
      for (; c0 < cols; ++c0)
        for (int64_t r = r0; r < r0 + 4; ++r) dst[c0 * ldd + r] = src[r * lds + c0];
    }
  }
#endif
  for (; r0 < rows; ++r0)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r0] = src[r0 * lds + c];
}

template <typename T>
T row_max(const T* row, int64_t S) {
  T top = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {  // lane-wise maxima, then across lanes
    F32 lanes = vmath::splat(top);
    for (; j + kFloats <= S; j += kFloats) {
      const F32 v = vload<F32>(row + j);
      lanes = v > lanes ? v : lanes;
    }
    for (int64_t l = 0; l < kFloats; ++l) top = std::max(top, lanes[l]);
  }
  for (; j < S; ++j) top = std::max(top, row[j]);
  return top;
}

// row (S) <- exp(scale row + mask row - max); returns 1 / (sum of the row), so that row * that is
// the softmax. A row whose every score is -inf becomes NaN, as the written softmax gives it, or,
// with empty_rows_zero, zeros (as PyTorch's scaled_dot_product_attention gives it: no key, no output).
template <typename T>
T softmax_exp(T* row, int64_t S, T scale, const T* mask, int64_t mask_stride, bool empty_rows_zero) {
  if (mask) {
    if (mask_stride == 1) {
      for (int64_t j = 0; j < S; ++j) row[j] = row[j] * scale + mask[j];
    } else {
      for (int64_t j = 0; j < S; ++j) row[j] = row[j] * scale + mask[j * mask_stride];
    }
  } else {
    for (int64_t j = 0; j < S; ++j) row[j] *= scale;
  }
  const T top = row_max(row, S);
  if (top == -std::numeric_limits<T>::infinity()) {
    const T fill = empty_rows_zero ? T(0) : std::numeric_limits<T>::quiet_NaN();
    std::fill(row, row + S, fill);
    return fill;
  }
  T sum = 0;
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    F32 acc{};
    for (; j + kFloats <= S; j += kFloats) {
      const F32 e = vmath::exp(vload<F32>(row + j) - top);
      vstore(row + j, e);
      acc += e;
    }
    for (int64_t l = 0; l < kFloats; ++l) sum += acc[l];
  }
  for (; j < S; ++j) {
    row[j] = std::exp(row[j] - top);
    sum += row[j];
  }
  return T(1) / sum;
}

// sum of a[j] b[j]
template <typename T>
T dot(const T* a, const T* b, int64_t S) {
  T sum = 0;
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    F32 acc{};
    for (; j + kFloats <= S; j += kFloats) acc += vload<F32>(a + j) * vload<F32>(b + j);
    for (int64_t l = 0; l < kFloats; ++l) sum += acc[l];
  }
  for (; j < S; ++j) sum += a[j] * b[j];
  return sum;
}

// The Philox word of every element of attention row `row` (S keys), in key order: word j / G of
// counter row G + j % G, G = ceil(S / 4). Returns `words` itself when the groups fill whole vectors
// of counters (S a multiple of 4 kLanes), else the words gathered into `gathered`.
inline const uint32_t* element_words(uint64_t row, int64_t S, uint32_t k0, uint32_t k1, uint32_t* words,
                                     uint32_t* gathered) {
  const int64_t G = (S + 3) / 4, GP = philox::padded_groups(G);
  philox::word_rows(row * static_cast<uint64_t>(G), G, k0, k1, words, GP);
  if (G == GP) return words;
  for (int64_t j = 0; j < S; ++j) gathered[j] = words[j / G * GP + j % G];
  return gathered;
}
// (an element is kept when its word is at least philox::drop_threshold(p))

typedef uint32_t U32 __attribute__((vector_size(kVectorBytes)));

// P = row inv into kept (when given), negated where dropped: the weights are >= 0, so the sign bit
// carries the mask to backward (-0.0 for a dropped 0) and no mask is stored or drawn again there.
// row <- dropout(P): P / (1 - p) where the word is kept, else 0.
template <typename T>
void drop_row(T* row, int64_t S, T inv, T* kept, const uint32_t* w, uint32_t threshold, T inv_keep) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    const vmath::I32 sign = vmath::I32{} + static_cast<int32_t>(0x80000000);
    for (; j + kFloats <= S; j += kFloats) {
      const F32 pj = vload<F32>(row + j) * inv;
      const vmath::I32 keep = vload<U32>(w + j) >= threshold;  // -1 or 0 per lane
      if (kept) vstore(kept + j, (F32)((vmath::I32)pj | (sign & ~keep)));
      vstore(row + j, (F32)((vmath::I32)(pj * inv_keep) & keep));
    }
  }
  for (; j < S; ++j) {
    const T pj = row[j] * inv;
    const bool keep = w[j] >= threshold;
    if (kept) kept[j] = keep ? pj : -pj;
    row[j] = keep ? pj * inv_keep : T(0);
  }
}

// From a saved row (P, negated where dropped): plain[j] = P, factor[j] = 1 / (1 - p) or 0,
// dropped[j] = P factor[j]
template <typename T>
void split_saved_row(const T* saved, int64_t S, T inv_keep, T* plain, T* factor, T* dropped) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    const vmath::I32 sign = vmath::I32{} + static_cast<int32_t>(0x80000000);
    const vmath::I32 scale = (vmath::I32)vmath::splat(inv_keep);
    for (; j + kFloats <= S; j += kFloats) {
      const vmath::I32 bits = vload<vmath::I32>(saved + j);
      const vmath::I32 kept = (bits & sign) == 0;  // -1 or 0 per lane
      const F32 pj = (F32)(bits & ~sign), f = (F32)(scale & kept);
      vstore(plain + j, pj);
      vstore(factor + j, f);
      vstore(dropped + j, pj * f);
    }
  }
  for (; j < S; ++j) {
    const bool keep = !std::signbit(saved[j]);
    plain[j] = std::fabs(saved[j]);
    factor[j] = keep ? inv_keep : T(0);
    dropped[j] = plain[j] * factor[j];
  }
}

struct Shape {
  int64_t B, H, L, S, E, F;
};

// strides of a (B, H, rows, cols) tensor whose last stride is 1
struct Strides {
  int64_t b, h, r;
  explicit Strides(const at::Tensor& t) : b(t.stride(0)), h(t.stride(1)), r(t.stride(2)) {}
  int64_t at(int64_t bi, int64_t hi) const { return bi * b + hi * h; }
};

template <typename T>
void forward_kernel(const Shape& d, const T* q, Strides qs, const T* k, Strides ks, const T* v, Strides vs,
                    const T* mask, const int64_t* ms, T* out, T* probs, T scale, double p, int64_t seed,
                    bool empty_rows_zero) {
  const uint32_t threshold = philox::drop_threshold(p);
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  const T inv_keep = static_cast<T>(1.0 / (1.0 - p));
  at::parallel_for(0, d.B * d.H, 1, [&](int64_t bh0, int64_t bh1) {
    std::vector<T> kt(d.E * d.S), scores(d.L * d.S);
    std::vector<uint32_t> words(4 * philox::padded_groups((d.S + 3) / 4)), gathered(d.S);
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / d.H, h = bh % d.H;
      const T *qp = q + qs.at(b, h), *kp = k + ks.at(b, h), *vp = v + vs.at(b, h);
      transpose_into<T>(kp, ks.r, d.S, d.E, kt.data(), d.S);  // k^T (E x S): q k^T on whole vectors of keys
      small_gemm<T>(qp, qs.r, 1, kt.data(), d.S, scores.data(), d.S, d.L, d.E, d.S, false);
      for (int64_t i = 0; i < d.L; ++i) {
        T* row = scores.data() + i * d.S;
        const T inv = softmax_exp<T>(row, d.S, scale, mask ? mask + b * ms[0] + h * ms[1] + i * ms[2] : nullptr,
                                     ms[3], empty_rows_zero);
        T* kept = probs ? probs + (bh * d.L + i) * d.S : nullptr;  // P, for backward
        if (p > 0) {  // one pass: P, and dropout(P) in place
          const uint32_t* w = element_words(static_cast<uint64_t>(bh * d.L + i), d.S, k0, k1, words.data(),
                                            gathered.data());
          drop_row<T>(row, d.S, inv, kept, w, threshold, inv_keep);
        } else {
          for (int64_t j = 0; j < d.S; ++j) row[j] *= inv;
          if (kept) std::copy(row, row + d.S, kept);
        }
      }
      small_gemm<T>(scores.data(), d.S, 1, vp, vs.r, out + (b * d.L * d.H + h) * d.F, d.H * d.F, d.L, d.S, d.F,
                    false);
    }
  });
}

template <typename T>
void backward_kernel(const Shape& d, const T* go, Strides gs, const T* q, Strides qs, const T* k, Strides ks,
                     const T* v, Strides vs, const T* probs, T* dq, T* dk, T* dv, T scale, double p) {
  const T inv_keep = static_cast<T>(1.0 / (1.0 - p));
  at::parallel_for(0, d.B * d.H, 1, [&](int64_t bh0, int64_t bh1) {
    const int64_t n = p > 0 ? d.L * d.S : 0;
    std::vector<T> vt(d.F * d.S), grad(d.L * d.S), keep(n), dropped(n), plain(n);
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / d.H, h = bh % d.H;
      const T *gp = go + gs.at(b, h), *qp = q + qs.at(b, h), *kp = k + ks.at(b, h), *vp = v + vs.at(b, h);
      const T* pp = probs + bh * d.L * d.S;  // P; with dropout, negated where dropped (drop_row)
      const T* used = pp;  // the weights that multiplied v: dropout(P)
      if (p > 0) {  // P, the keep factors and dropout(P) from the saved signs
        split_saved_row<T>(pp, d.L * d.S, inv_keep, plain.data(), keep.data(), dropped.data());
        used = dropped.data();
        pp = plain.data();
      }
      // dv = dropout(P)^T dout (S x F), into (B, S, H, F)
      small_gemm<T>(used, 1, d.S, gp, gs.r, dv + (b * d.S * d.H + h) * d.F, d.H * d.F, d.S, d.L, d.F, false);
      transpose_into<T>(vp, vs.r, d.S, d.F, vt.data(), d.S);
      small_gemm<T>(gp, gs.r, 1, vt.data(), d.S, grad.data(), d.S, d.L, d.F, d.S, false);  // d dropout(P)
      for (int64_t i = 0; i < d.L; ++i) {  // through dropout and softmax: dS = P (dP - <dP, P>), times scale
        T* g = grad.data() + i * d.S;
        const T* pr = pp + i * d.S;
        if (p > 0) {
          const T* kr = keep.data() + i * d.S;
          for (int64_t j = 0; j < d.S; ++j) g[j] *= kr[j];
        }
        const T centre = dot<T>(g, pr, d.S);
        for (int64_t j = 0; j < d.S; ++j) g[j] = pr[j] * (g[j] - centre) * scale;
      }
      // dq = dS k (L x E), dk = dS^T q (S x E), into (B, L | S, H, E)
      small_gemm<T>(grad.data(), d.S, 1, kp, ks.r, dq + (b * d.L * d.H + h) * d.E, d.H * d.E, d.L, d.S, d.E, false);
      small_gemm<T>(grad.data(), 1, d.S, qp, qs.r, dk + (b * d.S * d.H + h) * d.E, d.H * d.E, d.S, d.L, d.E, false);
    }
  });
}

at::Tensor rows_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "tncompile attention: ", name, " must be 4-D (batch, heads, length, width), got ",
              t.sizes());
  return t.stride(3) == 1 ? t : t.contiguous();
}

Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "tncompile attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "tncompile attention: q, k, v must all be float32 or all float64");
  const Shape d{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  TORCH_CHECK(k.size(0) == d.B && v.size(0) == d.B && k.size(1) == d.H && v.size(1) == d.H && k.size(3) == d.E &&
                  v.size(2) == d.S,
              "tncompile attention: q (B, H, L, E), k (B, H, S, E), v (B, H, S, F), got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  return d;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                                     const c10::optional<at::Tensor>& mask_, double scale, double p,
                                                     int64_t seed, bool keep_probs, bool empty_rows_zero) {
  const auto q = rows_contiguous(q_, "q"), k = rows_contiguous(k_, "k"), v = rows_contiguous(v_, "v");
  const Shape d = shape_of(q, k, v);
  TORCH_CHECK(p >= 0.0 && p < 1.0, "tncompile attention: dropout p must be in [0, 1), got ", p);
  at::Tensor mask;
  int64_t ms[4] = {0, 0, 0, 1};
  if (mask_.has_value() && mask_->defined()) {
    TORCH_CHECK(mask_->scalar_type() == q.scalar_type(), "tncompile attention: the mask must have q's dtype");
    mask = mask_->expand({d.B, d.H, d.L, d.S});
    for (int i = 0; i < 4; ++i) ms[i] = mask.stride(i);
  }
  auto out = at::empty({d.B, d.L, d.H, d.F}, q.options());
  at::Tensor probs = keep_probs ? at::empty({d.B, d.H, d.L, d.S}, q.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "tncompile_attention_forward", [&] {
    forward_kernel<scalar_t>(d, q.data_ptr<scalar_t>(), Strides(q), k.data_ptr<scalar_t>(), Strides(k),
                             v.data_ptr<scalar_t>(), Strides(v), mask.defined() ? mask.data_ptr<scalar_t>() : nullptr,
                             ms, out.data_ptr<scalar_t>(), keep_probs ? probs.data_ptr<scalar_t>() : nullptr,
                             static_cast<scalar_t>(scale), p, seed, empty_rows_zero);
  });
  return {out.permute({0, 2, 1, 3}), probs};
}

std::vector<at::Tensor> attention_backward(const at::Tensor& grad_, const at::Tensor& q_, const at::Tensor& k_,
                                           const at::Tensor& v_, const at::Tensor& probs_, double scale,
                                           double p) {
  const auto q = rows_contiguous(q_, "q"), k = rows_contiguous(k_, "k"), v = rows_contiguous(v_, "v");
  const auto grad = rows_contiguous(grad_, "grad");
  const Shape d = shape_of(q, k, v);
  TORCH_CHECK(grad.sizes() == at::IntArrayRef({d.B, d.H, d.L, d.F}) && grad.scalar_type() == q.scalar_type(),
              "tncompile attention backward: grad must be (B, H, L, F) in q's dtype, got ", grad.sizes());
  TORCH_CHECK(probs_.sizes() == at::IntArrayRef({d.B, d.H, d.L, d.S}) && probs_.scalar_type() == q.scalar_type(),
              "tncompile attention backward: the forward's weights (B, H, L, S) are needed, got ", probs_.sizes());
  const auto probs = probs_.contiguous();
  auto dq = at::empty({d.B, d.L, d.H, d.E}, q.options());
  auto dk = at::empty({d.B, d.S, d.H, d.E}, q.options());
  auto dv = at::empty({d.B, d.S, d.H, d.F}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "tncompile_attention_backward", [&] {
    backward_kernel<scalar_t>(d, grad.data_ptr<scalar_t>(), Strides(grad), q.data_ptr<scalar_t>(), Strides(q),
                              k.data_ptr<scalar_t>(), Strides(k), v.data_ptr<scalar_t>(), Strides(v),
                              probs.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                              dv.data_ptr<scalar_t>(), static_cast<scalar_t>(scale), p);
  });
  return {dq.permute({0, 2, 1, 3}), dk.permute({0, 2, 1, 3}), dv.permute({0, 2, 1, 3})};
}

}  // namespace tncompile_native

TORCH_LIBRARY_FRAGMENT(tncompile, m) {
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float p, int seed, "
        "bool keep_probs, bool empty_rows_zero) -> (Tensor, Tensor)",
        tncompile_native::attention_forward);
  m.def("attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor probs, float scale, float p) "
        "-> Tensor[]",
        tncompile_native::attention_backward);
}
