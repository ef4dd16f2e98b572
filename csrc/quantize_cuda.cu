// CUDA kernels of the blockwise quantization ops (kernels.h): only CUDA headers.
//
// quantize: one warp per block of values (grid-stride over blocks): the lanes read the
// block once for its absolute maximum (a warp shuffle reduction), then again for the
// codes and e_out. dequantize: one thread per output value (grid-stride). The float32
// operations are ddp_avg_hooks/_quantize.py's, spelled with the _rn intrinsics so that
// nvcc never contracts a multiply and an add into an FMA: results equal the PyTorch
// reference (and the CPU kernels) bit for bit. Everything runs on the stream passed in;
// errors come back as cudaError_t.

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxGrid = 65535;

struct QLayout {
  int bits;
  int64_t block, pieces, piece_elems, piece_bytes, blocks;
  float qmax, inv_qmax;
};

bool make_layout(int bits, int64_t block, int64_t pieces, int64_t piece_elems,
                 int64_t piece_bytes, QLayout* out) {
  if ((bits != 8 && bits != 4 && bits != 2) || block < 2 || block % (bits == 2 ? 4 : 2) ||
      pieces < 1 || piece_elems < 0 ||
      piece_elems % block)
    return false;
  const int64_t blocks = piece_elems / block;
  if (piece_bytes != 4 * blocks + (piece_elems * bits / 8 + 3) / 4 * 4) return false;
  const int q = bits == 8 ? 127 : (bits == 4 ? 7 : 3);
  *out = QLayout{bits, block, pieces, piece_elems, piece_bytes, blocks, static_cast<float>(q),
                 static_cast<float>(1.0 / q)};
  return true;
}

__device__ __forceinline__ int64_t codes_offset(const QLayout& L, int64_t p) {
  return p * L.piece_bytes + 4 * L.blocks;
}

// what a block quantizes: x, or the change (x - minus) * scale; plus the residual e
struct QInput {
  const float* x;
  const float* minus;  // may be NULL
  float scale;
  const float* e;  // may be NULL
};

__device__ __forceinline__ float value(const QInput& in, int64_t g) {
  const float x = in.minus == nullptr ? in.x[g]
                                      : __fmul_rn(__fsub_rn(in.x[g], in.minus[g]), in.scale);
  return in.e == nullptr ? x : __fadd_rn(x, in.e[g]);
}

// the code of a value, as a float: clamp(round_half_even(v / divisor), -Q, Q); 0 in a
// block whose scale is nan or inf (it holds nan or inf), so all its values decode to nan
__device__ __forceinline__ float quant_one(const QLayout& L, float v, float divisor,
                                           bool finite) {
  if (!finite) return 0.0f;
  const float c = rintf(__fdiv_rn(v, divisor));
  return fminf(fmaxf(c, -L.qmax), L.qmax);
}

// a 2-bit level: clamp(floor(v / divisor) + 0.5, -1.5, 1.5); -1.5 under a nan scale (a
// block holding nan or inf, whose scale is made nan: no level decodes to 0)
__device__ __forceinline__ float quant_2bit(float v, float divisor, bool finite) {
  if (!finite) return -1.5f;
  return fminf(fmaxf(__fadd_rn(floorf(__fdiv_rn(v, divisor)), 0.5f), -1.5f), 1.5f);
}

// max(r, a) that keeps a nan, like torch.amax (fmaxf drops it)
__device__ __forceinline__ float nan_max(float r, float a) {
  return (a > r || isnan(a)) ? a : r;
}

