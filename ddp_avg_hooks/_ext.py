"""Find, build or load the C++/CUDA extension (``csrc/``); ``None`` when it can't be had.

:func:`load_extension` is called lazily by ``ops`` (first op call or ``ops.backend()``),
never when the package is imported. In order:

1. ``DDP_AVG_HOOKS_DISABLE_EXT=1`` (any value but ``""``/``"0"``): return ``None``.
2. A prebuilt ``ddp_avg_hooks._C`` module, if one is installed.
3. A JIT build with ``torch.utils.cpp_extension.load`` from the sources in
   ``ddp_avg_hooks/csrc`` (a symlink to the repository's ``csrc/``, so editable installs
   and wheels both find them). The CUDA kernels are compiled in only when
   ``torch.cuda.is_available()`` and a CUDA toolkit (``CUDA_HOME``) is found.

   The build lives in ``$TORCH_EXTENSIONS_DIR`` (else torch's default cache) under a
   folder keyed by Python version, torch version and build, accelerator, machine type
   and where the package is installed, so ABI-incompatible builds never share a folder
   and two environments never rebuild each other's. Before a first build, rank 0 says
   so on stderr. The build runs the ``ninja`` of the ``ninja`` package (a dependency,
   installed beside this package) whichever ``ninja`` ``PATH`` finds first: another
   version reads the build's log as changed commands and rebuilds everything, so an
   activated and a not-activated environment would rebuild each other's extension.
   ``make ext`` fills it once;
   later processes only load it (ninja finds nothing to do, ~0.1 s). When several
   processes (DDP ranks) load at once, one builds while the others wait for it, under
   an ``flock`` on ``ddp_avg_hooks.flock`` in the build folder: the kernel drops that
   lock when its holder dies, so a build killed midway (Ctrl-C, a SIGKILLed rank)
   never leaves the next job waiting. Whoever holds it also removes the ``lock`` file
   torch's own ``FileBaton`` may have left behind after such a kill (torch waits on that
   file forever). A process that waits over ``DDP_AVG_HOOKS_BUILD_TIMEOUT`` seconds
   (600 by default) for another's build gives up, with the warning below.

Any failure is reported once with ``warnings.warn`` (the reason included) and gives
``None``, so ``ops`` falls back to the pure-PyTorch ops.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import contextlib
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

ENV_DISABLE = "DDP_AVG_HOOKS_DISABLE_EXT"
ENV_BUILD_TIMEOUT = "DDP_AVG_HOOKS_BUILD_TIMEOUT"
BUILD_LOCK = "ddp_avg_hooks.flock"
_NAME = "ddp_avg_hooks_C"
_PREBUILT = "ddp_avg_hooks._C"  # a module a packaged build may ship
_CPP_SOURCES = ("ops.cpp", "kernels_cpu.cpp", "feedback_cpu.cpp", "quantize_cpu.cpp")
_CUDA_SOURCES = ("kernels_cuda.cu", "quantize_cuda.cu")


def disabled() -> bool:
    """Whether ``DDP_AVG_HOOKS_DISABLE_EXT`` asks for the fallback."""
    return os.environ.get(ENV_DISABLE, "") not in ("", "0")


def source_dir() -> Path:
    """The folder holding ``ops.cpp`` and the kernels."""
    here = Path(__file__).resolve().parent
    for cand in (here / "csrc", here.parent / "csrc"):
        if (cand / "ops.cpp").is_file():
            return cand
    raise FileNotFoundError(f"csrc/ops.cpp not found under {here} or {here.parent}")


def _want_cuda() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.cuda.is_available() and CUDA_HOME is not None


def build_directory(with_cuda: bool) -> Path:
    """Where the JIT build of this Python, torch and accelerator goes."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    if torch.version.cuda is not None:
        accel = "cu" + torch.version.cuda.replace(".", "")
    elif torch.version.hip is not None:
        accel = "rocm" + torch.version.hip.replace(".", "")
    else:
        accel = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    torch_tag = torch.__version__.replace("+", "_")
    # where the sources are installed: two environments sharing the cache never rebuild
    # each other's extension
    where = hashlib.sha256(str(source_dir()).encode()).hexdigest()[:10]
    key = f"{py}_{accel}_torch{torch_tag}_{platform.machine()}_{where}"
    return Path(root) / key / (_NAME + ("_cuda" if with_cuda else ""))


