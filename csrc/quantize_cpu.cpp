// CPU kernels of the blockwise quantization ops (kernels.h): loops over raw pointers, no
// torch headers.
//
// quantize makes one pass over each block (x + e_in is read twice while the block is in
// cache: once for the absolute maximum, once for the codes and e_out; with `minus`, the
// block's (x - minus) * scale is made first, into a block-size buffer of the thread, so
// a change is quantized without a pass that writes it out); dequantize makes
// one pass over its output, summing the pieces block by block. Blocks are split over up
// to num_threads std::threads (small calls run on the calling thread). On x86-64 CPUs with
// AVX2 (checked at run time, and switched with dah_cpu_simd) 8 values go at a time. Both
// bodies do the same float32 operations in the same order as ddp_avg_hooks/_quantize.py:
// an add, a division, a round half to even, a clamp, a multiply and a subtraction, never
// fused (no FMA), so the results are bit-identical. A block holding nan or inf gets a nan
// or inf scale and codes 0, as there.

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DAH_Q_AVX2 1
#include <immintrin.h>
#define DAH_AVX2 __attribute__((target("avx2")))
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

namespace {

// max(r, a) that keeps a nan, like torch.amax: once r is nan, no comparison changes it
inline float nan_max(float r, float a) { return (a > r || std::isnan(a)) ? a : r; }

struct Layout {
  int bits;
  int64_t block, pieces, piece_elems, piece_bytes, blocks;  // blocks: per piece
  float qmax, inv_qmax;

  float* scales(uint8_t* packed, int64_t p) const {
    return reinterpret_cast<float*>(packed + p * piece_bytes);
  }
  const float* scales(const uint8_t* packed, int64_t p) const {
    return reinterpret_cast<const float*>(packed + p * piece_bytes);
  }
  int64_t codes_offset(int64_t p) const { return p * piece_bytes + 4 * blocks; }
};

bool make_layout(int bits, int64_t block, int64_t pieces, int64_t piece_elems,
                 int64_t piece_bytes, Layout* out) {
  // a block's codes fill whole bytes: 2-bit codes need a multiple of 4 values
  if ((bits != 8 && bits != 4 && bits != 2) || block < 2 || block % (bits == 2 ? 4 : 2) ||
      pieces < 1 || piece_elems < 0 || piece_elems % block)
    return false;
  const int64_t blocks = piece_elems / block;
  const int64_t code_bytes = (piece_elems * bits / 8 + 3) / 4 * 4;
  if (piece_bytes != 4 * blocks + code_bytes) return false;
  const int q = bits == 8 ? 127 : (bits == 4 ? 7 : 3);
  // like Tensor.mul(python_float) on float32: the constant 1 / Q is rounded to float
  *out = Layout{bits, block, pieces, piece_elems, piece_bytes, blocks, static_cast<float>(q),
                static_cast<float>(1.0 / q)};
  return true;
}

// Runs body(lo, hi) over [0, n) blocks, on up to num_threads threads, each with at least
// kGrain elements' worth of blocks.
template <class Body>
void parallel_blocks(int64_t n, int64_t block, int num_threads, const Body& body) {
  constexpr int64_t kGrain = int64_t{1} << 16;
  const int64_t min_blocks = std::max<int64_t>(1, kGrain / block);
  int64_t t = std::min<int64_t>(std::max(num_threads, 1), n / min_blocks);
  if (t <= 1) {
    body(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + t - 1) / t;
  std::vector<std::thread> workers;
  int64_t lo = per;
  for (; lo < n; lo += per) {
    try {
      workers.emplace_back(body, lo, std::min(n, lo + per));
    } catch (const std::system_error&) {
      break;  // cannot start a thread: do the rest here
    }
  }
  body(int64_t{0}, std::min(per, n));
  if (lo < n) body(lo, n);
  for (auto& w : workers) w.join();
}

#ifdef DAH_Q_AVX2
const bool kHasAvx2 = __builtin_cpu_supports("avx2");
bool kAvx2 = kHasAvx2;

// |v| max of 8-value groups of the valid part: returns how many values it covered.
DAH_AVX2 int64_t absmax_avx2(const float* x, const float* e, int64_t n, float* amax) {
  // |v| as int32 bit patterns: for values without sign, integers order like the floats,
  // and every nan pattern lies above inf, so the integer max keeps a nan at no extra cost
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256i m = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    if (e != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(e + j));
    m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_castps_si256(v), magnitude));
  }
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  const int32_t bits = _mm_cvtsi128_si32(h);
  float r;
  std::memcpy(&r, &bits, sizeof r);
  r = nan_max(*amax, r);
  *amax = std::isnan(r) ? std::numeric_limits<float>::quiet_NaN() : r;  // torch's nan
  return j;
}

