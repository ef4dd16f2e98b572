// Shared pieces of the CPU kernels (kernels_cpu.cpp, feedback_cpu.cpp): 8-lane AVX2/F16C
// loads and stores per dtype, and the split of a segment list over threads. No torch
// headers.
#ifndef DDP_AVG_HOOKS_CPU_LOOPS_H_
#define DDP_AVG_HOOKS_CPU_LOOPS_H_

#include "dtypes.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DAH_X86_AVX2 1
#include <immintrin.h>
// Functions compiled for AVX2 + F16C; called only when the CPU has both (cpu_has_avx2()).
#define DAH_AVX2 __attribute__((target("avx2,f16c")))
#endif

namespace dah {
namespace cpu {

#ifdef DAH_X86_AVX2
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

// Whether the vector bodies run (where the CPU has them); dah_cpu_simd(0) turns them off
// to test the scalar code. One switch for every kernel that includes this header.
inline bool& simd_on() {
  static bool on = cpu_has_avx2();
  return on;
}

// 8 elements <-> 8 floats in a __m256, rounding exactly like dtypes.h's scalar versions
// (the F16C instructions are what torch's own vectorized CPU copy uses).
template <class D>
struct V8;
template <>
struct V8<F32> {
  static DAH_AVX2 __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static DAH_AVX2 void store(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
};
template <>
struct V8<F16> {
  static DAH_AVX2 __m256 load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static DAH_AVX2 void store(uint16_t* p, __m256 x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
template <>
struct V8<BF16> {
  static DAH_AVX2 __m256 load(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static DAH_AVX2 void store(uint16_t* p, __m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // 32 -> 16 bits: packus works per 128-bit lane, then gather the two low halves
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};
#endif  // DAH_X86_AVX2

template <class D>
using Ptr = typename D::T* __restrict;
template <class D>
using CPtr = const typename D::T* __restrict;

// ---- splitting a segment list over threads ----
constexpr int64_t kGrain = int64_t{1} << 16;  // elements per thread at least
constexpr int64_t kAlign = 256;               // range boundaries, in elements

// Runs body(i, begin, end) over every segment slice, i.e. for segment i the elements
// [begin, end) of that segment, spread over up to num_threads threads.
template <class Body>
int for_segments(const int64_t* numels, int64_t n, int num_threads, const Body& body) {
  if (n < 0) return DAH_EARG;
  std::vector<int64_t> start(static_cast<size_t>(n) + 1, 0);  // prefix sums
  for (int64_t i = 0; i < n; ++i) {
    if (numels[i] < 0) return DAH_EARG;
    start[i + 1] = start[i] + numels[i];
  }
  const int64_t total = start[n];
  auto run = [&](int64_t lo, int64_t hi) {
    if (lo >= hi) return;
    int64_t i = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; i < n && start[i] < hi; ++i) {
      const int64_t b = std::max(lo, start[i]) - start[i];
      const int64_t e = std::min(hi, start[i + 1]) - start[i];
      if (b < e) body(i, b, e);
    }
  };
  int64_t t = std::min<int64_t>(std::max(num_threads, 1), total / kGrain);
  if (t <= 1) {
    run(0, total);
    return DAH_OK;
  }
  int64_t per = (total + t - 1) / t;
  per = (per + kAlign - 1) / kAlign * kAlign;
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(t - 1));
  int64_t lo = per;  // the calling thread takes [0, per)
  for (; lo < total; lo += per) {
    const int64_t hi = std::min(total, lo + per);
    try {
      workers.emplace_back(run, lo, hi);
    } catch (const std::system_error&) {
      break;  // cannot start a thread: do the rest here
    }
  }
  run(0, std::min(per, total));
  if (lo < total) run(lo, total);
  for (auto& w : workers) w.join();
  return DAH_OK;
}

template <class D>
typename D::T* at(void* base, int64_t off) {
  return static_cast<typename D::T*>(base) + off;
}
template <class D>
const typename D::T* at(const void* base, int64_t off) {
  return static_cast<const typename D::T*>(base) + off;
}

}  // namespace cpu
}  // namespace dah

#endif  // DDP_AVG_HOOKS_CPU_LOOPS_H_
