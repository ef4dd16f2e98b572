"""The harness's tests import it as ``harness``, the way the scripts in ``benchmarks/`` do,
and ``bench_train.py`` through the ``bench_train`` fixture.

A loopback training job (``harness.launch.run_training`` without a network pair) runs on
ranks forked from the test process's forkserver, with torchrun's environment, rather than
under torchrun itself: the harness's tests check what its scripts compute, and a real
torchrun launch spends ~13 s of CPU importing torch in three fresh processes for a job of
well under a second. Tests marked ``torchrun`` launch the real thing, so every script's
torchrun path still runs.
"""
import importlib.util
import os
import sys
import time

import pytest

BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
TESTS = os.path.join(os.path.dirname(BENCHMARKS), "tests")  # the package's tests: _dist.py
if TESTS not in sys.path:
    sys.path.append(TESTS)

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "torchrun: launch loopback training under torchrun itself")


@pytest.fixture(autouse=True)
def _forked_loopback_training(request, monkeypatch):
    if request.node.get_closest_marker("torchrun"):
        yield
        return
    from _dist import run_script
    from harness import launch

    real = launch.run_training

    def run_training(train_args, out, *, pair=None, nproc=2, timeout_s=600.0, log=None,
                     stream=False, rdzv_id=None, script=launch.TRAIN):
        if pair is not None:
            return real(train_args, out, pair=pair, nproc=nproc, timeout_s=timeout_s, log=log,
                        stream=stream, rdzv_id=rdzv_id, script=script)
        args, log = launch.prepare_job(train_args, out, log)
        command = launch.shell_line(launch.loopback_command(args, nproc, script))
        with open(log, "w") as f:
            f.write(f"$ {command}  (on forked ranks)\n")
        t0 = time.perf_counter()
        try:
            codes = run_script(script, args, nproc, timeout_s, log=log,
                               env={"PYTHONUNBUFFERED": "1"})
        except TimeoutError:
            raise launch.LaunchError.timed_out(timeout_s, log)
        if any(c != 0 for c in codes):
            raise launch.LaunchError.failed(codes, log)
        return launch.record_launch(out, [command], time.perf_counter() - t0, launch.LOOPBACK)

    monkeypatch.setattr(launch, "run_training", run_training)
    yield


@pytest.fixture(scope="module")
def bench_train():
    """``benchmarks/bench_train.py`` as a module."""
    spec = importlib.util.spec_from_file_location("bench_train",
                                                  os.path.join(BENCHMARKS, "bench_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
