#!/usr/bin/env bash
# GPU check of the fused ops and the hooks: run from anywhere on a machine with an NVIDIA GPU.
#
#   bash benchmarks/gpu_check.sh            # or: PY=/path/to/python bash benchmarks/gpu_check.sh
#
# Needs a CUDA build of torch (the Makefile's default venv has the CPU wheel; install one
# with e.g. `make TORCH_SPEC='torch==2.13.0+cu128' install`) and a CUDA toolkit whose
# major version matches torch.version.cuda (CUDA_HOME, else /usr/local/cuda).
# Steps, each printed with a "==" line; every step runs (one that outlasts its time
# limit is stopped and counts as failed), and the script ends with the list of the
# steps that failed (exit 1 if any did):
#   1. environment (GPU, torch, nvcc)
#   2. `nvcc -c csrc/kernels_cuda.cu` alone
#   3. JIT build of the extension with CUDA, for this GPU's compute capability only
#   4. every CUDA test: the ops (tests/test_ops.py, tests/test_feedback_ops.py), the
#      buckets' write-back (tests/test_bucket.py), and 2-rank training runs of the
#      built-in hooks on the GPU against plain local SGD and the same runs on the CPU
#      (tests/test_device_training.py, its CPU cases too)
#   5. benchmarks/bench_ops.py --device cuda: GB/s of every op vs the device's copy_
#   6. benchmarks/bench_memory.py --device cuda: peak extra device memory of each hook
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
if [[ -z "${CUDA_HOME:-}" && -d /usr/local/cuda ]]; then export CUDA_HOME=/usr/local/cuda; fi
export PATH="${CUDA_HOME:+$CUDA_HOME/bin:}$PATH"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
failed=()
step() {  # step "N. title": run the rest as one command, record it if it fails
  local title=$1
  shift
  echo "== $title"
  "$@" || { echo "!! step failed: $title"; failed+=("$title"); }
}

echo "== 1. environment"
nvidia-smi -L || true
"$PY" - <<'EOF' || exit 1
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

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
step "2. nvcc -c csrc/kernels_cuda.cu (CUDA headers only)" timeout 300 \
  nvcc -std=c++17 -c csrc/kernels_cuda.cu -o "$tmp/kernels_cuda.o"

cat > "$tmp/build.py" <<'EOF'
import time, warnings
warnings.simplefilter("error")  # a failed build must fail this step, not fall back
from ddp_avg_hooks import _ext, ops
t = time.perf_counter()
m = _ext.load_extension()
assert m is not None and m.with_cuda(), "extension loaded without CUDA kernels"
print(f"backend: {ops.backend()} | module: {m.__file__} | {time.perf_counter() - t:.0f} s")
EOF
step "3. extension build with CUDA" timeout 900 env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
  DDP_AVG_HOOKS_VERBOSE_BUILD="${DDP_AVG_HOOKS_VERBOSE_BUILD:-0}" "$PY" "$tmp/build.py"

step "4. CUDA tests: ops, write-back, training runs of the hooks (and their CPU cases)" \
  timeout 900 "$PY" -m pytest -q -p no:cacheprovider -n "${GPU_CHECK_WORKERS:-4}" -rsP \
  tests/test_ops.py tests/test_feedback_ops.py tests/test_bucket.py tests/test_device_training.py \
  -k "cuda or compile or test_device_training"

step "5. benchmark on the GPU (GB/s vs copy_ of the same number of fp32 elements)" \
  timeout 600 "$PY" benchmarks/bench_ops.py --device cuda --min-run-time 0.5

step "6. device memory of each hook on the GPU (offload_state=True: <= 0.1x the model is the target; a round needs about 2 buckets, 50 MiB, of the 1 GiB model)" \
  timeout 900 "$PY" benchmarks/bench_memory.py --device cuda --mb 1024 \
  --variants allreduce,zero_copy,fp16,fp16_offload,diloco_fp16_offload

if ((${#failed[@]})); then
  echo "== failed: ${#failed[@]} step(s)"
  printf '   %s\n' "${failed[@]}"
  exit 1
fi
echo "== every step passed"
