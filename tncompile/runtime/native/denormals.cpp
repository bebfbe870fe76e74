// Flush-to-zero and denormals-are-zero on every thread that computes ATen's CPU ops.
//
// Subnormal floats (below 1.2e-38 in fp32 and bf16) cost x86 cores 10-100x a normal one.
// torch.set_flush_denormal sets the MXCSR bits of the calling thread only; the intra-op
// worker threads keep theirs. flush_denormals sets (or clears) both bits on the calling
// thread and, through one at::parallel_for over the pool's threads (each takes exactly one
// index), on every worker, and says whether the calling thread had them set before: the
// caller restores that state when its block ends. Off x86 it changes nothing and says so.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__SSE2__)
#include <xmmintrin.h>
#define TNCOMPILE_HAS_MXCSR 1
#endif

namespace tncompile_native {

#if defined(TNCOMPILE_HAS_MXCSR)
constexpr unsigned kFlushBits = 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)

static void set_this_thread(bool on) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | kFlushBits) : (csr & ~kFlushBits));
}
#endif

// (was the calling thread flushing before, could it be set here at all)
std::tuple<bool, bool> flush_denormals(bool on) {
#if defined(TNCOMPILE_HAS_MXCSR)
  const bool was = (_mm_getcsr() & kFlushBits) == kFlushBits;
  set_this_thread(on);
  const int64_t threads = at::get_num_threads();
  if (threads > 1 && !at::in_parallel_region()) {
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { set_this_thread(on); });
  }
  return {was, true};
#else
  (void)on;
  return {false, false};
#endif
}

}  // namespace tncompile_native

TORCH_LIBRARY_FRAGMENT(tncompile, m) {
  m.def("flush_denormals(bool on) -> (bool, bool)", tncompile_native::flush_denormals);
}