// o[j] = (x[j] - m[j]) * s for the 8-value groups of n values; returns how many it covered.
DAH_AVX2 int64_t change_avx2(const float* x, const float* m, float s, float* o, int64_t n) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j),
                                                        _mm256_loadu_ps(m + j)), vs));
  return j;
}

// Codes (as float, before the narrowing) and e_out of 8 valid values.
DAH_AVX2 inline __m256 quant8_avx2(const float* x, const float* e, float* e_out, __m256 d,
                                   __m256 s, __m256 q) {
  __m256 v = _mm256_loadu_ps(x);
  if (e != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(e));
  __m256 c = _mm256_round_ps(_mm256_div_ps(v, d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  c = _mm256_min_ps(_mm256_max_ps(c, _mm256_sub_ps(_mm256_setzero_ps(), q)), q);
  if (e_out != nullptr) _mm256_storeu_ps(e_out, _mm256_sub_ps(v, _mm256_mul_ps(c, s)));
  return c;
}

// 8 int32 in [-128, 127] -> 8 bytes (little-endian in a uint64).
DAH_AVX2 inline uint64_t narrow8(__m256i q) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  return static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packs_epi16(w, w)));
}

// The full 8-value groups of one block's codes; returns how many values it covered.
DAH_AVX2 int64_t quant_block_avx2(const Layout& L, const float* x, const float* e, float* e_out,
                                  int64_t n, float scale, float divisor, uint8_t* codes) {
  const __m256 d = _mm256_set1_ps(divisor), s = _mm256_set1_ps(scale);
  const __m256 q = _mm256_set1_ps(L.qmax);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 c = quant8_avx2(x + j, e == nullptr ? nullptr : e + j,
                                 e_out == nullptr ? nullptr : e_out + j, d, s, q);
    const __m256i ci = _mm256_cvtps_epi32(c);
    if (L.bits == 8) {
      const uint64_t b = narrow8(ci);
      std::memcpy(codes + j, &b, 8);
    } else {  // nibbles q + 8, pairs into bytes: byte k = n[2k] | n[2k+1] << 4
      const uint64_t b = narrow8(_mm256_add_epi32(ci, _mm256_set1_epi32(8)));
      const uint64_t y = b | (b >> 4);
      const uint32_t packed = static_cast<uint32_t>((y & 0xFF) | ((y >> 8) & 0xFF00) |
                                                    ((y >> 16) & 0xFF0000) |
                                                    ((y >> 24) & 0xFF000000));
      std::memcpy(codes + j / 2, &packed, 4);
    }
  }
  return j;
}

// 8 codes of a block from its start + j -> 8 floats q.
DAH_AVX2 inline __m256 load_codes8(const Layout& L, const uint8_t* codes, int64_t j) {
  __m256i q;
  if (L.bits == 2) {  // two bytes, four codes each: level = code - 1.5 (exact)
    uint16_t w;
    std::memcpy(&w, codes + j / 4, 2);
    const __m256i c = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3));
    return _mm256_sub_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(1.5f));
  }
  if (L.bits == 8) {
    q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j)));
  } else {
    uint32_t w;
    std::memcpy(&w, codes + j / 2, 4);
    const uint64_t spread = (w & 0xFFull) | ((w & 0xFF00ull) << 8) | ((w & 0xFF0000ull) << 16) |
                            ((w & 0xFF000000ull) << 24);  // byte k at byte 2k
    const uint64_t nib = (spread & 0x000F000F000F000Full) |
                         (((spread >> 4) & 0x000F000F000F000Full) << 8);
    q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(nib))),
                         _mm256_set1_epi32(8));
  }
  return _mm256_cvtepi32_ps(q);
}

