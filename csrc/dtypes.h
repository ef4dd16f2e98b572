// Dtype traits and dtype dispatch shared by kernels_cpu.cpp (g++) and kernels_cuda.cu
// (nvcc). No torch headers.
//
// A trait (F32, F16, BF16) names the storage type T (float, or uint16_t holding the
// bits of a half / bfloat16) and converts one element: load(T) -> float, exact, and
// store(float) -> T, rounded to nearest-even as Tensor.to does. Device code uses the
// CUDA intrinsics c10::Half / c10::BFloat16 use on CUDA (__float2half_rn,
// __float2bfloat16_rn); host code uses the portable branch-free versions below, which
// equal torch's CPU conversions bit for bit for every non-NaN input (subnormals and
// overflow to inf included) and auto-vectorize. NaN stays NaN; its payload is not part
// of the contract (torch's own code paths disagree on it).
#ifndef DDP_AVG_HOOKS_DTYPES_H_
#define DDP_AVG_HOOKS_DTYPES_H_

#include <stdint.h>
#include <string.h>

#include "kernels.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define DAH_HD __host__ __device__ __forceinline__
#else
#define DAH_HD inline
#endif

namespace dah {

// The bits of one 4-byte type as another (memcpy compiles to a register move, host and device).
template <class To, class From>
DAH_HD To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: sizes differ");
  To y;
  memcpy(&y, &x, sizeof y);
  return y;
}
DAH_HD uint32_t f2u(float f) { return bits_as<uint32_t>(f); }
DAH_HD float u2f(uint32_t u) { return bits_as<float>(u); }

// IEEE half -> float (exact); host: after c10::detail::fp16_ieee_to_fp32_value.
DAH_HD float half_to_float(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r = two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized);
  return u2f(sign | r);
#endif
}

// float -> IEEE half, nearest-even; host: F. Giesen's float_to_half_fast3_rtne, made
// branch-free so it vectorizes.
DAH_HD uint16_t float_to_half(float f) {
#ifdef __CUDA_ARCH__
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t x = f2u(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  // normal result: rebias the exponent, round on bit 13 (carries into inf correctly)
  const uint32_t normal = (ax + 0xC8000FFFu + ((ax >> 13) & 1u)) >> 13;
  // subnormal or zero result: let the FPU round by adding 0.5f (aligns the mantissa)
  const uint32_t subnormal = f2u(u2f(ax) + 0.5f) - 0x3F000000u;
  const uint32_t nan = 0x7E00u | ((ax >> 13) & 0x3FFu);
  uint32_t r = ax < 0x38800000u ? subnormal : normal;
  r = ax >= 0x47800000u ? 0x7C00u : r;  // overflow -> inf
  r = ax > 0x7F800000u ? nan : r;
  return static_cast<uint16_t>(r | sign);
#endif
}

DAH_HD float bf16_to_float(uint16_t b) { return u2f(static_cast<uint32_t>(b) << 16); }

// float -> bfloat16, nearest-even; host: as c10::detail::round_to_nearest_even
// (NaN -> the canonical 0x7fc0).
DAH_HD uint16_t float_to_bf16(float f) {
#ifdef __CUDA_ARCH__
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  const uint32_t u = f2u(f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(r);
#endif
}

struct F32 {
  using T = float;
  static DAH_HD float load(T x) { return x; }
  static DAH_HD T store(float x) { return x; }
};
struct F16 {
  using T = uint16_t;
  static DAH_HD float load(T x) { return half_to_float(x); }
  static DAH_HD T store(float x) { return float_to_half(x); }
};
struct BF16 {
  using T = uint16_t;
  static DAH_HD float load(T x) { return bf16_to_float(x); }
  static DAH_HD T store(float x) { return float_to_bf16(x); }
};

template <class A, class B>
struct same_trait {
  static constexpr bool value = false;
};
template <class A>
struct same_trait<A, A> {
  static constexpr bool value = true;
};

// In -> Out with one rounding; equal dtypes keep their bits.
template <class Out, class In>
DAH_HD typename Out::T convert(typename In::T x) {
  if constexpr (same_trait<Out, In>::value) {
    return x;
  } else {
    return Out::store(In::load(x));
  }
}

// Calls f(F32{}) / f(F16{}) / f(BF16{}) for a dtype code (host only); false for an
// unknown code.
template <class Fn>
inline bool dispatch(int dtype, Fn&& f) {
  switch (dtype) {
    case DAH_FLOAT32: f(F32{}); return true;
    case DAH_FLOAT16: f(F16{}); return true;
    case DAH_BFLOAT16: f(BF16{}); return true;
    default: return false;
  }
}

// f(A{}, B{}) / f(A{}, B{}, C{}) for two / three dtype codes (host only); f is not
// called if a code is unknown.
template <class Fn>
inline void dispatch2(int a, int b, Fn&& f) {
  dispatch(a, [&](auto A) { dispatch(b, [&](auto B) { f(A, B); }); });
}
template <class Fn>
inline void dispatch3(int a, int b, int c, Fn&& f) {
  dispatch(a, [&](auto A) { dispatch2(b, c, [&](auto B, auto C) { f(A, B, C); }); });
}

}  // namespace dah

#endif  // DDP_AVG_HOOKS_DTYPES_H_
