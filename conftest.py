"""Doctests run in one process; each example that starts a process group ends it."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# The framework integrations stay out of doctest collection: importing Lightning or
# Transformers takes seconds in every worker, and tests/test_integrations.py runs them
# (in subprocesses, with the real packages) anyway.
collect_ignore = [
    "ddp_avg_hooks/integrations/lightning.py",
    "ddp_avg_hooks/integrations/accelerate.py",
    "ddp_avg_hooks/integrations/transformers.py",
]


def pytest_collection_modifyitems(items):
    """Tests marked ``slow`` (multi-process runs of several seconds) first, the rest in
    collection order: ``make test`` hands tests to its workers one at a time in this order
    (``--dist loadgroup --no-loadscope-reorder``), so no worker is left with a long test
    at the end while the other idles. A module whose tests share a module-scoped run is
    one ``xdist_group``, run by one worker."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
