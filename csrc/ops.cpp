// Torch binding of the ddp_avg_hooks kernels: the only source file that includes torch.
//
// ddp_avg_hooks/ops.py validates every call (with the user-facing messages) and routes
// here only calls the kernels can run: float32/float16/bfloat16 tensors, all on the
// CPU, or on one CUDA device when built with DAH_WITH_CUDA. The binding only asserts
// the invariants the kernels rely on (short messages), then runs; the quantization kernels
// check their layout themselves and return an error for one that does not add up. Parameters are
// grouped by dtype (one kernel call per group); non-contiguous parameters
// (channels_last, strided views) go through a contiguous temporary. All bindings
// release the GIL.

#include <torch/extension.h>

#include <optional>
#include <vector>

#include "kernels.h"

#ifdef DAH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DAH_FLOAT32;
    case at::kHalf: return DAH_FLOAT16;
    case at::kBFloat16: return DAH_BFLOAT16;
    default: return -1;
  }
}

bool kernel_device(const at::Device& d) {
#ifdef DAH_WITH_CUDA
  if (d.is_cuda()) return true;
#endif
  return d.is_cpu();
}

// What the kernels need: kernel dtypes, one supported device, contiguous 1-D flat
// buffers that hold exactly the parameters' elements.
void check_args(const char* op, const std::vector<at::Tensor>& params,
                std::initializer_list<const at::Tensor*> flats) {
  const at::Tensor& first = **flats.begin();
  TORCH_CHECK(kernel_device(first.device()), op, ": device not supported by the kernels");
  int64_t total = 0;
  for (const at::Tensor& p : params) {
    TORCH_CHECK(dtype_code(p.scalar_type()) >= 0 && p.device() == first.device(), op,
                ": params need kernel dtypes and the flat buffer's device");
    total += p.numel();
  }
  for (const at::Tensor* f : flats)
    TORCH_CHECK(dtype_code(f->scalar_type()) >= 0 && f->device() == first.device() &&
                    f->dim() == 1 && f->is_contiguous() && f->numel() == total,
                op, ": flat buffers must be contiguous 1-D, kernel dtypes, sized to params");
}

// One kernel call's worth of parameters: same dtype, contiguous pointers.
struct Group {
  int dtype = -1;
  std::vector<void*> ptrs;
  std::vector<int64_t> numels, offsets;
};

// Groups the parameters by dtype. For an op that reads them (`writes` false) a
// non-contiguous parameter is read from a contiguous copy; for one that writes them, the
// kernel writes a contiguous temporary that is copied back by finish_writes().
struct Plan {
  Group groups[3];
  std::vector<at::Tensor> keep;                                // contiguous copies
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (param, temporary)

  // writes: the kernel writes the parameters; reads_too: it reads them first as well, so
  // a non-contiguous one's temporary starts with its values
  Plan(const std::vector<at::Tensor>& params, bool writes, bool reads_too = false) {
    int64_t off = 0;
    for (const at::Tensor& p : params) {
      const int64_t n = p.numel();
      if (n > 0) {
        at::Tensor src = p;
        if (!p.is_contiguous()) {
          if (writes) {
            src = reads_too ? p.contiguous()
                            : at::empty(p.sizes(),
                                        p.options().memory_format(at::MemoryFormat::Contiguous));
            write_back.emplace_back(p, src);
          } else {
            src = p.contiguous();
            keep.push_back(src);
          }
        }
        Group& g = groups[dtype_code(p.scalar_type())];
        g.dtype = dtype_code(p.scalar_type());
        g.ptrs.push_back(src.data_ptr());
        g.numels.push_back(n);
        g.offsets.push_back(off);
      }
      off += n;
    }
  }

  void finish_writes(const std::vector<at::Tensor>& params) {
    for (auto& [p, tmp] : write_back) p.copy_(tmp);
    for (const at::Tensor& p : params)
      if (p.numel() > 0) p.unsafeGetTensorImpl()->bump_version();
  }
};

