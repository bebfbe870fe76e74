// Register-blocked small GEMM for tncompile's native CPU kernels.
//
//   c (M x N) (+)= a (M x K) @ b (K x N) [+ init row]
//
// a's element (m, k) sits at a[m * a_rs + k * a_cs] (any layout, a is small);
// b and c are row-major with row strides ldb, ldc. Blocks of MR rows x (1 or
// 2) vectors of c are accumulated in registers (GCC/Clang vector extensions:
// 64-byte vectors where AVX-512 is compiled in, 32-byte otherwise; narrower
// blocks of 32 and 16 bytes take the remaining columns down to 4 fp32); the
// last 1..3 fp32 columns run scalar (none where N is a multiple of
// narrowest_lanes<T>(): callers that own c can pad to it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tncompile_native {

#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#else
constexpr int kVectorBytes = 32;
#endif

// rows per register block: MR x 2 accumulators + operands fit the register file (32 vector
// registers with AVX-512, 16 without)
#if defined(__AVX512F__)
constexpr int64_t MR = 8;
#else
constexpr int64_t MR = 6;
#endif

// rows per block for an M-row product: MR, or 6 where that splits M evenly and MR does not
// (36 = [t, 1]^T rows of a rank-35 gradient: six blocks of 6, not four of 8 and one of 4)
inline int64_t row_block(int64_t M) { return (M % MR != 0 && M % 6 == 0) ? 6 : MR; }

template <typename T>
struct Lanes {
  typedef T vec __attribute__((vector_size(kVectorBytes)));
  static constexpr int64_t n = kVectorBytes / sizeof(T);
};

template <typename T>
struct HalfLanes {  // half a register: column tails of 8..15 fp32 on AVX-512, 4..7 with 32-byte vectors
  typedef T vec __attribute__((vector_size(kVectorBytes / 2)));
  static constexpr int64_t n = kVectorBytes / 2 / sizeof(T);
};

template <typename T>
struct QuarterLanes {  // a quarter of a 64-byte register (16 bytes): column tails of 4..7 fp32 on AVX-512
  typedef T vec __attribute__((vector_size(kVectorBytes / 4)));
  static constexpr int64_t n = kVectorBytes / 4 / sizeof(T);
};

// The narrowest column block small_gemm vectorizes: 16 bytes (4 fp32, 2 fp64). Columns
// padded to a multiple of it leave no scalar tail.
template <typename T>
constexpr int64_t narrowest_lanes() {
  return 16 / static_cast<int64_t>(sizeof(T));
}

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

template <typename V, typename T>
inline V load(const T* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}

template <typename T, typename V>
inline void store(T* p, V v) {
  __builtin_memcpy(p, &v, sizeof(V));
}

// Streaming stores for outputs far larger than the caches: written once, never
// read back here, so skipping the read-for-ownership of every line saves a
// third of the memory traffic. Only for aligned whole vectors; see stream_fence.
inline thread_local bool streaming_stores = false;

inline void stream_fence() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_sfence();  // streaming stores are weakly ordered: publish them before other threads read
#endif
}

#if defined(__AVX512F__)
inline void stream(float* p, Lanes<float>::vec v) { _mm512_stream_ps(p, (__m512)v); }
inline void stream(double* p, Lanes<double>::vec v) { _mm512_stream_pd(p, (__m512d)v); }
#define TNCOMPILE_STREAM 1
#elif defined(__AVX__)
inline void stream(float* p, Lanes<float>::vec v) { _mm256_stream_ps(p, (__m256)v); }
inline void stream(double* p, Lanes<double>::vec v) { _mm256_stream_pd(p, (__m256d)v); }
#define TNCOMPILE_STREAM 1
#endif

template <typename T, typename V>
inline void store_out(T* p, V v) {
#if defined(TNCOMPILE_STREAM)
  if constexpr (sizeof(V) == kVectorBytes) {  // whole registers only, at aligned addresses
    if (streaming_stores && reinterpret_cast<uintptr_t>(p) % sizeof(V) == 0) {
      stream(p, v);
      return;
    }
  }
#endif
  store(p, v);
}