def ninja_program() -> str | None:
    """The ``ninja`` executable builds use: the ``ninja`` package's, else ``PATH``'s."""
    try:
        import ninja
    except ImportError:
        return shutil.which("ninja")
    found = shutil.which("ninja", path=getattr(ninja, "BIN_DIR", ""))
    return found or shutil.which("ninja")


@contextlib.contextmanager
def _ninja_first_on_path() -> Iterator[None]:
    """Put :func:`ninja_program`'s folder first on ``PATH`` (torch runs ``ninja`` from it)."""
    program = ninja_program()
    before = os.environ.get("PATH")
    if program is not None:
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(program), before or os.defpath])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _is_rank_zero() -> bool:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _announce_build(build_dir: Path) -> None:
    """Say on rank 0, before a first build in ``build_dir``, what happens and how to avoid it."""
    if any(build_dir.glob("*.so")) or not _is_rank_zero():
        return
    sys.stderr.write(
        f"ddp_avg_hooks: building the C++ extension in {build_dir} (about a minute, once per "
        "install and torch version; the other ranks wait for it). Prebuild it with "
        "`python -c 'from ddp_avg_hooks import ops; ops.backend()'`, or set "
        f"{ENV_DISABLE}=1 to use the pure-PyTorch ops.\n"
    )
    sys.stderr.flush()


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the build folder's lock: one process builds or loads there at a time.

    An ``flock`` on ``build_dir / BUILD_LOCK``, which the kernel releases when its holder
    exits, however it exits. Under it, torch's ``FileBaton`` file ``build_dir / "lock"``
    can only be one that a killed build left behind, and it is removed. Raises
    ``TimeoutError`` (naming the folder) if another process holds the lock for more
    than ``timeout_s`` seconds (``$DDP_AVG_HOOKS_BUILD_TIMEOUT``, else 600).
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get(ENV_BUILD_TIMEOUT) or 600)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's FileBaton alone
        yield
        return
    fd = os.open(build_dir / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has held the build lock {build_dir / BUILD_LOCK} "
                        f"for over {timeout_s:g} s (a build still running, or a stopped "
                        f"process); raise {ENV_BUILD_TIMEOUT} or end that process") from None
                time.sleep(0.05)
        (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
        yield
    finally:
        os.close(fd)  # releases the flock


def _jit_build(verbose: bool = False) -> ModuleType:
    from torch.utils import cpp_extension

    src = source_dir()
    with_cuda = _want_cuda()
    sources = [str(src / f) for f in _CPP_SOURCES]
    # no FMA contraction: the kernels match the PyTorch reference bit for bit
    cflags = ["-O3", "-ffp-contract=off"]
    cuda_flags = ["-O3", "--fmad=false"]
    if with_cuda:
        sources += [str(src / f) for f in _CUDA_SOURCES]
        cflags.append("-DDAH_WITH_CUDA")
        cuda_flags.append("-DDAH_WITH_CUDA")
    build_dir = build_directory(with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    _announce_build(build_dir)
    with build_lock(build_dir), _ninja_first_on_path():
        return cpp_extension.load(
            name=_NAME + ("_cuda" if with_cuda else ""),
            sources=sources,
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_flags,
            extra_include_paths=[str(src)],
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            verbose=verbose,
        )


_LOCK = threading.Lock()


def load_extension() -> ModuleType | None:
    """The compiled ops module, or ``None`` (disabled or unavailable; warns once why)."""
    with _LOCK:  # one attempt even when several threads make their first op call at once
        return _load_once()


load_extension.cache_clear = lambda: _load_once.cache_clear()  # type: ignore[attr-defined]


@functools.cache
def _load_once() -> ModuleType | None:
    if disabled():
        return None
    try:
        return importlib.import_module(_PREBUILT)
    except ImportError:
        pass
    try:
        return _jit_build(verbose=os.environ.get("DDP_AVG_HOOKS_VERBOSE_BUILD", "") == "1")
    except Exception as e:  # noqa: BLE001 - any build/load problem means "use the fallback"
        warnings.warn(
            f"ddp_avg_hooks: the C++ extension could not be built or loaded, using the "
            f"pure-PyTorch fallback ops ({type(e).__name__}: {e}). "
            f"Set {ENV_DISABLE}=1 to skip the attempt.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
