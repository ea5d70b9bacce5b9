"""Fixtures the engine's tests share."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo process group for FSDP (destroyed afterwards: other tests see none)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
