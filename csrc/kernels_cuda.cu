// CUDA kernels for ddp_avg_hooks: only CUDA headers, plain C entry points (kernels.h).
//
// One launch covers a list of up to DAH_CUDA_MAX_TENSORS parameters (longer lists take
// a few launches): the list's pointers, sizes and flat offsets travel by value in the
// kernel argument (apex's TensorListMetadata idea), each block handles one chunk of
// kChunk elements of one parameter and finds it by binary search over the chunk
// prefix. Inside a chunk a thread moves kVec elements per aligned vector load/store
// when every pointer of the chunk is aligned, with a scalar tail; otherwise scalar.
// Everything runs on the stream passed in, and errors come back as cudaError_t.
//
// Conversions are dtypes.h's: in device code the intrinsics c10::Half / c10::BFloat16
// use on CUDA (__float2half_rn, __float2bfloat16_rn: round to nearest-even), so
// results equal Tensor.to bit for bit (NaN payloads aside); equal dtypes are copied as
// bits. Half and bfloat16 elements are stored as uint16_t.

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtypes.h"
#include "kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;     // elements per vector access
constexpr int kUnroll = 4;  // vector accesses per thread per chunk
constexpr int64_t kChunk = int64_t{kThreads} * kVec * kUnroll;  // elements per block

enum Mode {
  kFlatten = 0, kUnflatten = 1, kDelta = 2, kApply = 3, kFeedback = 4, kApplyDelta = 5,
  kApplyProgress = 6
};

struct SegList {  // passed by value: ~1.3 KB of the 4 KB argument space
  void* param[DAH_CUDA_MAX_TENSORS];
  int64_t offset[DAH_CUDA_MAX_TENSORS];
  int64_t numel[DAH_CUDA_MAX_TENSORS];
  int64_t first_chunk[DAH_CUDA_MAX_TENSORS + 1];
  int n;
};

using dah::BF16;
using dah::F16;
using dah::F32;
using dah::convert;
using dah::dispatch2;
using dah::dispatch3;

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T>
__device__ __forceinline__ bool vec_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) == 0;
}

// p: the parameter's slice; a: flat buffer A's slice (flatten/delta/feedback output,
// unflatten/apply/apply-delta input); b: flat buffer B's slice (delta, feedback: the anchor,
// read; apply, apply-progress: the anchor, written, may be null; apply-delta: the
// anchor, read and written); c: flat buffer C's slice (feedback: the residual, read and
// written; apply-progress: the launch snapshot, read; null otherwise). N elements from there.
template <int kMode, class P, class A, class B, class C, bool kScale, int N>
__device__ __forceinline__ void do_elems(typename P::T* p, typename A::T* a, typename B::T* b,
                                         typename C::T* c, float s) {
  using PT = typename P::T;
  using AT = typename A::T;
  using BT = typename B::T;
  using CT = typename C::T;
  if constexpr (kMode == kFlatten) {
    Vec<PT, N> in = *reinterpret_cast<const Vec<PT, N>*>(p);
    Vec<AT, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if constexpr (kScale) {
        out.v[k] = A::store(P::load(in.v[k]) * s);
      } else {
        out.v[k] = convert<A, P>(in.v[k]);
      }
    }
    *reinterpret_cast<Vec<AT, N>*>(a) = out;
  } else if constexpr (kMode == kUnflatten) {
    Vec<AT, N> in = *reinterpret_cast<const Vec<AT, N>*>(a);
    Vec<PT, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = convert<P, A>(in.v[k]);
    *reinterpret_cast<Vec<PT, N>*>(p) = out;
  } else if constexpr (kMode == kDelta) {
    Vec<BT, N> an = *reinterpret_cast<const Vec<BT, N>*>(b);
    Vec<PT, N> pv = *reinterpret_cast<const Vec<PT, N>*>(p);
    Vec<AT, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = A::store((B::load(an.v[k]) - P::load(pv.v[k])) * s);
    *reinterpret_cast<Vec<AT, N>*>(a) = out;
  } else if constexpr (kMode == kFeedback) {  // B is P
    Vec<BT, N> an = *reinterpret_cast<const Vec<BT, N>*>(b);
    Vec<PT, N> pv = *reinterpret_cast<const Vec<PT, N>*>(p);
    Vec<CT, N> rv = *reinterpret_cast<const Vec<CT, N>*>(c);
    Vec<AT, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float x = (B::load(an.v[k]) - P::load(pv.v[k])) * s + C::load(rv.v[k]);
      out.v[k] = A::store(x);
      rv.v[k] = C::store(x - A::load(out.v[k]));
    }
    *reinterpret_cast<Vec<AT, N>*>(a) = out;
    *reinterpret_cast<Vec<CT, N>*>(c) = rv;
  } else if constexpr (kMode == kApplyDelta) {  // B is P
    Vec<BT, N> an = *reinterpret_cast<const Vec<BT, N>*>(b);
    Vec<AT, N> ch = *reinterpret_cast<const Vec<AT, N>*>(a);
    Vec<PT, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = P::store(B::load(an.v[k]) - A::load(ch.v[k]));
    *reinterpret_cast<Vec<PT, N>*>(p) = out;
    *reinterpret_cast<Vec<PT, N>*>(b) = out;
  } else if constexpr (kMode == kApplyProgress) {  // B and C are P
    Vec<AT, N> in = *reinterpret_cast<const Vec<AT, N>*>(a);
    Vec<CT, N> lv = *reinterpret_cast<const Vec<CT, N>*>(c);
    Vec<PT, N> pv = *reinterpret_cast<const Vec<PT, N>*>(p);
    Vec<PT, N> an;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float x = A::load(in.v[k]);
      const PT corr = P::store(x - C::load(lv.v[k]));
      pv.v[k] = P::store(P::load(pv.v[k]) + P::load(corr));
      an.v[k] = P::store(x);
    }
    *reinterpret_cast<Vec<PT, N>*>(p) = pv;
    if (b != nullptr) *reinterpret_cast<Vec<PT, N>*>(b) = an;
  } else {  // kApply: B is P
    Vec<AT, N> in = *reinterpret_cast<const Vec<AT, N>*>(a);
    Vec<PT, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = convert<P, A>(in.v[k]);
    *reinterpret_cast<Vec<PT, N>*>(p) = out;
    if (b != nullptr) *reinterpret_cast<Vec<PT, N>*>(b) = out;
  }
}

