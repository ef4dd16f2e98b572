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
