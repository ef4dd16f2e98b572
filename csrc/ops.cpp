// Torch binding of the ddp_avg_hooks kernels: the only source file that includes torch.
//
// Each op checks its arguments exactly as ddp_avg_hooks/_fallback.py does, in the same
// order and with the same exception types (ValueError for sizes, layout and devices,
// TypeError for dtypes), then returns:
//   true   the op ran (CPU, or CUDA when built with DAH_WITH_CUDA);
//   false  nothing was written: a float64 tensor or another device is involved, and
//          the caller (ops.py) runs the fallback instead.
// Parameters are grouped by dtype (one kernel call per group). Non-contiguous
// parameters (channels_last, strided views) go through a contiguous temporary.
// All bindings release the GIL.

#include <torch/extension.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "kernels.h"

#ifdef DAH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

std::string dtype_name(const at::Tensor& t) {
  return std::string("torch.") + std::string(c10::getDtypeNames(t.scalar_type()).first);
}

std::string tuple_str(at::IntArrayRef v) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << (v.size() == 1 ? ",)" : ")");
  return s.str();
}

bool known_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DAH_FLOAT32;
    case at::kHalf: return DAH_FLOAT16;
    case at::kBFloat16: return DAH_BFLOAT16;
    default: return -1;  // float64: handled by the fallback
  }
}

void check_dtype(const at::Tensor& t, const std::string& what, const char* op) {
  TORCH_CHECK_TYPE(known_dtype(t.scalar_type()), op, ": ", what, " has dtype ", dtype_name(t),
                   "; supported dtypes are float32, float16, bfloat16 and float64");
}

// The checks every op shares (_fallback._check_flat): a contiguous 1-D buffer that
// fits the parameters exactly, all on its device.
void check_flat(const at::Tensor& flat, const std::vector<at::Tensor>& params,
                const char* what, const char* op) {
  check_dtype(flat, what, op);
  TORCH_CHECK_VALUE(flat.dim() == 1 && flat.is_contiguous(), op, ": ", what,
                    " must be a contiguous 1-D tensor, got shape ", tuple_str(flat.sizes()),
                    " with strides ", tuple_str(flat.strides()));
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    check_dtype(p, "params[" + std::to_string(i) + "]", op);
    TORCH_CHECK_VALUE(p.device() == flat.device(), op, ": params[", i, "] is on ", p.device(),
                      " but ", what, " is on ", flat.device(),
                      "; put all tensors of one call on one device");
    total += p.numel();
  }
  TORCH_CHECK_VALUE(total == flat.numel(), op, ": ", what, " has ", flat.numel(),
                    " elements but the parameters hold ", total,
                    "; the buffer must have exactly sum(p.numel() for p in params) elements");
}

// Whether the kernels can run this call: no float64 and a device we were built for.
bool runnable(const at::Tensor& flat, const std::vector<at::Tensor>& params,
              std::initializer_list<const at::Tensor*> others = {}) {
  if (dtype_code(flat.scalar_type()) < 0) return false;
  for (const at::Tensor* t : others)
    if (dtype_code(t->scalar_type()) < 0) return false;
  for (const at::Tensor& p : params)
    if (dtype_code(p.scalar_type()) < 0) return false;
  if (flat.is_cpu()) return true;
#ifdef DAH_WITH_CUDA
  if (flat.is_cuda()) return true;
#endif
  return false;
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

  Plan(const std::vector<at::Tensor>& params, bool writes) {
    int64_t off = 0;
    for (const at::Tensor& p : params) {
      const int64_t n = p.numel();
      if (n > 0) {
        at::Tensor src = p;
        if (!p.is_contiguous()) {
          if (writes) {
            src = at::empty(p.sizes(), p.options().memory_format(at::MemoryFormat::Contiguous));
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

bool flatten(const std::vector<at::Tensor>& params, const at::Tensor& out,
             std::optional<double> scale) {
  check_flat(out, params, "out", "flatten");
  if (!runnable(out, params)) return false;
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
  return true;
}

bool unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& params) {
  check_flat(flat, params, "flat", "unflatten_");
  if (!runnable(flat, params)) return false;
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
  return true;
}

bool delta(const at::Tensor& anchor, const std::vector<at::Tensor>& params,
           const at::Tensor& out, double scale) {
  check_flat(anchor, params, "anchor", "delta");
  check_flat(out, params, "out", "delta");
  if (!runnable(out, params, {&anchor})) return false;
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
  return true;
}

bool apply(const at::Tensor& flat, const std::vector<at::Tensor>& params,
           const std::optional<at::Tensor>& anchor) {
  check_flat(flat, params, "flat", "apply_");
  if (anchor.has_value()) {
    check_flat(*anchor, params, "anchor", "apply_");
    for (size_t i = 0; i < params.size(); ++i)
      TORCH_CHECK_TYPE(params[i].scalar_type() == anchor->scalar_type(),
                       "apply_: anchor has dtype ", dtype_name(*anchor), " but params[", i,
                       "] has ", dtype_name(params[i]),
                       "; the anchor must have the parameters' dtype");
  }
  if (anchor.has_value() ? !runnable(flat, params, {&*anchor}) : !runnable(flat, params))
    return false;
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
  return true;
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
  m.doc() = "ddp_avg_hooks fused bucket copies; see ddp_avg_hooks/_fallback.py for semantics";
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("flatten", &flatten, "out <- cat(params) * scale, cast; False: use the fallback",
        py::arg("params"), py::arg("out"), py::arg("scale") = py::none(), release());
  m.def("unflatten_", &unflatten, "params <- flat, cast; False: use the fallback",
        py::arg("flat"), py::arg("params"), release());
  m.def("delta", &delta, "out <- (anchor - cat(params)) * scale, cast; False: use the fallback",
        py::arg("anchor"), py::arg("params"), py::arg("out"), py::arg("scale") = 1.0,
        release());
  m.def("apply_", &apply, "params <- flat, anchor <- params; False: use the fallback",
        py::arg("flat"), py::arg("params"), py::arg("anchor") = py::none(), release());
  m.def("with_cuda", &with_cuda, "whether the CUDA kernels were compiled in");
  m.def("_cpu_simd", &dah_cpu_simd, "CPU vector bodies: 1 on, 0 off, -1 query (tests only)",
        py::arg("mode") = -1);
}
