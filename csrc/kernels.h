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
 * Error feedback (the anchor has the parameters' dtype):
 *   feedback_cast: x = (float(anchor[off+j]) - float(p[j])) * scale + float(residual[off+j]);
 *              out[off+j] = cast(x); residual[off+j] = cast(x - float(out[off+j]))
 *   apply_delta:   p[j] = anchor[off+j] = cast(float(anchor[off+j]) - float(change[off+j]))
 * An overlapped round's write (launch and the anchor have the parameters' dtype P):
 *   apply_progress: c = cast_P(float(values[off+j]) - float(launch[off+j]));
 *              p[j] = cast_P(float(p[j]) + float(c)); anchor[off+j] = cast_P(values[off+j])
 *              (anchor may be NULL: the parameters alone)
 *
 * Blockwise quantization (float32 only; ddp_avg_hooks/_quantize.py is the reference). A
 * payload holds `pieces` pieces of `piece_elems` values, a multiple of `block` (even);
 * piece p sits at packed + p * piece_bytes as [blocks float32 scales][codes][zeros to a
 * multiple of 4 bytes], piece_bytes = 4 * blocks + round_up(piece_elems * bits / 8, 4).
 * int8 codes: q as int8; int4 codes: q + 8 in a nibble, value 2i low, 2i + 1 high. Q = 127
 * (int8) or 7 (int4), c = (float)(1.0 / Q):
 *   quantize:   x'[j] = minus ? (x[j] - minus[j]) * scale : x[j] (a change, each step
 *               rounded to float32, as delta computes it), v[j] = e_in ? x'[j] + e_in[j] :
 *               x'[j] for j < numel, 0 up to pieces *
 *               piece_elems; per block scale = max|v| * c, d = scale == 0 ? 1 : scale,
 *               q[j] = clamp(round_half_even(v[j] / d), -Q, Q), e_out[j] = v[j] - q[j] *
 *               scale (j < numel). e_in and e_out may be NULL, may alias x or each other.
 *   dequantize: D = q * scale of each value; sum_pieces 0: out[j] = base ? base[j] - D[j]
 *               : D[j] for j < numel <= pieces * piece_elems (the pieces back to back);
 *               sum_pieces 1: S[j] = D_0[j] + D_1[j] + ... added in piece order, for
 *               j < numel <= piece_elems; out[j] = base ? base[j] - S[j] : S[j].
 * No operation is fused (no FMA): the results equal the PyTorch reference bit for bit.
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
int dah_feedback_cast_cpu(const void* anchor, const void* const* params, const int64_t* numels,
                          const int64_t* offsets, int64_t n, int param_dtype, void* residual,
                          int residual_dtype, void* out, int out_dtype, float scale,
                          int num_threads);
int dah_apply_delta_cpu(void* anchor, const void* change, int change_dtype, void* const* params,
                        const int64_t* numels, const int64_t* offsets, int64_t n,
                        int param_dtype, int num_threads);
int dah_apply_progress_cpu(const void* values, int values_dtype, const void* launch,
                           void* const* params, const int64_t* numels, const int64_t* offsets,
                           int64_t n, int param_dtype, void* anchor, int num_threads);
/* the vector bodies of the quantization kernels (dah_cpu_simd switches them too) */
int dah_quantize_simd(int mode);
int dah_quantize_cpu(const float* x, const float* minus, float scale, const float* e_in,
                     int64_t numel, int bits, int64_t block, int64_t pieces, int64_t piece_elems,
                     int64_t piece_bytes, uint8_t* packed, float* e_out, int num_threads);
int dah_dequantize_cpu(const uint8_t* packed, int bits, int64_t block, int64_t pieces,
                       int64_t piece_elems, int64_t piece_bytes, const float* base, float* out,
                       int64_t numel, int sum_pieces, int num_threads);

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
int dah_quantize_cuda(const float* x, const float* minus, float scale, const float* e_in,
                      int64_t numel, int bits, int64_t block, int64_t pieces, int64_t piece_elems,
                      int64_t piece_bytes, uint8_t* packed, float* e_out, void* stream);
int dah_dequantize_cuda(const uint8_t* packed, int bits, int64_t block, int64_t pieces,
                        int64_t piece_elems, int64_t piece_bytes, const float* base, float* out,
                        int64_t numel, int sum_pieces, void* stream);
int dah_feedback_cast_cuda(const void* anchor, const void* const* params, const int64_t* numels,
                           const int64_t* offsets, int64_t n, int param_dtype, void* residual,
                           int residual_dtype, void* out, int out_dtype, float scale,
                           void* stream);
int dah_apply_delta_cuda(void* anchor, const void* change, int change_dtype, void* const* params,
                         const int64_t* numels, const int64_t* offsets, int64_t n,
                         int param_dtype, void* stream);
int dah_apply_progress_cuda(const void* values, int values_dtype, const void* launch,
                            void* const* params, const int64_t* numels, const int64_t* offsets,
                            int64_t n, int param_dtype, void* anchor, void* stream);
const char* dah_cuda_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif /* DDP_AVG_HOOKS_KERNELS_H_ */