void bump(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

// Runs `cpu(group, threads)` or `cuda(group, stream)` for each non-empty group.
template <class Cpu, class Cuda>
void run_groups(const char* op, const at::Tensor& flat, Plan& plan, const Cpu& cpu,
                const Cuda& cuda) {
  if (flat.is_cpu()) {
    const int threads = at::get_num_threads();
    for (Group& g : plan.groups) {
      if (g.ptrs.empty()) continue;
      const int rc = cpu(g, threads);
      TORCH_CHECK(rc == 0, op, ": CPU kernel failed with code ", rc);
    }
    return;
  }
#ifdef DAH_WITH_CUDA
  const c10::cuda::CUDAGuard guard(flat.device());
  void* stream = at::cuda::getCurrentCUDAStream(flat.device().index()).stream();
  for (Group& g : plan.groups) {
    if (g.ptrs.empty()) continue;
    const int rc = cuda(g, stream);
    TORCH_CHECK(rc == 0, op, ": CUDA kernel failed: ", dah_cuda_error_string(rc));
  }
#else
  (void)cuda;
  TORCH_CHECK(false, op, ": built without CUDA");
#endif
}

void flatten(const std::vector<at::Tensor>& params, const at::Tensor& out,
             std::optional<double> scale) {
  check_args("flatten", params, {&out});
  Plan plan(params, /*writes=*/false);
  const int has_scale = scale.has_value() ? 1 : 0;
  // like Tensor.mul_(python_float) on float32: the scalar is rounded to float first
  const float s = scale.has_value() ? static_cast<float>(*scale) : 1.0f;
  const int od = dtype_code(out.scalar_type());
  void* o = out.data_ptr();
  run_groups(
      "flatten", out, plan,
      [&](Group& g, int threads) {
        return dah_flatten_cpu(const_cast<const void* const*>(g.ptrs.data()), g.numels.data(),
                               g.offsets.data(), static_cast<int64_t>(g.ptrs.size()), g.dtype,
                               o, od, has_scale, s, threads);
      },
      [&](Group& g, void* stream) {
        return dah_flatten_cuda(const_cast<const void* const*>(g.ptrs.data()),
                                g.numels.data(), g.offsets.data(),
                                static_cast<int64_t>(g.ptrs.size()), g.dtype, o, od, has_scale,
                                s, stream);
      });
  bump(out);
}

void unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& params) {
  check_args("unflatten_", params, {&flat});
  Plan plan(params, /*writes=*/true);
  const int fd = dtype_code(flat.scalar_type());
  const void* f = flat.data_ptr();
  run_groups(
      "unflatten_", flat, plan,
      [&](Group& g, int threads) {
        return dah_unflatten_cpu(f, fd, g.ptrs.data(), g.numels.data(), g.offsets.data(),
                                 static_cast<int64_t>(g.ptrs.size()), g.dtype, threads);
      },
      [&](Group& g, void* stream) {
        return dah_unflatten_cuda(f, fd, g.ptrs.data(), g.numels.data(), g.offsets.data(),
                                  static_cast<int64_t>(g.ptrs.size()), g.dtype, stream);
      });
  plan.finish_writes(params);
}

void delta(const at::Tensor& anchor, const std::vector<at::Tensor>& params,
           const at::Tensor& out, double scale) {
  check_args("delta", params, {&out, &anchor});
  Plan plan(params, /*writes=*/false);
  const float s = static_cast<float>(scale);
  const int ad = dtype_code(anchor.scalar_type()), od = dtype_code(out.scalar_type());
  const void* a = anchor.data_ptr();
  void* o = out.data_ptr();
  run_groups(
      "delta", out, plan,
      [&](Group& g, int threads) {
        return dah_delta_cpu(a, ad, const_cast<const void* const*>(g.ptrs.data()),
                             g.numels.data(), g.offsets.data(),
                             static_cast<int64_t>(g.ptrs.size()), g.dtype, o, od, s, threads);
      },
      [&](Group& g, void* stream) {
        return dah_delta_cuda(a, ad, const_cast<const void* const*>(g.ptrs.data()),
                              g.numels.data(), g.offsets.data(),
                              static_cast<int64_t>(g.ptrs.size()), g.dtype, o, od, s, stream);
      });
  bump(out);
}