__global__ void __launch_bounds__(kThreads)
    quantize_kernel(QLayout L, QInput in, int64_t numel, uint8_t* packed, float* e_out) {
  const int lane = threadIdx.x % 32;
  const int64_t total = L.pieces * L.blocks;
  for (int64_t k = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; k < total;
       k += int64_t{gridDim.x} * kWarps) {
    const int64_t p = k / L.blocks, b = k % L.blocks;
    const int64_t g0 = p * L.piece_elems + b * L.block;
    int64_t valid = numel - g0;
    valid = valid < 0 ? 0 : (valid > L.block ? L.block : valid);
    float amax = 0.0f;
    for (int64_t j = lane; j < valid; j += 32) amax = nan_max(amax, fabsf(value(in, g0 + j)));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float scale = __fmul_rn(amax, L.inv_qmax);
    if (L.bits == 2) {
      // the block's root mean square from a fixed-point sum of squares (an exact integer
      // sum, whatever the order): amax * sqrt(sum floor((v / amax)^2 * 2^24) / (2^24 * block))
      long long k = 0;
      if (isfinite(amax) && amax != 0.0f) {
        for (int64_t j = lane; j < valid; j += 32) {
          const float t = __fdiv_rn(value(in, g0 + j), amax);
          k += static_cast<long long>(floorf(__fmul_rn(__fmul_rn(t, t), 16777216.0f)));
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) k += __shfl_xor_sync(0xffffffffu, k, o);
      const double mean_square = __ddiv_rn(static_cast<double>(k),
                                           16777216.0 * static_cast<double>(L.block));
      scale = !isfinite(amax) ? __int_as_float(0x7fc00000)  // nan
                              : __double2float_rn(__dmul_rn(static_cast<double>(amax),
                                                            __dsqrt_rn(mean_square)));
    }
    const float divisor = scale == 0.0f ? 1.0f : scale;
    const bool finite = isfinite(scale);
    if (lane == 0) reinterpret_cast<float*>(packed + p * L.piece_bytes)[b] = scale;
    uint8_t* codes = packed + codes_offset(L, p) + b * L.block * L.bits / 8;
    if (L.bits == 8) {
      for (int64_t j = lane; j < L.block; j += 32) {
        float c = 0.0f;
        if (j < valid) {
          const float v = value(in, g0 + j);
          c = quant_one(L, v, divisor, finite);
          if (e_out != nullptr) e_out[g0 + j] = __fsub_rn(v, __fmul_rn(c, scale));
        }
        codes[j] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(c)));
      }
    } else if (L.bits == 2) {
      for (int64_t j = 4 * lane; j < L.block; j += 128) {  // four values, one byte
        int byte = 0;
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const float v = j + h < valid ? value(in, g0 + j + h) : 0.0f;
          const float c = quant_2bit(v, divisor, finite);
          if (j + h < valid && e_out != nullptr)
            e_out[g0 + j + h] = __fsub_rn(v, __fmul_rn(c, scale));
          byte |= static_cast<int>(__fadd_rn(c, 1.5f)) << (2 * h);
        }
        codes[j / 4] = static_cast<uint8_t>(byte);
      }
    } else {
      for (int64_t j = 2 * lane; j < L.block; j += 64) {  // two values, one byte
        int nib[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float c = 0.0f;
          if (j + h < valid) {
            const float v = value(in, g0 + j + h);
            c = quant_one(L, v, divisor, finite);
            if (e_out != nullptr) e_out[g0 + j + h] = __fsub_rn(v, __fmul_rn(c, scale));
          }
          nib[h] = static_cast<int>(c) + 8;
        }
        codes[j / 2] = static_cast<uint8_t>(nib[0] | (nib[1] << 4));
      }
    }
  }
}

__device__ __forceinline__ float dequant_one(const QLayout& L, const uint8_t* packed, int64_t p,
                                             int64_t local) {
  const int64_t b = local / L.block;
  const float s = reinterpret_cast<const float*>(packed + p * L.piece_bytes)[b];
  const uint8_t* codes = packed + codes_offset(L, p);
  float q;
  if (L.bits == 8) {
    q = static_cast<float>(static_cast<int8_t>(codes[local]));
  } else if (L.bits == 2) {
    q = static_cast<float>((codes[local / 4] >> (2 * (local % 4))) & 3) - 1.5f;
  } else {
    const uint8_t byte = codes[local / 2];
    q = static_cast<float>(((local % 2) ? (byte >> 4) : (byte & 15)) - 8);
  }
  return __fmul_rn(q, s);
}

__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(QLayout L, const uint8_t* packed, const float* base, float* out,
                      int64_t numel, int sum_pieces) {
  for (int64_t g = int64_t{blockIdx.x} * kThreads + threadIdx.x; g < numel;
       g += int64_t{gridDim.x} * kThreads) {
    if (sum_pieces) {
      float acc = dequant_one(L, packed, 0, g);
      for (int64_t p = 1; p < L.pieces; ++p) acc = __fadd_rn(acc, dequant_one(L, packed, p, g));
      out[g] = base == nullptr ? acc : __fsub_rn(base[g], acc);
    } else {
      const float d = dequant_one(L, packed, g / L.piece_elems, g % L.piece_elems);
      out[g] = base == nullptr ? d : __fsub_rn(base[g], d);
    }
  }
}

unsigned grid_for(int64_t items, int64_t per_block) {
  const int64_t g = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > kMaxGrid ? kMaxGrid : g));
}

}  // namespace

extern "C" {

int dah_quantize_cuda(const float* x, const float* minus, float scale, const float* e_in,
                      int64_t numel, int bits, int64_t block, int64_t pieces, int64_t piece_elems,
                      int64_t piece_bytes, uint8_t* packed, float* e_out, void* stream) {
  QLayout L;
  if (!make_layout(bits, block, pieces, piece_elems, piece_bytes, &L) || numel < 0 ||
      numel > pieces * piece_elems)
    return static_cast<int>(cudaErrorInvalidValue);
  const int64_t total = pieces * L.blocks;
  if (total == 0) return 0;
  quantize_kernel<<<grid_for(total, kWarps), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      L, QInput{x, minus, scale, e_in}, numel, packed, e_out);
  return static_cast<int>(cudaGetLastError());
}

int dah_dequantize_cuda(const uint8_t* packed, int bits, int64_t block, int64_t pieces,
                        int64_t piece_elems, int64_t piece_bytes, const float* base, float* out,
                        int64_t numel, int sum_pieces, void* stream) {
  QLayout L;
  if (!make_layout(bits, block, pieces, piece_elems, piece_bytes, &L) || numel < 0 ||
      numel > (sum_pieces ? piece_elems : pieces * piece_elems))
    return static_cast<int>(cudaErrorInvalidValue);
  if (numel == 0) return 0;
  dequantize_kernel<<<grid_for(numel, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      L, packed, base, out, numel, sum_pieces);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
