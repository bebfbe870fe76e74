// Philox4x32-10 (Salmon et al., SC'11; the generator of cuRAND, JAX and PyTorch's CUDA
// dropout) on a vector of counters at once, for the native dropout kernels.
//
// A counter is (lo, hi, 0, 0), the key the two halves of a 64-bit seed. The state
// holds one counter per 64-bit lane with every value below 2^32, so a round's
// 32 x 32 -> 64-bit products are one multiply per lane.
#pragma once

#include <cstdint>

#include "small_gemm.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tncompile_native {
namespace philox {

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;   // multipliers
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
constexpr uint64_t kLow32 = 0xFFFFFFFFull;

constexpr int kBytes = kVectorBytes;  // small_gemm.h: 64 where AVX-512 is compiled in, else 32
typedef uint64_t U64 __attribute__((vector_size(kBytes)));
constexpr int64_t kLanes = kBytes / 8;  // counters per call
typedef uint32_t Words __attribute__((vector_size(kBytes / 2)));  // kLanes 32-bit words

// low 32 bits of every lane times m, as 64-bit products
inline U64 mul_low32(U64 a, uint32_t m) {
#if defined(__AVX512F__)
  return (U64)_mm512_mul_epu32((__m512i)a, _mm512_set1_epi64(m));
#elif defined(__AVX2__)
  return (U64)_mm256_mul_epu32((__m256i)a, _mm256_set1_epi64x(m));
#else
  return a * static_cast<uint64_t>(m);
#endif
}

// the kLanes consecutive counters first, first + 1, ...: word j of lane l is stored at out[j * stride + l]
inline void words(uint64_t first, uint32_t k0, uint32_t k1, uint32_t* out, int64_t stride) {
  U64 counter;
  for (int64_t l = 0; l < kLanes; ++l) counter[l] = first + static_cast<uint64_t>(l);
  U64 c0 = counter & kLow32, c1 = counter >> 32, c2 = U64{}, c3 = U64{};
  for (int round = 0; round < 10; ++round) {
    const U64 p0 = mul_low32(c0, kMul0), p1 = mul_low32(c2, kMul1);
    c0 = (p1 >> 32) ^ c1 ^ static_cast<uint64_t>(k0);
    c1 = p1 & kLow32;
    c2 = (p0 >> 32) ^ c3 ^ static_cast<uint64_t>(k1);
    c3 = p0 & kLow32;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  const Words w0 = __builtin_convertvector(c0, Words), w1 = __builtin_convertvector(c1, Words),
              w2 = __builtin_convertvector(c2, Words), w3 = __builtin_convertvector(c3, Words);
  __builtin_memcpy(out, &w0, sizeof(Words));
  __builtin_memcpy(out + stride, &w1, sizeof(Words));
  __builtin_memcpy(out + 2 * stride, &w2, sizeof(Words));
  __builtin_memcpy(out + 3 * stride, &w3, sizeof(Words));
}

// words of counters [first, first + groups) laid out as out[j * stride + g] (stride >= groups rounded
// up to kLanes; the lanes past groups are written too)
inline void word_rows(uint64_t first, int64_t groups, uint32_t k0, uint32_t k1, uint32_t* out, int64_t stride) {
  for (int64_t g = 0; g < groups; g += kLanes) words(first + static_cast<uint64_t>(g), k0, k1, out + g, stride);
}

inline int64_t padded_groups(int64_t groups) { return (groups + kLanes - 1) / kLanes * kLanes; }

// an element is dropped when its word is below round(p 2^32)
inline uint32_t drop_threshold(double p) {
  const double t = __builtin_nearbyint(p * 4294967296.0);
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace philox
}  // namespace tncompile_native