void apply(const at::Tensor& flat, const std::vector<at::Tensor>& params,
           const std::optional<at::Tensor>& anchor) {
  if (anchor.has_value()) {
    check_args("apply_", params, {&flat, &*anchor});
    for (const at::Tensor& p : params)
      TORCH_CHECK(p.scalar_type() == anchor->scalar_type(),
                  "apply_: the anchor must have the parameters' dtype");
  } else {
    check_args("apply_", params, {&flat});
  }
  Plan plan(params, /*writes=*/true);
  const int fd = dtype_code(flat.scalar_type());
  const void* f = flat.data_ptr();
  void* an = anchor.has_value() ? anchor->data_ptr() : nullptr;
  run_groups(
      "apply_", flat, plan,
      [&](Group& g, int threads) {
        return dah_apply_cpu(f, fd, g.ptrs.data(), g.numels.data(), g.offsets.data(),
                             static_cast<int64_t>(g.ptrs.size()), g.dtype, an, threads);
      },
      [&](Group& g, void* stream) {
        return dah_apply_cuda(f, fd, g.ptrs.data(), g.numels.data(), g.offsets.data(),
                              static_cast<int64_t>(g.ptrs.size()), g.dtype, an, stream);
      });
  plan.finish_writes(params);
  if (anchor.has_value()) bump(*anchor);
}

// ---- error feedback: the anchor has the parameters' dtype (ops.py routes only those) ----

void check_anchor_dtype(const char* op, const at::Tensor& anchor,
                        const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params)
    TORCH_CHECK(p.scalar_type() == anchor.scalar_type(), op,
                ": the anchor must have the parameters' dtype");
}

void feedback_cast(const at::Tensor& anchor, const std::vector<at::Tensor>& params,
                   const at::Tensor& residual, const at::Tensor& out, double scale) {
  check_args("feedback_cast", params, {&out, &anchor, &residual});
  check_anchor_dtype("feedback_cast", anchor, params);
  Plan plan(params, /*writes=*/false);
  const float s = static_cast<float>(scale);
  const int rd = dtype_code(residual.scalar_type()), od = dtype_code(out.scalar_type());
  const void* a = anchor.data_ptr();
  void* r = residual.data_ptr();
  void* o = out.data_ptr();
  run_groups(
      "feedback_cast", out, plan,
      [&](Group& g, int threads) {
        return dah_feedback_cast_cpu(a, const_cast<const void* const*>(g.ptrs.data()),
                                     g.numels.data(), g.offsets.data(),
                                     static_cast<int64_t>(g.ptrs.size()), g.dtype, r, rd, o, od,
                                     s, threads);
      },
      [&](Group& g, void* stream) {
        return dah_feedback_cast_cuda(a, const_cast<const void* const*>(g.ptrs.data()),
                                      g.numels.data(), g.offsets.data(),
                                      static_cast<int64_t>(g.ptrs.size()), g.dtype, r, rd, o,
                                      od, s, stream);
      });
  bump(out);
  bump(residual);
}

void apply_delta(const at::Tensor& anchor, const at::Tensor& change,
                 const std::vector<at::Tensor>& params) {
  check_args("apply_delta_", params, {&change, &anchor});
  check_anchor_dtype("apply_delta_", anchor, params);
  Plan plan(params, /*writes=*/true);
  const int cd = dtype_code(change.scalar_type());
  void* a = anchor.data_ptr();
  const void* c = change.data_ptr();
  run_groups(
      "apply_delta_", change, plan,
      [&](Group& g, int threads) {
        return dah_apply_delta_cpu(a, c, cd, g.ptrs.data(), g.numels.data(), g.offsets.data(),
                                   static_cast<int64_t>(g.ptrs.size()), g.dtype, threads);
      },
      [&](Group& g, void* stream) {
        return dah_apply_delta_cuda(a, c, cd, g.ptrs.data(), g.numels.data(), g.offsets.data(),
                                    static_cast<int64_t>(g.ptrs.size()), g.dtype, stream);
      });
  plan.finish_writes(params);
  bump(anchor);
}

