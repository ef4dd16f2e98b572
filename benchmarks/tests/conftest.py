"""The harness's tests import it as ``harness``, the way the scripts in ``benchmarks/`` do."""
import os
import sys

BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

os.environ.setdefault("OMP_NUM_THREADS", "1")