template <int kMode, class P, class A, class B, class C, bool kScale>
__global__ void __launch_bounds__(kThreads)
    seg_kernel(SegList list, void* flat_a, void* flat_b, void* flat_c, float s) {
  using PT = typename P::T;
  using AT = typename A::T;
  using BT = typename B::T;
  using CT = typename C::T;
  const int64_t chunk = blockIdx.x;
  int lo = 0, hi = list.n - 1;  // last i with first_chunk[i] <= chunk
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (list.first_chunk[mid] <= chunk) lo = mid;
    else hi = mid - 1;
  }
  const int64_t begin = (chunk - list.first_chunk[lo]) * kChunk;
  const int64_t rest = list.numel[lo] - begin;
  const int64_t n = rest < kChunk ? rest : kChunk;
  PT* p = static_cast<PT*>(list.param[lo]) + begin;
  AT* a = static_cast<AT*>(flat_a) + list.offset[lo] + begin;
  BT* b = flat_b == nullptr ? nullptr : static_cast<BT*>(flat_b) + list.offset[lo] + begin;
  CT* c = flat_c == nullptr ? nullptr : static_cast<CT*>(flat_c) + list.offset[lo] + begin;

  int64_t j = threadIdx.x;
  if (vec_aligned<PT>(p) && vec_aligned<AT>(a) && (b == nullptr || vec_aligned<BT>(b)) &&
      (c == nullptr || vec_aligned<CT>(c))) {
    const int64_t nv = n / kVec * kVec;
#pragma unroll kUnroll
    for (int64_t v = int64_t{threadIdx.x} * kVec; v < nv; v += int64_t{kThreads} * kVec)
      do_elems<kMode, P, A, B, C, kScale, kVec>(p + v, a + v, b == nullptr ? nullptr : b + v,
                                                c == nullptr ? nullptr : c + v, s);
    j = nv + threadIdx.x;  // scalar tail
  }
  for (; j < n; j += kThreads)
    do_elems<kMode, P, A, B, C, kScale, 1>(p + j, a + j, b == nullptr ? nullptr : b + j,
                                           c == nullptr ? nullptr : c + j, s);
}

template <int kMode, class P, class A, class B, bool kScale, class C = F32>
cudaError_t launch_list(void* const* params, const int64_t* numels, const int64_t* offsets,
                        int64_t n, void* flat_a, void* flat_b, float s, cudaStream_t stream,
                        void* flat_c = nullptr) {
  if (n < 0) return cudaErrorInvalidValue;
  SegList list;
  list.n = 0;
  int64_t chunks = 0;
  cudaError_t err = cudaSuccess;
  auto flush = [&]() {
    if (list.n == 0) return;
    list.first_chunk[list.n] = chunks;
    seg_kernel<kMode, P, A, B, C, kScale>
        <<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(list, flat_a, flat_b, flat_c, s);
    const cudaError_t e = cudaGetLastError();
    if (err == cudaSuccess) err = e;
    list.n = 0;
    chunks = 0;
  };
  for (int64_t i = 0; i < n; ++i) {
    if (numels[i] <= 0) continue;
    const int64_t c = (numels[i] + kChunk - 1) / kChunk;
    if (list.n == DAH_CUDA_MAX_TENSORS || chunks + c > int64_t{0x7fffffff}) flush();
    if (c > int64_t{0x7fffffff}) return cudaErrorInvalidValue;
    list.param[list.n] = params[i];
    list.offset[list.n] = offsets[i];
    list.numel[list.n] = numels[i];
    list.first_chunk[list.n] = chunks;
    chunks += c;
    ++list.n;
  }
  flush();
  return err;
}

}  // namespace

