import os

import pytest
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def world1():
    """A one-rank gloo world in this process, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
