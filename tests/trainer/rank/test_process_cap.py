"""``--memory-limit-gb`` on CUDA caps what the device holds, a sleeping vLLM engine beside the trainer.

torch's per-process fraction counts every segment its allocator reserved, the unmapped segments of a sleeping
engine's pool included (c10/cuda/CUDACachingAllocator.cpp alloc_block): the cap allows them on top of the limit.
Proven on a CPU with tests/trainer/engine/test_metrics_unmapped.py's FakeCuda (torch's accounting, named there);
vLLM's own sleep and wake re-set the cap in tests/trainer/engine/test_vllm_rollout_sleep.py."""

import pytest
import torch

from tests.trainer.engine.test_metrics_unmapped import GPU, FakeCuda, FakeDevice, MiB, Pool
from trainer.rank.process import apply_memory_limit, cap_device_memory

LIMIT_GB = 500 / 1024


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    return FakeCuda(FakeDevice(0, 1000 * MiB, 0), FakeDevice(1, 1000 * MiB, 50 * MiB)).install(monkeypatch)


def _sleeping_engine(cuda: FakeCuda) -> int:
    """An engine of 400 MiB in its pool, asleep: unmapped, still reserved in torch's counters."""
    pool = Pool()
    for size in (100 * MiB, 300 * MiB):
        cuda.unmap(cuda.malloc(size, GPU, pool), GPU)
    return 400 * MiB


def test_the_cap_is_on_what_the_device_holds_while_the_engine_sleeps(cuda):
    unmapped = _sleeping_engine(cuda)
    apply_memory_limit(LIMIT_GB, GPU, [], base_bytes=0)
    # the limit alone: the sleeping segments eat it, 450 MiB are refused with 50 + 450 MiB on the device
    with pytest.raises(torch.OutOfMemoryError):
        cuda.malloc(450 * MiB, GPU)
    cap_device_memory(LIMIT_GB, GPU, unmapped_bytes=unmapped)
    held = cuda.malloc(450 * MiB, GPU)
    with pytest.raises(torch.OutOfMemoryError):  # still a cap: 550 MiB are over the limit
        cuda.malloc(100 * MiB, GPU)
    assert cuda.mem_get_info(GPU)[1] - cuda.mem_get_info(GPU)[0] == (50 + 450) * MiB
    cuda.free(held, GPU)


def test_the_cap_names_the_ranks_device(cuda):
    cap_device_memory(LIMIT_GB, GPU)
    assert cuda.devices[1].fraction == pytest.approx(0.5) and cuda.devices[0].fraction is None
