import os

import pytest
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The framework check scripts and the torchrun worker run as programs (under torchrun, by
# test_integrations.py and test_torchft.py). They hold no doctests; importing them for
# --doctest-modules would import Transformers, Lightning and Accelerate in every pytest
# process (~12 s of CPU each at collection). One that gains a doctest is collected again.
_SCRIPTS = ("_hf_checks.py", "_lightning_checks.py", "_accelerate_checks.py", "_torchft_worker.py",
            "_resume_checks.py")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _has_doctest(name: str) -> bool:
    try:
        with open(os.path.join(_HERE, name)) as f:
            return ">>>" in f.read()
    except OSError:
        return False


collect_ignore = [name for name in _SCRIPTS if not _has_doctest(name)]


@pytest.fixture
def world1():
    """A one-rank gloo world in this process, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