extern "C" {

int dah_flatten_cuda(const void* const* params, const int64_t* numels, const int64_t* offsets,
                     int64_t n, int param_dtype, void* flat, int flat_dtype, int has_scale,
                     float scale, void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  void* const* ps = const_cast<void* const*>(params);  // read only in kFlatten
  dispatch2(param_dtype, flat_dtype, [&](auto P, auto A) {
    using PT = decltype(P);
    using AT = decltype(A);
    auto st = static_cast<cudaStream_t>(stream);
    err = has_scale
              ? launch_list<kFlatten, PT, AT, F32, true>(ps, numels, offsets, n, flat,
                                                         nullptr, scale, st)
              : launch_list<kFlatten, PT, AT, F32, false>(ps, numels, offsets, n, flat,
                                                          nullptr, scale, st);
  });
  return static_cast<int>(err);
}

int dah_unflatten_cuda(const void* flat, int flat_dtype, void* const* params,
                       const int64_t* numels, const int64_t* offsets, int64_t n,
                       int param_dtype, void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch2(param_dtype, flat_dtype, [&](auto P, auto A) {
    using PT = decltype(P);
    using AT = decltype(A);
    err = launch_list<kUnflatten, PT, AT, F32, false>(
        params, numels, offsets, n, const_cast<void*>(flat), nullptr, 1.0f,
        static_cast<cudaStream_t>(stream));
  });
  return static_cast<int>(err);
}

int dah_delta_cuda(const void* anchor, int anchor_dtype, const void* const* params,
                   const int64_t* numels, const int64_t* offsets, int64_t n, int param_dtype,
                   void* out, int out_dtype, float scale, void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  void* const* ps = const_cast<void* const*>(params);  // read only in kDelta
  dispatch3(param_dtype, anchor_dtype, out_dtype, [&](auto P, auto B, auto A) {
    using PT = decltype(P);
    using BT = decltype(B);
    using AT = decltype(A);
    err = launch_list<kDelta, PT, AT, BT, true>(ps, numels, offsets, n, out,
                                                const_cast<void*>(anchor), scale,
                                                static_cast<cudaStream_t>(stream));
  });
  return static_cast<int>(err);
}

int dah_apply_cuda(const void* flat, int flat_dtype, void* const* params, const int64_t* numels,
                   const int64_t* offsets, int64_t n, int param_dtype, void* anchor,
                   void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch2(param_dtype, flat_dtype, [&](auto P, auto A) {
    using PT = decltype(P);
    using AT = decltype(A);
    err = launch_list<kApply, PT, AT, PT, false>(params, numels, offsets, n,
                                                 const_cast<void*>(flat), anchor, 1.0f,
                                                 static_cast<cudaStream_t>(stream));
  });
  return static_cast<int>(err);
}

int dah_feedback_cast_cuda(const void* anchor, const void* const* params, const int64_t* numels,
                           const int64_t* offsets, int64_t n, int param_dtype, void* residual,
                           int residual_dtype, void* out, int out_dtype, float scale,
                           void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  void* const* ps = const_cast<void* const*>(params);  // read only in kFeedback
  dispatch3(param_dtype, residual_dtype, out_dtype, [&](auto P, auto R, auto O) {
    using PT = decltype(P);
    using RT = decltype(R);
    using OT = decltype(O);
    err = launch_list<kFeedback, PT, OT, PT, true, RT>(
        ps, numels, offsets, n, out, const_cast<void*>(anchor), scale,
        static_cast<cudaStream_t>(stream), residual);
  });
  return static_cast<int>(err);
}

int dah_apply_delta_cuda(void* anchor, const void* change, int change_dtype, void* const* params,
                         const int64_t* numels, const int64_t* offsets, int64_t n,
                         int param_dtype, void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch2(param_dtype, change_dtype, [&](auto P, auto C) {
    using PT = decltype(P);
    using CT = decltype(C);
    err = launch_list<kApplyDelta, PT, CT, PT, false>(params, numels, offsets, n,
                                                      const_cast<void*>(change), anchor, 1.0f,
                                                      static_cast<cudaStream_t>(stream));
  });
  return static_cast<int>(err);
}

int dah_apply_progress_cuda(const void* values, int values_dtype, const void* launch,
                            void* const* params, const int64_t* numels, const int64_t* offsets,
                            int64_t n, int param_dtype, void* anchor, void* stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch2(param_dtype, values_dtype, [&](auto P, auto V) {
    using PT = decltype(P);
    using VT = decltype(V);
    err = launch_list<kApplyProgress, PT, VT, PT, false, PT>(
        params, numels, offsets, n, const_cast<void*>(values), anchor, 1.0f,
        static_cast<cudaStream_t>(stream), const_cast<void*>(launch));
  });
  return static_cast<int>(err);
}

const char* dah_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
