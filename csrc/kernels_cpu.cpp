// CPU kernels for ddp_avg_hooks: loops over raw pointers, no torch headers.
//
// Each op walks a list of parameter segments (see kernels.h). The elements of the
// whole list are split into equal ranges, one per thread (std::thread, at most
// `num_threads`, which ops.cpp takes from at::get_num_threads()); small calls run on
// the calling thread. On x86-64 CPUs with AVX2 and F16C (checked at run time) the loops
// run 8 elements at a time with the F16C conversion instructions, as torch's own
// vectorized copy does; elsewhere, and for the last n % 8 elements, the portable
// branch-free scalar conversions of dtypes.h run (the compiler vectorizes them too).
// Both round the same way, bit for bit.

#include "kernels.h"
#include "dtypes.h"
#include "cpu_loops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using dah::BF16;
using dah::F16;
using dah::F32;
using dah::dispatch2;
using dah::dispatch3;
using dah::cpu::CPtr;
using dah::cpu::Ptr;
using dah::cpu::at;
using dah::cpu::for_segments;
#ifdef DAH_X86_AVX2
using dah::cpu::V8;
using dah::cpu::simd_on;

// The vector bodies: each handles the first n - n % 8 elements and returns that count.
template <class P, class A, bool kScale>
DAH_AVX2 int64_t flatten_avx2(const typename P::T* __restrict p, typename A::T* __restrict a,
                              int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 x = V8<P>::load(p + j);
    if constexpr (kScale) x = _mm256_mul_ps(x, vs);
    V8<A>::store(a + j, x);
  }
  return j;
}

template <class P, class A>
DAH_AVX2 int64_t copy_avx2(const typename A::T* __restrict a, typename P::T* __restrict p,
                           int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) V8<P>::store(p + j, V8<A>::load(a + j));
  return j;
}

template <class P, class A, class O>
DAH_AVX2 int64_t delta_avx2(const typename A::T* __restrict a, const typename P::T* __restrict p,
                            typename O::T* __restrict o, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    V8<O>::store(o + j, _mm256_mul_ps(_mm256_sub_ps(V8<A>::load(a + j), V8<P>::load(p + j)), vs));
  return j;
}

template <class P, class A>
DAH_AVX2 int64_t apply_avx2(const typename A::T* __restrict a, typename P::T* __restrict p,
                            typename P::T* __restrict anchor, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = V8<A>::load(a + j);
    V8<P>::store(p + j, x);
    V8<P>::store(anchor + j, x);
  }
  return j;
}
#endif  // DAH_X86_AVX2


// ---- the four inner loops: one segment slice of n elements ----
template <class P, class A, bool kScale>
void flatten_loop(CPtr<P> p, Ptr<A> a, int64_t n, float s) {
  if constexpr (std::is_same_v<P, A> && !kScale) {
    std::memcpy(a, p, static_cast<size_t>(n) * sizeof(typename P::T));
  } else {
    int64_t j = 0;
#ifdef DAH_X86_AVX2
    if (simd_on()) j = flatten_avx2<P, A, kScale>(p, a, n, s);
#endif
    for (; j < n; ++j) {
      float x = P::load(p[j]);
      if constexpr (kScale) x *= s;
      a[j] = A::store(x);
    }
  }
}

template <class P, class A>
void copy_loop(CPtr<A> a, Ptr<P> p, int64_t n) {
  if constexpr (std::is_same_v<P, A>) {
    std::memcpy(p, a, static_cast<size_t>(n) * sizeof(typename P::T));
  } else {
    int64_t j = 0;
#ifdef DAH_X86_AVX2
    if (simd_on()) j = copy_avx2<P, A>(a, p, n);
#endif
    for (; j < n; ++j) p[j] = P::store(A::load(a[j]));
  }
}

template <class P, class A, class O>
void delta_loop(CPtr<A> a, CPtr<P> p, Ptr<O> o, int64_t n, float s) {
  int64_t j = 0;
#ifdef DAH_X86_AVX2
  if (simd_on()) j = delta_avx2<P, A, O>(a, p, o, n, s);
#endif
  for (; j < n; ++j) o[j] = O::store((A::load(a[j]) - P::load(p[j])) * s);
}