void apply_progress(const at::Tensor& values, const at::Tensor& launch,
                    const std::vector<at::Tensor>& params,
                    const std::optional<at::Tensor>& anchor) {
  if (anchor.has_value()) {
    check_args("apply_progress_", params, {&values, &launch, &*anchor});
    check_anchor_dtype("apply_progress_", *anchor, params);
  } else {
    check_args("apply_progress_", params, {&values, &launch});
  }
  check_anchor_dtype("apply_progress_", launch, params);
  Plan plan(params, /*writes=*/true, /*reads_too=*/true);
  const int vd = dtype_code(values.scalar_type());
  const void* v = values.data_ptr();
  const void* l = launch.data_ptr();
  void* a = anchor.has_value() ? anchor->data_ptr() : nullptr;
  run_groups(
      "apply_progress_", values, plan,
      [&](Group& g, int threads) {
        return dah_apply_progress_cpu(v, vd, l, g.ptrs.data(), g.numels.data(),
                                      g.offsets.data(), static_cast<int64_t>(g.ptrs.size()),
                                      g.dtype, a, threads);
      },
      [&](Group& g, void* stream) {
        return dah_apply_progress_cuda(v, vd, l, g.ptrs.data(), g.numels.data(),
                                       g.offsets.data(), static_cast<int64_t>(g.ptrs.size()),
                                       g.dtype, a, stream);
      });
  plan.finish_writes(params);
  if (anchor.has_value()) bump(*anchor);
}

// ---- blockwise quantization: float32 values, a uint8 payload (see kernels.h) ----

void check_values(const char* op, const at::Tensor& t, const at::Tensor& packed) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous() &&
                  t.device() == packed.device(),
              op, ": values must be contiguous 1-D float32 on the payload's device");
}

void check_payload(const char* op, const at::Tensor& packed, int64_t pieces, int64_t piece_bytes) {
  TORCH_CHECK(kernel_device(packed.device()), op, ": device not supported by the kernels");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() == pieces * piece_bytes,
              op, ": packed must be contiguous 1-D uint8 of pieces * piece_bytes bytes");
}

const float* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// Runs `cpu(threads)` or `cuda(stream)` on the payload's device; rc 0 is success.
template <class Cpu, class Cuda>
void run_on(const char* op, const at::Tensor& packed, const Cpu& cpu, const Cuda& cuda) {
  if (packed.is_cpu()) {
    const int rc = cpu(at::get_num_threads());
    TORCH_CHECK(rc == 0, op, ": CPU kernel failed with code ", rc, " (bad layout or sizes)");
    return;
  }
#ifdef DAH_WITH_CUDA
  const c10::cuda::CUDAGuard guard(packed.device());
  const int rc = cuda(at::cuda::getCurrentCUDAStream(packed.device().index()).stream());
  TORCH_CHECK(rc == 0, op, ": CUDA kernel failed: ", dah_cuda_error_string(rc));
#else
  (void)cuda;
  TORCH_CHECK(false, op, ": built without CUDA");
#endif
}

void quantize_blocks(const at::Tensor& x, const std::optional<at::Tensor>& e_in,
                     const at::Tensor& packed, const std::optional<at::Tensor>& e_out,
                     int64_t bits, int64_t block, int64_t pieces, int64_t piece_elems,
                     int64_t piece_bytes, const std::optional<at::Tensor>& minus, double scale) {
  const char* op = "quantize_blocks";
  check_payload(op, packed, pieces, piece_bytes);
  check_values(op, x, packed);
  for (const auto* e : {&e_in, &e_out, &minus})
    if (e->has_value()) {
      check_values(op, **e, packed);
      TORCH_CHECK((*e)->numel() == x.numel(), op, ": residuals and minus must have x's size");
    }
  const float* xp = x.data_ptr<float>();
  const float* mp = ptr_or_null(minus);
  const float sc = static_cast<float>(scale);
  const float* ep = ptr_or_null(e_in);
  float* eo = e_out.has_value() ? e_out->data_ptr<float>() : nullptr;
  uint8_t* pk = packed.data_ptr<uint8_t>();
  const int b = static_cast<int>(bits);
  run_on(
      op, packed,
      [&](int threads) {
        return dah_quantize_cpu(xp, mp, sc, ep, x.numel(), b, block, pieces, piece_elems,
                                piece_bytes, pk, eo, threads);
      },
      [&](void* stream) {
        return dah_quantize_cuda(xp, mp, sc, ep, x.numel(), b, block, pieces, piece_elems,
                                 piece_bytes, pk, eo, stream);
      });
  bump(packed);
  if (e_out.has_value()) bump(*e_out);
}