template <typename T, int ROWS, int NV, typename LanesT = Lanes<T>>
inline void block(const T* __restrict__ a, int64_t a_rs, int64_t a_cs, const T* __restrict__ b, int64_t ldb,
                  T* __restrict__ c, int64_t ldc, int64_t K, bool accumulate, const T* __restrict__ init) {
  using V = typename LanesT::vec;
  constexpr int64_t L = LanesT::n;
  V acc[ROWS][NV];
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = init ? load<V>(init + v * L) : V{};
  for (int64_t k = 0; k < K; ++k) {
    V bk[NV];
    for (int v = 0; v < NV; ++v) bk[v] = load<V>(b + k * ldb + v * L);
    const T* ak = a + k * a_cs;
    for (int i = 0; i < ROWS; ++i) {
      const T w = ak[i * a_rs];
      for (int v = 0; v < NV; ++v) acc[i][v] += w * bk[v];
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < NV; ++v) {
      T* p = c + i * ldc + v * L;
      if (accumulate)
        store(p, load<V>(p) + acc[i][v]);
      else
        store_out<T, V>(p, acc[i][v]);
    }
}

template <typename T, int NV, typename LanesT = Lanes<T>>
inline void rows_block(int64_t rows, const T* a, int64_t a_rs, int64_t a_cs, const T* b, int64_t ldb, T* c,
                       int64_t ldc, int64_t K, bool accumulate, const T* init) {
  switch (rows) {
#if defined(__AVX512F__)
    case 8: block<T, 8, NV, LanesT>(a, a_rs, a_cs, b, ldb, c, ldc, K, accumulate, init); break;
    case 7: block<T, 7, NV, LanesT>(a, a_rs, a_cs, b, ldb, c, ldc, K, accumulate, init); break;
#endif
    case 6: block<T, 6, NV, LanesT>(a, a_rs, a_cs, b, ldb, c, ldc, K, accumulate, init); break;
    case 5: block<T, 5, NV, LanesT>(a, a_rs, a_cs, b, ldb, c, ldc, K, accumulate, init); break;
    case 4: block<T, 4, NV, LanesT>(a, a_rs, a_cs, b, ldb, c, ldc, K, accumulate, init); break;
    case 3: block<T, 3, NV, LanesT>(a, a_rs, a_cs, b, ldb, c, ldc, K, accumulate, init); break;
    case 2: block<T, 2, NV, LanesT>(a, a_rs, a_cs, b, ldb, c, ldc, K, accumulate, init); break;
    default: block<T, 1, NV, LanesT>(a, a_rs, a_cs, b, ldb, c, ldc, K, accumulate, init); break;
  }
}

// Column blocks outside, row blocks inside: each K x (column block) panel of b is read once.
template <typename T>
void small_gemm(const T* a, int64_t a_rs, int64_t a_cs, const T* b, int64_t ldb, T* c, int64_t ldc, int64_t M,
                int64_t K, int64_t N, bool accumulate, const T* init = nullptr) {
  constexpr int64_t L = Lanes<T>::n;
  const int64_t mr = row_block(M);
  int64_t n0 = 0;
  for (; n0 + 2 * L <= N; n0 += 2 * L)
    for (int64_t m0 = 0; m0 < M; m0 += mr)
      rows_block<T, 2>(std::min(mr, M - m0), a + m0 * a_rs, a_rs, a_cs, b + n0, ldb, c + m0 * ldc + n0, ldc, K,
                       accumulate, init ? init + n0 : nullptr);
  for (; n0 + L <= N; n0 += L)
    for (int64_t m0 = 0; m0 < M; m0 += mr)
      rows_block<T, 1>(std::min(mr, M - m0), a + m0 * a_rs, a_rs, a_cs, b + n0, ldb, c + m0 * ldc + n0, ldc, K,
                       accumulate, init ? init + n0 : nullptr);
  if constexpr (kVectorBytes >= 32) {  // a half-width block: 8..15 remaining fp32 columns (4..7 on AVX2)
    constexpr int64_t H = L / 2;
    for (; n0 + H <= N; n0 += H)
      for (int64_t m0 = 0; m0 < M; m0 += mr)
        rows_block<T, 1, HalfLanes<T>>(std::min(mr, M - m0), a + m0 * a_rs, a_rs, a_cs, b + n0, ldb,
                                       c + m0 * ldc + n0, ldc, K, accumulate, init ? init + n0 : nullptr);
  }
  if constexpr (kVectorBytes == 64) {  // a quarter-width (16-byte) block for 4..7 remaining fp32 columns
    constexpr int64_t Q = L / 4;
    for (; n0 + Q <= N; n0 += Q)
      for (int64_t m0 = 0; m0 < M; m0 += mr)
        rows_block<T, 1, QuarterLanes<T>>(std::min(mr, M - m0), a + m0 * a_rs, a_rs, a_cs, b + n0, ldb,
                                          c + m0 * ldc + n0, ldc, K, accumulate, init ? init + n0 : nullptr);
  }
  for (; n0 < N; ++n0)  // the last columns, fewer than a vector
    for (int64_t i = 0; i < M; ++i) {
      T acc = init ? init[n0] : T(0);
      for (int64_t k = 0; k < K; ++k) acc += a[i * a_rs + k * a_cs] * b[k * ldb + n0];
      T* p = c + i * ldc + n0;
      *p = accumulate ? *p + acc : acc;
    }
}

}  // namespace tncompile_native

namespace tncompile_native {

template <typename T, typename V>
inline T lane_sum(V v) {
  T s = 0;
  for (int64_t l = 0; l < static_cast<int64_t>(sizeof(V) / sizeof(T)); ++l) s += v[l];
  return s;
}

// c (M x N) = a (M x K) @ b^T, with b stored (N x K): both read along K, so no
// transposed copy of b is needed. Dot products over K, 4 columns of c at a time.
template <typename T>
void small_gemm_nt(const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc, int64_t M, int64_t N,
                   int64_t K) {
  using V = typename Lanes<T>::vec;
  constexpr int64_t L = Lanes<T>::n;
  const int64_t kv = K / L * L;
  for (int64_t i = 0; i < M; ++i) {
    const T* ai = a + i * lda;
    int64_t j = 0;
    for (; j + 4 <= N; j += 4) {
      V acc[4] = {V{}, V{}, V{}, V{}};
      for (int64_t k = 0; k < kv; k += L) {
        const V av = load<V>(ai + k);
        for (int q = 0; q < 4; ++q) acc[q] += av * load<V>(b + (j + q) * ldb + k);
      }
      for (int q = 0; q < 4; ++q) {
        T s = lane_sum<T>(acc[q]);
        for (int64_t k = kv; k < K; ++k) s += ai[k] * b[(j + q) * ldb + k];
        c[i * ldc + j + q] = s;
      }
    }
    for (; j < N; ++j) {
      V acc = V{};
      for (int64_t k = 0; k < kv; k += L) acc += load<V>(ai + k) * load<V>(b + j * ldb + k);
      T s = lane_sum<T>(acc);
      for (int64_t k = kv; k < K; ++k) s += ai[k] * b[j * ldb + k];
      c[i * ldc + j] = s;
    }
  }
}

}  // namespace tncompile_native
