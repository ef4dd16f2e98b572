"""The harness's tests import it as ``harness``, the way the scripts in ``benchmarks/`` do,
and ``bench_train.py`` through the ``bench_train`` fixture."""
import importlib.util
import os
import sys

import pytest

BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def bench_train():
    """``benchmarks/bench_train.py`` as a module."""
    spec = importlib.util.spec_from_file_location("bench_train",
                                                  os.path.join(BENCHMARKS, "bench_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
