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
