// Vectorized float exp, erf and GELU for the native kernels (GCC/Clang vector extensions).
//
// exp: 2^n exp(r), n = round(x log2 e), r = x - n ln 2 with ln 2 in two parts, exp(r) by Cephes'
// polynomial (~1 ulp); 0 below -87.3 (so exp(-inf) = 0), NaN stays NaN.
// erf: Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7). GELU through it is within 5e-7 of
// the exact function over the floats (PyTorch's own float32 CPU GELU: 9e-7), its
// derivative within 2.5e-7 (tests/test_feed_forward.py checks both against float64).
#pragma once

#include <cmath>
#include <cstdint>

#include "small_gemm.h"

namespace tncompile_native {
namespace vmath {

typedef float F32 __attribute__((vector_size(kVectorBytes)));
typedef int32_t I32 __attribute__((vector_size(kVectorBytes)));
constexpr int64_t kFloats = kVectorBytes / 4;

inline F32 splat(float v) { return F32{} + v; }

// any vector type from / to memory of any alignment
template <typename V>
inline V vload(const void* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
inline void vstore(void* p, V v) {
  __builtin_memcpy(p, &v, sizeof(V));
}

inline F32 load(const float* p) { return vload<F32>(p); }

inline void store(float* p, F32 v) { vstore(p, v); }

inline F32 exp(F32 x) {
  const I32 under = x < -87.33654f;
  x = x > 88.3762626647949f ? splat(88.3762626647949f) : x;
  x = x < -87.33654f ? splat(-87.33654f) : x;
  F32 n = x * 1.44269504088896341f;
  n = (n + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 2^23 pushes the fraction out
  const F32 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F32 y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const I32 pow2 = (__builtin_convertvector(n, I32) + 127) << 23;
  return (F32)((I32)(y * (F32)pow2) & ~under);
}

// erf(z), given z and exp(-z^2) (a caller that has that exp passes it)
inline F32 erf_with(F32 z, F32 exp_minus_z2) {
  const I32 sign = (I32)z & (int32_t)0x80000000;
  const F32 a = (F32)((I32)z & 0x7FFFFFFF);
  const F32 t = 1.0f / (a * 0.3275911f + 1.0f);
  F32 r = splat(1.061405429f);
  r = r * t - 1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t - 0.284496736f;
  r = r * t + 0.254829592f;
  const F32 magnitude = 1.0f - t * r * exp_minus_z2;
  return (F32)((I32)magnitude ^ sign);
}

inline F32 erf(F32 x) { return erf_with(x, exp(-(x * x))); }

constexpr float kSqrtHalf = 0.70710678118654752f, kInvSqrt2Pi = 0.39894228040143268f;

// x <- x Phi(x), Phi the standard normal CDF
inline F32 gelu(F32 x) { return x * (0.5f * (1.0f + erf(x * kSqrtHalf))); }

// gelu(x) and gelu'(x) = Phi(x) + x phi(x) together: the one exp(-x^2 / 2) serves erf and phi
inline void gelu_and_derivative(F32 x, F32& value, F32& derivative) {
  const F32 e = exp(-0.5f * x * x);
  const F32 cdf = 0.5f * (1.0f + erf_with(x * kSqrtHalf, e));
  value = x * cdf;
  derivative = cdf + x * (kInvSqrt2Pi * e);
}

// the last n % kFloats elements through one padded vector
template <typename Fn>
inline void tail(float* p, int64_t n, Fn fn) {
  float buf[kFloats] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
  store(buf, fn(load(buf)));
  for (int64_t i = 0; i < n; ++i) p[i] = buf[i];
}

inline void gelu_(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kFloats <= n; i += kFloats) store(x + i, gelu(load(x + i)));
  if (i < n) tail(x + i, n - i, [](F32 v) { return gelu(v); });
}

// value <- gelu(x), x <- gelu'(x)
inline void gelu_and_derivative_(float* x, float* value, int64_t n) {
  int64_t i = 0;
  F32 v, d;
  for (; i + kFloats <= n; i += kFloats) {
    gelu_and_derivative(load(x + i), v, d);
    store(value + i, v);
    store(x + i, d);
  }
  if (i < n) {
    float xs[kFloats] = {}, vs[kFloats], ds[kFloats];
    for (int64_t j = 0; j < n - i; ++j) xs[j] = x[i + j];
    gelu_and_derivative(load(xs), v, d);
    store(vs, v);
    store(ds, d);
    for (int64_t j = 0; j < n - i; ++j) {
      value[i + j] = vs[j];
      x[i + j] = ds[j];
    }
  }
}

}  // namespace vmath
}  // namespace tncompile_native
