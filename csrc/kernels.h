/* ddp_avg_hooks kernels: the C interface between the torch binding (ops.cpp) and the
 * torch-free kernels (kernels_cpu.cpp, kernels_cuda.cu).
 *
 * Only raw pointers, int64_t sizes, dtype codes and a void* stream cross this line.
 * Every function returns 0 on success and a non-zero code otherwise (a DAH_E* code,
 * or for the CUDA functions a cudaError_t; see dah_cuda_error_string).
 *
 * A call covers a list of `n` parameter tensors of one dtype. Parameter i is
 * contiguous at params[i] with numels[i] elements; its slice of the flat buffer(s)
 * starts at element offsets[i]. Flat buffers are contiguous. Arithmetic is float32
 * and the result is rounded once to the output dtype, to nearest-even (Tensor.to).
 * A copy between equal dtypes without arithmetic copies the bits.
 *
 * Semantics (see ddp_avg_hooks/_fallback.py, the reference):
 *   flatten:   flat[off+j]  = cast(has_scale ? float(p[j]) * scale : p[j])
 *   unflatten: p[j]         = cast(flat[off+j])
 *   delta:     out[off+j]   = cast((float(anchor[off+j]) - float(p[j])) * scale)
 *   apply:     p[j]         = cast(flat[off+j]); anchor[off+j] = p[j]   (anchor may be NULL,
 *              and otherwise has the parameters' dtype)
 */
#ifndef DDP_AVG_HOOKS_KERNELS_H_
#define DDP_AVG_HOOKS_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dtype codes */
enum { DAH_FLOAT32 = 0, DAH_FLOAT16 = 1, DAH_BFLOAT16 = 2 };

/* return codes of the CPU functions (the CUDA ones return a cudaError_t) */
enum { DAH_OK = 0, DAH_EDTYPE = 1, DAH_EARG = 2 };

/* ---- CPU: num_threads <= 1 runs on the calling thread ---- */
/* Vector (AVX2/F16C) bodies: mode 1 on (if the CPU has them), 0 off, -1 query; returns
 * whether they are on. Not thread-safe: for tests, while no op runs. */
int dah_cpu_simd(int mode);
int dah_flatten_cpu(const void* const* params, const int64_t* numels, const int64_t* offsets,
                    int64_t n, int param_dtype, void* flat, int flat_dtype, int has_scale,
                    float scale, int num_threads);
int dah_unflatten_cpu(const void* flat, int flat_dtype, void* const* params,
                      const int64_t* numels, const int64_t* offsets, int64_t n,
                      int param_dtype, int num_threads);
int dah_delta_cpu(const void* anchor, int anchor_dtype, const void* const* params,
                  const int64_t* numels, const int64_t* offsets, int64_t n, int param_dtype,
                  void* out, int out_dtype, float scale, int num_threads);
int dah_apply_cpu(const void* flat, int flat_dtype, void* const* params, const int64_t* numels,
                  const int64_t* offsets, int64_t n, int param_dtype, void* anchor,
                  int num_threads);

/* ---- CUDA: asynchronous on `stream` (a cudaStream_t); all pointers on the current
 * device. A list longer than one launch's capacity (DAH_CUDA_MAX_TENSORS) takes
 * ceil(n / capacity) launches. ---- */
#define DAH_CUDA_MAX_TENSORS 40
int dah_flatten_cuda(const void* const* params, const int64_t* numels, const int64_t* offsets,
                     int64_t n, int param_dtype, void* flat, int flat_dtype, int has_scale,
                     float scale, void* stream);
int dah_unflatten_cuda(const void* flat, int flat_dtype, void* const* params,
                       const int64_t* numels, const int64_t* offsets, int64_t n,
                       int param_dtype, void* stream);
int dah_delta_cuda(const void* anchor, int anchor_dtype, const void* const* params,
                   const int64_t* numels, const int64_t* offsets, int64_t n, int param_dtype,
                   void* out, int out_dtype, float scale, void* stream);
int dah_apply_cuda(const void* flat, int flat_dtype, void* const* params, const int64_t* numels,
                   const int64_t* offsets, int64_t n, int param_dtype, void* anchor,
                   void* stream);
const char* dah_cuda_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif /* DDP_AVG_HOOKS_KERNELS_H_ */
