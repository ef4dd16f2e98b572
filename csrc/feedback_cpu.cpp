// CPU kernels of the two ops of hooks that hold no bucket-size float buffer (kernels.h):
// the error-feedback rounding of the change (feedback_cast) and the write of an
// averaged change (apply_delta); and of an overlapped round's write (apply_progress).
// Loops over raw pointers, no torch headers.
//
// One pass each: feedback_cast reads the anchor, the parameters and the residual once
// and writes the output and the residual once; apply_delta reads the anchor and the
// change once and writes the parameters and the anchor once; apply_progress reads the
// values, the launch snapshot and the parameters once and writes the parameters and (if
// given) the anchor once. The float32 operations
// are those of ddp_avg_hooks/_fallback.py in the same order, never fused (no FMA), so
// the results are the same bits; AVX2/F16C bodies 8 elements at a time where the CPU
// has them (cpu_loops.h's switch, which dah_cpu_simd sets), the scalar conversions of
// dtypes.h elsewhere.

#include "kernels.h"
#include "cpu_loops.h"
#include "dtypes.h"

#include <cstdint>

namespace {

using dah::dispatch2;
using dah::dispatch3;
using dah::cpu::at;
using dah::cpu::CPtr;
using dah::cpu::for_segments;
using dah::cpu::Ptr;

#ifdef DAH_X86_AVX2
using dah::cpu::V8;
using dah::cpu::simd_on;

template <class P, class R, class O>
DAH_AVX2 int64_t feedback_avx2(const typename P::T* __restrict a,
                               const typename P::T* __restrict p, typename R::T* __restrict r,
                               typename O::T* __restrict o, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 x = _mm256_mul_ps(_mm256_sub_ps(V8<P>::load(a + j), V8<P>::load(p + j)), vs);
    x = _mm256_add_ps(x, V8<R>::load(r + j));
    V8<O>::store(o + j, x);
    V8<R>::store(r + j, _mm256_sub_ps(x, V8<O>::load(o + j)));
  }
  return j;
}

template <class P, class C>
DAH_AVX2 int64_t apply_delta_avx2(typename P::T* __restrict a, const typename C::T* __restrict c,
                                  typename P::T* __restrict p, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    V8<P>::store(a + j, _mm256_sub_ps(V8<P>::load(a + j), V8<C>::load(c + j)));
    V8<P>::store(p + j, V8<P>::load(a + j));  // the rounded value, bits unchanged
  }
  return j;
}

template <class P, class V>
DAH_AVX2 int64_t apply_progress_avx2(const typename V::T* __restrict v,
                                     const typename P::T* __restrict l,
                                     typename P::T* __restrict p, typename P::T* __restrict a,
                                     int64_t n) {
  alignas(32) typename P::T c[8];
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = V8<V>::load(v + j);
    V8<P>::store(c, _mm256_sub_ps(x, V8<P>::load(l + j)));  // the correction, rounded
    V8<P>::store(p + j, _mm256_add_ps(V8<P>::load(p + j), V8<P>::load(c)));
    if (a != nullptr) V8<P>::store(a + j, x);
  }
  return j;
}
#endif  // DAH_X86_AVX2

// x = (a - p) * s + r; o = x rounded; r = x - o rounded: what the rounding lost
template <class P, class R, class O>
void feedback_loop(CPtr<P> a, CPtr<P> p, Ptr<R> r, Ptr<O> o, int64_t n, float s) {
  int64_t j = 0;
#ifdef DAH_X86_AVX2
  if (simd_on()) j = feedback_avx2<P, R, O>(a, p, r, o, n, s);
#endif
  for (; j < n; ++j) {
    const float x = (P::load(a[j]) - P::load(p[j])) * s + R::load(r[j]);
    const typename O::T q = O::store(x);
    o[j] = q;
    r[j] = R::store(x - O::load(q));
  }
}

// p = a = a - c, rounded to the parameters' dtype
template <class P, class C>
void apply_delta_loop(Ptr<P> a, CPtr<C> c, Ptr<P> p, int64_t n) {
  int64_t j = 0;
#ifdef DAH_X86_AVX2
  if (simd_on()) j = apply_delta_avx2<P, C>(a, c, p, n);
#endif
  for (; j < n; ++j) {
    const typename P::T v = P::store(P::load(a[j]) - C::load(c[j]));
    a[j] = v;
    p[j] = v;
  }
}

// c = v - l and p = p + c, each rounded to the parameters' dtype; a = v, rounded (a may
// be null: the parameters alone)
template <class P, class V>
void apply_progress_loop(CPtr<V> v, CPtr<P> l, Ptr<P> p, Ptr<P> a, int64_t n) {
  int64_t j = 0;
#ifdef DAH_X86_AVX2
  if (simd_on()) j = apply_progress_avx2<P, V>(v, l, p, a, n);
#endif
  for (; j < n; ++j) {
    const float x = V::load(v[j]);
    const typename P::T c = P::store(x - P::load(l[j]));
    p[j] = P::store(P::load(p[j]) + P::load(c));
    if (a != nullptr) a[j] = P::store(x);
  }
}

}  // namespace

extern "C" {

int dah_feedback_cast_cpu(const void* anchor, const void* const* params, const int64_t* numels,
                          const int64_t* offsets, int64_t n, int param_dtype, void* residual,
                          int residual_dtype, void* out, int out_dtype, float scale,
                          int num_threads) {
  int rc = DAH_EDTYPE;
  dispatch3(param_dtype, residual_dtype, out_dtype, [&](auto P, auto R, auto O) {
    using PT = decltype(P);
    using RT = decltype(R);
    using OT = decltype(O);
    rc = for_segments(numels, n, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      const int64_t f = offsets[i] + b;
      feedback_loop<PT, RT, OT>(at<PT>(anchor, f), at<PT>(params[i], b),
                                at<RT>(residual, f), at<OT>(out, f), e - b, scale);
    });
  });
  return rc;
}

int dah_apply_delta_cpu(void* anchor, const void* change, int change_dtype, void* const* params,
                        const int64_t* numels, const int64_t* offsets, int64_t n,
                        int param_dtype, int num_threads) {
  int rc = DAH_EDTYPE;
  dispatch2(param_dtype, change_dtype, [&](auto P, auto C) {
    using PT = decltype(P);
    using CT = decltype(C);
    rc = for_segments(numels, n, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      const int64_t f = offsets[i] + b;
      apply_delta_loop<PT, CT>(at<PT>(anchor, f), at<CT>(change, f), at<PT>(params[i], b),
                               e - b);
    });
  });
  return rc;
}

int dah_apply_progress_cpu(const void* values, int values_dtype, const void* launch,
                           void* const* params, const int64_t* numels, const int64_t* offsets,
                           int64_t n, int param_dtype, void* anchor, int num_threads) {
  int rc = DAH_EDTYPE;
  dispatch2(param_dtype, values_dtype, [&](auto P, auto V) {
    using PT = decltype(P);
    using VT = decltype(V);
    rc = for_segments(numels, n, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      const int64_t f = offsets[i] + b;
      apply_progress_loop<PT, VT>(at<VT>(values, f), at<PT>(launch, f), at<PT>(params[i], b),
                                  anchor == nullptr ? nullptr : at<PT>(anchor, f), e - b);
    });
  });
  return rc;
}

}  // extern "C"