DAH_AVX2 int64_t dequant_cat_avx2(const Layout& L, const uint8_t* codes, float scale,
                                  const float* base, float* out, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 d = _mm256_mul_ps(load_codes8(L, codes, j), s);
    _mm256_storeu_ps(out + j, base == nullptr ? d : _mm256_sub_ps(_mm256_loadu_ps(base + j), d));
  }
  return j;
}

DAH_AVX2 int64_t dequant_sum_avx2(const Layout& L, const uint8_t* packed, int64_t b,
                                  const float* base, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t p = 0; p < L.pieces; ++p) {
      const uint8_t* codes = packed + L.codes_offset(p) + b * L.block * L.bits / 8;
      const __m256 d = _mm256_mul_ps(load_codes8(L, codes, j), _mm256_set1_ps(L.scales(packed, p)[b]));
      acc = p == 0 ? d : _mm256_add_ps(acc, d);
    }
    _mm256_storeu_ps(out + j, base == nullptr ? acc : _mm256_sub_ps(_mm256_loadu_ps(base + j), acc));
  }
  return j;
}
// The fixed-point sum of squares of rms_scale over the 8-value groups of the valid part
// (added to *k); returns how many values it covered.
DAH_AVX2 int64_t rms_sum_avx2(const float* x, const float* e, int64_t n, float amax,
                              int64_t* k) {
  const __m256 a = _mm256_set1_ps(amax), two24 = _mm256_set1_ps(16777216.0f);
  __m256i acc = _mm256_setzero_si256();  // four int64 lanes
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    if (e != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(e + j));
    const __m256 t = _mm256_div_ps(v, a);
    const __m256i q = _mm256_cvttps_epi32(
        _mm256_floor_ps(_mm256_mul_ps(_mm256_mul_ps(t, t), two24)));  // integers <= 2^24
    acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(q)));
    acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(q, 1)));
  }
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  *k += lanes[0] + lanes[1] + lanes[2] + lanes[3];
  return j;
}

// The 2-bit codes (and e_out) of the 8-value groups of the valid part, under a scale
// that is not nan; returns how many values it covered (a multiple of 8).
DAH_AVX2 int64_t quant_2bit_avx2(const float* x, const float* e, float* e_out, int64_t n,
                                 float scale, float divisor, uint8_t* codes) {
  const __m256 d = _mm256_set1_ps(divisor), s = _mm256_set1_ps(scale);
  const __m256 half = _mm256_set1_ps(0.5f), top = _mm256_set1_ps(1.5f);
  const __m256 bottom = _mm256_set1_ps(-1.5f);
  alignas(32) int32_t c[8];
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    if (e != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(e + j));
    __m256 q = _mm256_add_ps(_mm256_floor_ps(_mm256_div_ps(v, d)), half);
    q = _mm256_min_ps(_mm256_max_ps(q, bottom), top);
    if (e_out != nullptr) _mm256_storeu_ps(e_out + j, _mm256_sub_ps(v, _mm256_mul_ps(q, s)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(c),
                       _mm256_cvttps_epi32(_mm256_add_ps(q, top)));  // 0..3
    codes[j / 4] = static_cast<uint8_t>(c[0] | (c[1] << 2) | (c[2] << 4) | (c[3] << 6));
    codes[j / 4 + 1] = static_cast<uint8_t>(c[4] | (c[5] << 2) | (c[6] << 4) | (c[7] << 6));
  }
  return j;
}
#endif  // DAH_Q_AVX2

// The level of element j of a block's codes: an integer, or for 2-bit codes one of
// -1.5, -0.5, 0.5, 1.5 (exact in float).
inline float code_at(const Layout& L, const uint8_t* codes, int64_t j) {
  if (L.bits == 8) return static_cast<float>(static_cast<int8_t>(codes[j]));
  if (L.bits == 2) return static_cast<float>((codes[j / 4] >> (2 * (j % 4))) & 3) - 1.5f;
  const uint8_t byte = codes[j / 2];
  return static_cast<float>(((j % 2) ? (byte >> 4) : (byte & 15)) - 8);
}

