"""A warm job's rank between two trials on CUDA (trainer/rank/serve.py ``release``), proven on a CPU with
tests/trainer/engine/test_metrics_unmapped.py's FakeCuda (torch's caching-allocator accounting, named there): the
rank's own device gets its cap lifted, its cache given back and its peaks reset, and what an earlier trial left
allocated there is reported."""

import gc

import pytest
import torch

from tests.trainer.engine.test_metrics_unmapped import GPU, FakeCuda, FakeDevice, MiB
from trainer.rank.serve import release


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda(FakeDevice(0, 1000 * MiB, 0), FakeDevice(1, 1000 * MiB, 50 * MiB)).install(monkeypatch)
    # torch/cuda/memory.py::reset_accumulated_memory_stats: the allocation counters, not the sizes read here
    monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", lambda device=None: fake.device(device))
    return fake


def test_release_gives_the_ranks_device_back_for_the_next_trial(cuda):
    d = cuda.device(GPU)
    d.fraction = 0.3  # the finished trial's --memory-limit-gb
    kept = cuda.malloc(32 * MiB, GPU)  # a tensor the finished trial left alive
    cuda.free(cuda.malloc(200 * MiB, GPU), GPU)  # its cache: freed, still reserved
    try:
        left_gb = release(GPU)
    finally:
        gc.unfreeze()  # release freezes what outlives a trial: in this test process, nothing should
    assert d.fraction == 1.0  # the next trial sets its own cap
    assert d.reserved == 32 * MiB  # the cached 200 MiB went back to the device
    assert d.peak_allocated == d.allocated == 32 * MiB  # the next trial's peaks start from what is left
    assert left_gb == pytest.approx(32 / 1024)
    assert cuda.device(0).fraction is None  # another rank's device is not touched
    cuda.free(kept, GPU)