template <class P, class A>
void apply_loop(CPtr<A> a, Ptr<P> p, Ptr<P> anchor, int64_t n) {
  if constexpr (std::is_same_v<P, A>) {
    // in cache-sized blocks, so `a` is read from memory once for both copies
    constexpr int64_t kBlock = 4096;
    for (int64_t j = 0; j < n; j += kBlock) {
      const size_t bytes = static_cast<size_t>(std::min(kBlock, n - j)) * sizeof(typename P::T);
      std::memcpy(p + j, a + j, bytes);
      std::memcpy(anchor + j, a + j, bytes);
    }
  } else {
    int64_t j = 0;
#ifdef DAH_X86_AVX2
    if (simd_on()) j = apply_avx2<P, A>(a, p, anchor, n);
#endif
    for (; j < n; ++j) {
      const typename P::T v = P::store(A::load(a[j]));
      p[j] = v;
      anchor[j] = v;
    }
  }
}


}  // namespace

extern "C" {

int dah_cpu_simd(int mode) {
  dah_quantize_simd(mode);
#ifdef DAH_X86_AVX2
  if (mode >= 0) simd_on() = dah::cpu::cpu_has_avx2() && mode > 0;
  return simd_on() ? 1 : 0;
#else
  (void)mode;
  return 0;
#endif
}

int dah_flatten_cpu(const void* const* params, const int64_t* numels, const int64_t* offsets,
                    int64_t n, int param_dtype, void* flat, int flat_dtype, int has_scale,
                    float scale, int num_threads) {
  int rc = DAH_EDTYPE;
  dispatch2(param_dtype, flat_dtype, [&](auto P, auto A) {
    using PT = decltype(P);
    using AT = decltype(A);
    rc = for_segments(numels, n, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      const auto* p = at<PT>(params[i], b);
      auto* a = at<AT>(flat, offsets[i] + b);
      if (has_scale) flatten_loop<PT, AT, true>(p, a, e - b, scale);
      else flatten_loop<PT, AT, false>(p, a, e - b, scale);
    });
  });
  return rc;
}

int dah_unflatten_cpu(const void* flat, int flat_dtype, void* const* params,
                      const int64_t* numels, const int64_t* offsets, int64_t n,
                      int param_dtype, int num_threads) {
  int rc = DAH_EDTYPE;
  dispatch2(param_dtype, flat_dtype, [&](auto P, auto A) {
    using PT = decltype(P);
    using AT = decltype(A);
    rc = for_segments(numels, n, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      copy_loop<PT, AT>(at<AT>(flat, offsets[i] + b), at<PT>(params[i], b), e - b);
    });
  });
  return rc;
}

int dah_delta_cpu(const void* anchor, int anchor_dtype, const void* const* params,
                  const int64_t* numels, const int64_t* offsets, int64_t n, int param_dtype,
                  void* out, int out_dtype, float scale, int num_threads) {
  int rc = DAH_EDTYPE;
  dispatch3(param_dtype, anchor_dtype, out_dtype, [&](auto P, auto A, auto O) {
    using PT = decltype(P);
    using AT = decltype(A);
    using OT = decltype(O);
    rc = for_segments(numels, n, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      delta_loop<PT, AT, OT>(at<AT>(anchor, offsets[i] + b), at<PT>(params[i], b),
                             at<OT>(out, offsets[i] + b), e - b, scale);
    });
  });
  return rc;
}

int dah_apply_cpu(const void* flat, int flat_dtype, void* const* params, const int64_t* numels,
                  const int64_t* offsets, int64_t n, int param_dtype, void* anchor,
                  int num_threads) {
  int rc = DAH_EDTYPE;
  dispatch2(param_dtype, flat_dtype, [&](auto P, auto A) {
    using PT = decltype(P);
    using AT = decltype(A);
    rc = for_segments(numels, n, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      const auto* a = at<AT>(flat, offsets[i] + b);
      auto* p = at<PT>(params[i], b);
      if (anchor != nullptr) apply_loop<PT, AT>(a, p, at<PT>(anchor, offsets[i] + b), e - b);
      else copy_loop<PT, AT>(a, p, e - b);
    });
  });
  return rc;
}

}  // extern "C"