// The 2-bit codes' scale: the block's root mean square from a fixed-point sum of squares
// (k = floor((v / amax)^2 * 2^24), an exact integer sum), so that the sum's order does not
// matter: amax * sqrt(sum k / (2^24 * block)) in double, rounded to float. 0 for an
// all-zero block, nan for one holding nan or inf.
float rms_scale(const float* x, const float* e, int64_t valid, int64_t block, float amax) {
  if (!std::isfinite(amax)) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0.0f) return 0.0f;
  int64_t k = 0, j = 0;
#ifdef DAH_Q_AVX2
  if (kAvx2) j = rms_sum_avx2(x, e, valid, amax, &k);
#endif
  for (; j < valid; ++j) {
    const float t = (e == nullptr ? x[j] : x[j] + e[j]) / amax;
    const float t2 = t * t;
    k += static_cast<int64_t>(std::floor(t2 * 16777216.0f));
  }
  const double mean_square = static_cast<double>(k) / (16777216.0 * static_cast<double>(block));
  return static_cast<float>(static_cast<double>(amax) * std::sqrt(mean_square));
}

// One block of 2-bit codes: q = clamp(floor(v / divisor) + 0.5, -1.5, 1.5), -1.5 under a
// nan scale (a block holding nan or inf, whose scale is made nan: no level decodes to 0).
void quant_block_2bit(const float* x, const float* e, float* e_out, int64_t valid, int64_t block,
                      float scale, uint8_t* codes) {
  const float divisor = scale == 0.0f ? 1.0f : scale;
  const bool finite = !std::isnan(scale);
  int64_t j = 0;
#ifdef DAH_Q_AVX2
  if (kAvx2 && finite) j = quant_2bit_avx2(x, e, e_out, valid, scale, divisor, codes);
#endif
  for (; j < block; ++j) {
    float c = 0.5f;  // past the inputs' end: v = 0
    if (j < valid) {
      const float v = e == nullptr ? x[j] : x[j] + e[j];
      c = finite ? std::min(std::max(std::floor(v / divisor) + 0.5f, -1.5f), 1.5f) : -1.5f;
      if (e_out != nullptr) e_out[j] = v - c * scale;
    } else if (!finite) {
      c = -1.5f;
    }
    const int code = static_cast<int>(c + 1.5f);
    if (j % 4 == 0) codes[j / 4] = 0;
    codes[j / 4] = static_cast<uint8_t>(codes[j / 4] | (code << (2 * (j % 4))));
  }
}

// o[j] = (x[j] - m[j]) * s, j < n: a change, as the delta kernel computes it (a
// subtraction, then a multiplication, each rounded to float32)
void change(const float* x, const float* m, float s, float* o, int64_t n) {
  int64_t j = 0;
#ifdef DAH_Q_AVX2
  if (kAvx2) j = change_avx2(x, m, s, o, n);
#endif
  for (; j < n; ++j) o[j] = (x[j] - m[j]) * s;
}

// One block: values x[0..valid) (+ e), zeros up to L.block.
void quant_block(const Layout& L, const float* x, const float* e, float* e_out, int64_t valid,
                 float* scale_out, uint8_t* codes) {
  float amax = 0.0f;
  int64_t j = 0;
#ifdef DAH_Q_AVX2
  if (kAvx2) j = absmax_avx2(x, e, valid, &amax);
#endif
  for (; j < valid; ++j) amax = nan_max(amax, std::fabs(e == nullptr ? x[j] : x[j] + e[j]));
  if (L.bits == 2) {
    const float scale = rms_scale(x, e, valid, L.block, amax);
    std::memcpy(scale_out, &scale, sizeof scale);
    quant_block_2bit(x, e, e_out, valid, L.block, scale, codes);
    return;
  }
  const float scale = amax * L.inv_qmax;
  const float divisor = scale == 0.0f ? 1.0f : scale;
  // a block holding nan or inf: codes 0 under its nan / inf scale, so every value of
  // the block decodes to nan (0 * scale) and the residual holds nan too
  const bool finite = std::isfinite(scale);
  std::memcpy(scale_out, &scale, sizeof scale);
  j = 0;
#ifdef DAH_Q_AVX2
  if (kAvx2 && finite) j = quant_block_avx2(L, x, e, e_out, valid, scale, divisor, codes);
#endif
  for (; j < L.block; ++j) {
    float c = 0.0f;
    if (j < valid) {
      const float v = e == nullptr ? x[j] : x[j] + e[j];
      if (finite) c = std::min(std::max(std::nearbyint(v / divisor), -L.qmax), L.qmax);
      if (e_out != nullptr) e_out[j] = v - c * scale;
    }
    const int q = static_cast<int>(c);
    if (L.bits == 8) {
      codes[j] = static_cast<uint8_t>(static_cast<int8_t>(q));
    } else if (j % 2 == 0) {
      codes[j / 2] = static_cast<uint8_t>(q + 8);
    } else {
      codes[j / 2] = static_cast<uint8_t>(codes[j / 2] | ((q + 8) << 4));
    }
  }
}

}  // namespace