void dequantize_blocks(const at::Tensor& packed, const std::optional<at::Tensor>& base,
                       const at::Tensor& out, int64_t bits, int64_t block, int64_t pieces,
                       int64_t piece_elems, int64_t piece_bytes, bool sum_pieces) {
  const char* op = "dequantize_blocks";
  check_payload(op, packed, pieces, piece_bytes);
  check_values(op, out, packed);
  if (base.has_value()) {
    check_values(op, *base, packed);
    TORCH_CHECK(base->numel() == out.numel(), op, ": base must have out's size");
  }
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const float* bp = ptr_or_null(base);
  float* op_ = out.data_ptr<float>();
  const int b = static_cast<int>(bits), sp = sum_pieces ? 1 : 0;
  run_on(
      op, packed,
      [&](int threads) {
        return dah_dequantize_cpu(pk, b, block, pieces, piece_elems, piece_bytes, bp, op_,
                                  out.numel(), sp, threads);
      },
      [&](void* stream) {
        return dah_dequantize_cuda(pk, b, block, pieces, piece_elems, piece_bytes, bp, op_,
                                   out.numel(), sp, stream);
      });
  bump(out);
}

bool with_cuda() {
#ifdef DAH_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddp_avg_hooks fused bucket copies, unvalidated: call them through ddp_avg_hooks.ops";
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("flatten", &flatten, "out <- cat(params) * scale, cast",
        py::arg("params"), py::arg("out"), py::arg("scale") = py::none(), release());
  m.def("unflatten_", &unflatten, "params <- flat, cast",
        py::arg("flat"), py::arg("params"), release());
  m.def("delta", &delta, "out <- (anchor - cat(params)) * scale, cast",
        py::arg("anchor"), py::arg("params"), py::arg("out"), py::arg("scale") = 1.0,
        release());
  m.def("apply_", &apply, "params <- flat, anchor <- params",
        py::arg("flat"), py::arg("params"), py::arg("anchor") = py::none(), release());
  m.def("feedback_cast", &feedback_cast,
        "x = (anchor - cat(params)) * scale + residual; out <- x, residual <- x - out, cast",
        py::arg("anchor"), py::arg("params"), py::arg("residual"), py::arg("out"),
        py::arg("scale") = 1.0, release());
  m.def("apply_delta_", &apply_delta, "params <- anchor - change, anchor <- params",
        py::arg("anchor"), py::arg("change"), py::arg("params"), release());
  m.def("apply_progress_", &apply_progress,
        "params <- params + (values - launch), anchor <- values (an overlapped round)",
        py::arg("values"), py::arg("launch"), py::arg("params"), py::arg("anchor") = py::none(),
        release());
  m.def("quantize_blocks", &quantize_blocks,
        "blockwise quantization of x, or of (x - minus) * scale, (+ e_in) into packed; "
        "e_out <- what it lost",
        py::arg("x"), py::arg("e_in"), py::arg("packed"), py::arg("e_out"), py::arg("bits"),
        py::arg("block"), py::arg("pieces"), py::arg("piece_elems"), py::arg("piece_bytes"),
        py::arg("minus") = py::none(), py::arg("scale") = 1.0, release());
  m.def("dequantize_blocks", &dequantize_blocks,
        "out <- the payload's values (base - them), or the sum of its pieces",
        py::arg("packed"), py::arg("base"), py::arg("out"), py::arg("bits"), py::arg("block"),
        py::arg("pieces"), py::arg("piece_elems"), py::arg("piece_bytes"),
        py::arg("sum_pieces"), release());
  m.def("with_cuda", &with_cuda, "whether the CUDA kernels were compiled in");
  m.def("_cpu_simd", &dah_cpu_simd, "CPU vector bodies: 1 on, 0 off, -1 query (tests only)",
        py::arg("mode") = -1);
}
