"""PhaseMeter on CUDA beside a sleeping vLLM engine, proven on a CPU with a fake ``torch.cuda``.

vLLM's sleep mode allocates the engine's weights and KV cache through a torch ``MemPool`` whose pluggable
allocator maps physical memory itself; ``sleep`` unmaps it but the tensors and the pool's segments live on, so
torch's allocated/reserved counters and the per-process fraction keep counting them (vLLM #17117, #33625).
:class:`FakeCuda` keeps torch's counters and the driver's mapping as the upstream code does (its docstring names
the lines); the :class:`~trainer.engine.metrics.PhaseMeter` driven here is the real one. vLLM's own sleep and wake
(its ``CuMemAllocator`` and sleep-mode backend) drive the same fake in test_vllm_rollout_sleep.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch

from trainer.engine.metrics import GB, PhaseMeter, Unmapped

MiB = 1024**2
#: c10/cuda/CUDACachingAllocator.cpp round_size: a large block is rounded up to kRoundLarge (2 MiB)
ROUND = 2 * MiB


@dataclass
class Segment:
    address: int
    size: int
    pool: object  # None: the allocator's default pool; else the MemPool it was allocated in
    allocated: bool = False
    mapped: bool = True


@dataclass
class FakeDevice:
    index: int
    total: int
    context: int  # what the device holds outside the allocator (CUDA context, NCCL, cuBLAS workspaces)

    def __post_init__(self) -> None:
        self.segments: dict[int, Segment] = {}
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.fraction: Optional[float] = None

    @property
    def held(self) -> int:
        """What the device holds (what cudaMemGetInfo and NVML read): mapped memory only."""
        return self.context + sum(s.size for s in self.segments.values() if s.mapped)


class FakeCuda:
    """torch.cuda on a CPU, its counters kept as torch's DeviceCachingAllocator keeps them
    (c10/cuda/CUDACachingAllocator.cpp):

    - ``alloc_block``: refused when ``set_fraction && total_allocated_memory + size > allowed_memory_maximum``
      (``total_allocated_memory``: every segment of the device, a MemPool's included); else a MemPool with an
      allocator gets the segment from that allocator's ``raw_alloc`` (vLLM's ``my_malloc``,
      csrc/cumem_allocator.cpp: it creates and maps the memory, then calls CuMemAllocator's malloc callback),
      the default pool from cudaMalloc; ``total_allocated_memory`` and ``reserved_bytes`` grow by the segment;
    - ``alloc_found_block``: ``allocated_bytes`` grows by the block; ``free_block``: the block goes back to its
      pool, ``allocated_bytes`` shrinks, the segment stays reserved;
    - ``release_cached_blocks`` (``empty_cache``): the default pool's free segments go back to the device; a
      MemPool still in use keeps its own (vLLM keeps its pools alive in ``allocator_and_pools``);
    - ``reset_peak_memory_stats``: each peak becomes the current value;
    - ``allowed_memory_maximum = fraction x total`` (``setMemoryFraction``).

    and the driver: cuMemUnmap/cuMemRelease and cuMemCreate/cuMemMap (vLLM's ``unmap_and_release`` and
    ``create_and_map``) change what the device holds, never torch's counters. One block per segment (torch
    would split a large cached segment; the counters move the same way for these tests). Every call but
    ``empty_cache`` (which empties every device's cache in torch) must name its device."""

    def __init__(self, *devices: FakeDevice):
        self.devices = {d.index: d for d in devices}
        self._addresses = itertools.count(0x7F0000000000, 64 * MiB)

    def device(self, device) -> FakeDevice:
        assert device is not None, "a torch.cuda call that does not name its device"
        index = device if isinstance(device, int) else torch.device(device).index
        assert index is not None, f"{device}: a device without an index is whatever device is current"
        return self.devices[index]

    # ---------------------------------------------------------------- what creating and deleting tensors does
    def malloc(self, size: int, device, pool=None) -> int:
        d, size = self.device(device), -(-size // ROUND) * ROUND
        cached = [s for s in d.segments.values() if not s.allocated and s.pool is pool and s.size == size]
        seg = cached[0] if cached else self._alloc_block(d, size, pool)
        seg.allocated = True
        d.allocated += size
        d.peak_allocated = max(d.peak_allocated, d.allocated)
        return seg.address

    def _alloc_block(self, d: FakeDevice, size: int, pool) -> Segment:
        if d.fraction is not None and d.reserved + size > int(d.fraction * d.total):
            raise torch.OutOfMemoryError(f"CUDA out of memory: the per-process fraction {d.fraction:.3f} is reached")
        if d.held + size > d.total:
            raise torch.OutOfMemoryError("CUDA out of memory: the device is full")
        seg = Segment(next(self._addresses), size, pool)
        d.segments[seg.address] = seg
        d.reserved += size
        d.peak_reserved = max(d.peak_reserved, d.reserved)
        if pool is not None:
            pool.raw_alloc(d.index, size, seg.address)
        return seg

    def free(self, address: int, device) -> None:
        d = self.device(device)
        seg = d.segments[address]
        assert seg.allocated
        seg.allocated = False
        d.allocated -= seg.size

    # ---------------------------------------------------------------- the driver (vLLM's cumem C extension)
    def unmap(self, address: int, device) -> None:
        self.device(device).segments[address].mapped = False

    def map(self, address: int, device) -> None:
        d = self.device(device)
        seg = d.segments[address]
        if d.held + seg.size > d.total:
            raise RuntimeError("CUDA Error: out of memory (cuMemCreate)")
        seg.mapped = True

    # ---------------------------------------------------------------- the torch.cuda API
    def empty_cache(self) -> None:
        for d in self.devices.values():
            for address in [a for a, s in d.segments.items() if not s.allocated and s.pool is None]:
                d.reserved -= d.segments.pop(address).size

    def synchronize(self, device=None) -> None:
        self.device(device)

    def reset_peak_memory_stats(self, device=None) -> None:
        d = self.device(device)
        d.peak_allocated, d.peak_reserved = d.allocated, d.reserved

    def memory_allocated(self, device=None) -> int:
        return self.device(device).allocated

    def memory_reserved(self, device=None) -> int:
        return self.device(device).reserved

    def max_memory_allocated(self, device=None) -> int:
        return self.device(device).peak_allocated

    def max_memory_reserved(self, device=None) -> int:
        return self.device(device).peak_reserved

    def mem_get_info(self, device=None) -> tuple[int, int]:
        d = self.device(device)
        return d.total - d.held, d.total

    def memory_snapshot(self, mempool_id=None, include_traces=True) -> list[dict]:
        return [
            {
                "device": d.index,
                "address": s.address,
                "total_size": s.size,
                "allocated_size": s.size if s.allocated else 0,
                "segment_pool_id": (0, 0) if s.pool is None else (1, id(s.pool)),
            }
            for d in self.devices.values()
            for s in d.segments.values()
        ]

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        self.device(device).fraction = fraction

    def get_device_properties(self, device=None):
        return SimpleNamespace(total_memory=self.device(device).total, name="fake")

    def install(self, monkeypatch) -> "FakeCuda":
        for name in (
            "empty_cache",
            "synchronize",
            "reset_peak_memory_stats",
            "memory_allocated",
            "memory_reserved",
            "max_memory_allocated",
            "max_memory_reserved",
            "mem_get_info",
            "memory_snapshot",
            "set_per_process_memory_fraction",
            "get_device_properties",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        # vLLM 0.33's cumem.py calls the device-generic spellings
        monkeypatch.setattr(torch.accelerator, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.accelerator, "empty_cache", self.empty_cache)
        return self


class Pool:
    """A MemPool with a pluggable allocator that maps its own memory, as vLLM's sleep-mode pool: its
    ``raw_alloc`` is what the allocator calls for each new segment (``on_segment``: vLLM's malloc callback)."""

    def __init__(self, on_segment: Optional[Callable[[tuple], None]] = None):
        self.on_segment = on_segment

    def raw_alloc(self, device: int, size: int, address: int) -> None:
        if self.on_segment is not None:
            self.on_segment((device, size, address, 0))  # vLLM's HandleType: (device, size, d_mem, p_memHandle)


def unmapped_in(cuda: FakeCuda, pool: Pool, index: int) -> Unmapped:
    """The pool's unmapped segments on one device, from the allocator's snapshot (the reading
    trainer.engine.vllm_rollout.unmapped_pool_bytes makes from vLLM's bookkeeping; tested with vLLM there)."""
    segs = [s for s in cuda.device(index).segments.values() if s.pool is pool and not s.mapped]
    return Unmapped(sum(s.size for s in segs if s.allocated), sum(s.size for s in segs))


GPU = torch.device("cuda", 1)


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    # rank 1's device: a call that does not name it would read device 0 (asserted by FakeCuda)
    return FakeCuda(FakeDevice(0, 1000 * MiB, 0), FakeDevice(1, 1000 * MiB, 50 * MiB)).install(monkeypatch)


def test_a_training_phase_peak_leaves_out_the_sleeping_engine_and_keeps_it_while_awake(cuda):
    pool = Pool()
    weights, kv = cuda.malloc(100 * MiB, GPU, pool), cuda.malloc(300 * MiB, GPU, pool)
    meter = PhaseMeter(GPU, device_wide=True)
    meter.unmapped = lambda: unmapped_in(cuda, pool, 1)

    def sleep() -> None:
        cuda.unmap(weights, GPU), cuda.unmap(kv, GPU)
        meter.engine_changed()

    sleep()  # the engine starts asleep (outside any phase: nothing to fold)
    with meter.phase("update_actor"):
        cuda.free(cuda.malloc(200 * MiB, GPU), GPU)
    # torch's own peak still counts the sleeping engine: the reading PhaseMeter made before
    assert cuda.max_memory_allocated(GPU) == 600 * MiB
    # what the device held for the phase: the trainer's 200 MiB, and the context outside the allocator
    # (device used - (reserved - the unmapped segments)); torch's reserved is above the device's used memory here
    assert meter.memory["update_actor"] == pytest.approx(250 * MiB / GB)

    with meter.phase("update_weights"):  # asleep at the start, awake at the end (verl's order)
        cuda.empty_cache()
        cuda.map(weights, GPU)
        meter.engine_changed()
        cuda.free(cuda.malloc(50 * MiB, GPU), GPU)  # a gathered tensor pushed while the KV cache still sleeps
        cuda.map(kv, GPU)
        meter.engine_changed()
    # max(weights + the gathered tensor, the whole engine), never the unmapped KV cache beside the gathered tensor
    assert meter.memory["update_weights"] == pytest.approx((400 + 50) * MiB / GB)

    with meter.phase("gen"):  # awake: the engine counts
        cuda.free(cuda.malloc(20 * MiB, GPU), GPU)
        meter.sample()
        sleep()
    assert meter.memory["gen"] == pytest.approx((420 + 50) * MiB / GB)
    assert meter.allocated_peak == pytest.approx(420 * MiB / GB)
    # the step's reserved peak: the engine's segments while mapped, the trainer's cache
    assert meter.reserved_peak == pytest.approx((400 + 50 + 20) * MiB / GB)


def test_without_a_sleeping_engine_the_peaks_are_torchs(cuda):
    meter = PhaseMeter(GPU)
    with meter.phase("update_actor"):
        a = cuda.malloc(300 * MiB, GPU)
        cuda.free(cuda.malloc(100 * MiB, GPU), GPU)
        meter.engine_changed()  # an engine that never sleeps changes nothing it counts
        cuda.free(a, GPU)
    assert meter.memory["update_actor"] == pytest.approx(400 * MiB / GB)
    assert meter.allocated_peak == meter.reserved_peak == pytest.approx(400 * MiB / GB)
