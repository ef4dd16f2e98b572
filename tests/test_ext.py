"""Finding, building and loading the extension: cache keys, the first-build notice, failures."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ddp_avg_hooks import _ext

REPO = Path(__file__).resolve().parent.parent


def test_failed_build_warns_once(monkeypatch):
    def boom(verbose=False):
        raise RuntimeError("no compiler here")

    monkeypatch.delenv(_ext.ENV_DISABLE, raising=False)
    monkeypatch.setattr(_ext, "_jit_build", boom)
    monkeypatch.setattr(_ext, "_PREBUILT", "ddp_avg_hooks._no_such_module")
    _ext.load_extension.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no compiler here"):
            assert _ext.load_extension() is None
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _ext.load_extension() is None  # cached: no second warning
    finally:
        _ext.load_extension.cache_clear()


def test_sources_found():
    src = _ext.source_dir()
    names = {f.name for f in src.iterdir()}
    assert {"kernels.h", "dtypes.h", "cpu_loops.h", "ops.cpp", "kernels_cpu.cpp",
            "feedback_cpu.cpp", "kernels_cuda.cu"} <= names
    assert set(_ext._CPP_SOURCES) | set(_ext._CUDA_SOURCES) <= names


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("source", ["kernels_cuda.cu", "quantize_cuda.cu"])
def test_cuda_kernels_compile_alone(tmp_path, source):
    """The CUDA sources need only the CUDA headers: plain `nvcc -c` compiles them
    (without optimization: the check is that they compile, and it takes half the time)."""
    r = subprocess.run(
        ["nvcc", "-std=c++17", "-Xcicc", "-O0", "-Xptxas", "-O0", "-c",
         str(REPO / "csrc" / source), "-o", str(tmp_path / "k.o")],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]


def test_build_folder_is_keyed_by_install_location_and_torch(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = _ext.build_directory(with_cuda=False)
    monkeypatch.setattr(_ext, "source_dir", lambda: tmp_path / "other-env" / "csrc")
    elsewhere = _ext.build_directory(with_cuda=False)
    assert here != elsewhere and here.parent.parent == elsewhere.parent.parent == tmp_path
    assert torch.__version__.replace("+", "_") in here.parent.name
    assert _ext.build_directory(with_cuda=True).name.endswith("_cuda")


def _fake_build(monkeypatch, tmp_path, rank: str):
    """A _jit_build whose compiler is a stub: records the call, writes nothing."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(_ext, "_want_cuda", lambda: False)
    calls = []
    monkeypatch.setattr(cpp_extension, "load",
                        lambda **kw: calls.append(kw) or types.ModuleType("fake"))
    return calls


def test_first_build_is_announced_on_rank_zero_only(monkeypatch, tmp_path, capsys):
    calls = _fake_build(monkeypatch, tmp_path / "a", rank="0")
    _ext._jit_build()
    assert "building the C++ extension" in capsys.readouterr().err and len(calls) == 1
    calls = _fake_build(monkeypatch, tmp_path / "b", rank="1")
    _ext._jit_build()
    assert capsys.readouterr().err == "" and len(calls) == 1


def test_no_notice_when_the_build_exists(monkeypatch, tmp_path, capsys):
    _fake_build(monkeypatch, tmp_path, rank="0")
    folder = _ext.build_directory(with_cuda=False)
    folder.mkdir(parents=True)
    (folder / "ddp_avg_hooks_C.so").write_bytes(b"")
    _ext._jit_build()
    assert capsys.readouterr().err == ""


def test_a_process_finding_another_ninja_first_loads_the_build_without_running_it(tmp_path):
    """Two ninja versions read each other's build log as changed commands and rebuild
    everything: every process runs the ``ninja`` package's, whatever PATH finds first."""
    assert _ext.ninja_program() is not None
    library = _ext.build_directory(with_cuda=False) / "ddp_avg_hooks_C.so"
    built_at = library.stat().st_mtime_ns if library.exists() else None
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ninja").write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DDP_AVG_HOOKS_DISABLE_EXT", None)
    code = "from ddp_avg_hooks import ops; print(ops.backend())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.split() == ["extension"], r.stderr[-3000:]
    assert not (tmp_path / "ran").exists()
    if built_at is not None:  # found up to date: loaded, not rebuilt
        assert library.stat().st_mtime_ns == built_at


def _copy_of_the_build(tmp_path) -> tuple[Path, dict]:
    """The build folder copied under a fresh ``TORCH_EXTENSIONS_DIR`` (ninja finds it up
    to date there: loading it takes a fraction of a second), and an environment using it."""
    built = _ext.build_directory(with_cuda=False)
    root = tmp_path / "extensions"
    copy = root / built.parent.name / built.name
    if built.is_dir():
        shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", _ext.BUILD_LOCK))
    else:
        copy.mkdir(parents=True)  # nothing built yet: the load below builds it
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    env.pop(_ext.ENV_DISABLE, None)
    return copy, env


def _backend_in_a_new_process(env: dict) -> subprocess.CompletedProcess:
    code = "from ddp_avg_hooks import ops; print(ops.backend())"
    return subprocess.run([sys.executable, "-W", "always", "-c", code], env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_lock_file_a_killed_build_left_behind_does_not_hold_up_the_next_load(tmp_path):
    """torch's FileBaton waits forever on a ``lock`` file whose build was killed."""
    folder, env = _copy_of_the_build(tmp_path)
    (folder / "lock").write_text("")  # what a build killed midway leaves
    r = _backend_in_a_new_process(env)
    assert r.returncode == 0 and r.stdout.split() == ["extension"], r.stderr[-3000:]
    assert not (folder / "lock").exists()


def test_the_build_lock_is_released_when_its_holder_is_killed(tmp_path):
    folder = tmp_path / "build"
    folder.mkdir()
    code = ("import os, signal, sys; from pathlib import Path; from ddp_avg_hooks import _ext\n"
            "with _ext.build_lock(Path(sys.argv[1])):\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", code, str(folder)], timeout=120)
    assert r.returncode == -9 and (folder / _ext.BUILD_LOCK).exists()
    with _ext.build_lock(folder, timeout_s=5):  # at once: the kernel dropped the lock
        pass


def test_a_load_that_waits_too_long_for_another_build_falls_back_saying_why(tmp_path):
    folder, env = _copy_of_the_build(tmp_path)
    env[_ext.ENV_BUILD_TIMEOUT] = "1"
    with _ext.build_lock(folder):  # another process's build, still running
        r = _backend_in_a_new_process(env)
    assert r.returncode == 0 and r.stdout.split() == ["fallback"], r.stderr[-3000:]
    assert f"build lock {folder / _ext.BUILD_LOCK}" in r.stderr, r.stderr
    assert _ext.ENV_BUILD_TIMEOUT in r.stderr and "pure-PyTorch fallback" in r.stderr