extern "C" {

int dah_quantize_simd(int mode) {
#ifdef DAH_Q_AVX2
  if (mode >= 0) kAvx2 = kHasAvx2 && mode > 0;
  return kAvx2 ? 1 : 0;
#else
  (void)mode;
  return 0;
#endif
}

int dah_quantize_cpu(const float* x, const float* minus, float scale, const float* e_in,
                     int64_t numel, int bits, int64_t block, int64_t pieces, int64_t piece_elems,
                     int64_t piece_bytes, uint8_t* packed, float* e_out, int num_threads) {
  Layout L;
  if (!make_layout(bits, block, pieces, piece_elems, piece_bytes, &L) || numel < 0 ||
      numel > pieces * piece_elems)
    return DAH_EARG;
  parallel_blocks(pieces * L.blocks, block, num_threads, [&](int64_t lo, int64_t hi) {
    std::vector<float> made(minus == nullptr ? 0 : static_cast<size_t>(block));
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t p = k / L.blocks, b = k % L.blocks;
      const int64_t g0 = p * piece_elems + b * block;
      const int64_t valid = std::min(std::max<int64_t>(numel - g0, 0), block);
      const float* v = x + g0;
      if (minus != nullptr) {  // this block's change, while it is in cache
        change(x + g0, minus + g0, scale, made.data(), valid);
        v = made.data();
      }
      quant_block(L, v, e_in == nullptr ? nullptr : e_in + g0,
                  e_out == nullptr ? nullptr : e_out + g0, valid, L.scales(packed, p) + b,
                  packed + L.codes_offset(p) + b * block * bits / 8);
    }
  });
  return DAH_OK;
}

int dah_dequantize_cpu(const uint8_t* packed, int bits, int64_t block, int64_t pieces,
                       int64_t piece_elems, int64_t piece_bytes, const float* base, float* out,
                       int64_t numel, int sum_pieces, int num_threads) {
  Layout L;
  if (!make_layout(bits, block, pieces, piece_elems, piece_bytes, &L) || numel < 0 ||
      numel > (sum_pieces ? piece_elems : pieces * piece_elems))
    return DAH_EARG;
  const int64_t nblocks = (numel + block - 1) / block;
  parallel_blocks(nblocks, block, num_threads, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t g0 = k * block, n = std::min(block, numel - g0);
      float* o = out + g0;
      const float* bs = base == nullptr ? nullptr : base + g0;
      int64_t j = 0;
      if (sum_pieces) {
#ifdef DAH_Q_AVX2
        if (kAvx2) j = dequant_sum_avx2(L, packed, k, bs, o, n);
#endif
        for (; j < n; ++j) {
          float acc = 0.0f;
          for (int64_t p = 0; p < pieces; ++p) {
            const uint8_t* codes = packed + L.codes_offset(p) + k * block * bits / 8;
            const float d = code_at(L, codes, j) * L.scales(packed, p)[k];
            acc = p == 0 ? d : acc + d;
          }
          o[j] = bs == nullptr ? acc : bs[j] - acc;
        }
      } else {
        const int64_t p = k / L.blocks, b = k % L.blocks;
        const uint8_t* codes = packed + L.codes_offset(p) + b * block * bits / 8;
        const float s = L.scales(packed, p)[b];
#ifdef DAH_Q_AVX2
        if (kAvx2) j = dequant_cat_avx2(L, codes, s, bs, o, n);
#endif
        for (; j < n; ++j) {
          const float d = code_at(L, codes, j) * s;
          o[j] = bs == nullptr ? d : bs[j] - d;
        }
      }
    }
  });
  return DAH_OK;
}

}  // extern "C"
