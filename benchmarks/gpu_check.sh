#!/usr/bin/env bash
# GPU check for the fused ops: run from anywhere on a machine with an NVIDIA GPU.
#
#   bash benchmarks/gpu_check.sh            # or: PY=/path/to/python bash benchmarks/gpu_check.sh
#
# Needs a CUDA build of torch (the Makefile's default venv has the CPU wheel; install one
# with e.g. `make TORCH_SPEC='torch==2.13.0+cu128' install`) and a CUDA toolkit whose
# major version matches torch.version.cuda (CUDA_HOME, else /usr/local/cuda).
# Steps, each printed with a "==" line:
#   1. environment (GPU, torch, nvcc)
#   2. `nvcc -c csrc/kernels_cuda.cu` alone
#   3. JIT build of the extension with CUDA, for this GPU's compute capability only
#   4. the CUDA tests of tests/test_ops.py and tests/test_feedback_ops.py (CPU ones too)
#   5. benchmarks/bench_ops.py --device cuda: GB/s of every op vs the device's copy_
#   6. benchmarks/bench_memory.py --device cuda: peak extra device memory of each hook
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
if [[ -z "${CUDA_HOME:-}" && -d /usr/local/cuda ]]; then export CUDA_HOME=/usr/local/cuda; fi
export PATH="${CUDA_HOME:+$CUDA_HOME/bin:}$PATH"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

echo "== 1. environment"
nvidia-smi -L || true
"$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit("torch sees no GPU (CPU wheel of torch, or no driver): install a CUDA build of torch")
print("device", torch.cuda.get_device_name(), "| capability %d.%d" % torch.cuda.get_device_capability())
EOF
command -v nvcc && nvcc --version | tail -1
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  export TORCH_CUDA_ARCH_LIST  # build for this GPU only: a shorter compile
fi
echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST CUDA_HOME=${CUDA_HOME:-unset}"

echo "== 2. nvcc -c csrc/kernels_cuda.cu (CUDA headers only)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
time nvcc -std=c++17 -c csrc/kernels_cuda.cu -o "$tmp/kernels_cuda.o"

echo "== 3. extension build with CUDA"
time DDP_AVG_HOOKS_VERBOSE_BUILD=${DDP_AVG_HOOKS_VERBOSE_BUILD:-0} "$PY" - <<'EOF'
import warnings
warnings.simplefilter("error")  # a failed build must fail this script, not fall back
from ddp_avg_hooks import _ext, ops
m = _ext.load_extension()
assert m is not None and m.with_cuda(), "extension loaded without CUDA kernels"
print("backend:", ops.backend(), "| module:", m.__file__)
EOF

echo "== 4. tests (CUDA and CPU)"
"$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_feedback_ops.py -k "cuda or compile"
"$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py -k "not cuda and not compile" -x

echo "== 5. benchmark on the GPU (GB/s vs copy_ of the same number of fp32 elements)"
"$PY" benchmarks/bench_ops.py --device cuda --min-run-time 0.5

echo "== 6. device memory of each hook on the GPU (offload_state=True: <= 0.1x the model is the target; a round needs about 2 buckets, 50 MiB, of the 1 GiB model)"
"$PY" benchmarks/bench_memory.py --device cuda --mb 1024 \
  --variants allreduce,zero_copy,fp16,fp16_offload,diloco_fp16_offload
