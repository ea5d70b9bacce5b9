"""What a verl trial's processes held in each phase (tuner.trials.memory: the sampler's Timeline, held_in_windows),
proven on a CPU with a fake NVML.

The fake ``pynvml`` is tests/tuner/trials/test_memory_nvml.py's; ``nvmlDeviceGetComputeRunningProcesses`` returns
``c_nvmlProcessInfo_t``-like records (``pid``, ``usedGpuMemory``: the bytes each process holds on that GPU). Under
verl with a colocated vLLM each GPU holds two of the trial's processes: the FSDP rank (a Ray worker) and vLLM's worker
(a child of verl's ``vLLMHttpServer``: verl/workers/rollout/vllm_rollout/vllm_async_server.py). vLLM's sleep unmaps
the physical memory of its pool (vllm/device_allocator/cumem.py::CuMemAllocator.sleep), so NVML's figure for the vLLM
worker drops to what its CUDA context keeps while it sleeps, and comes back on wake (verl's ``update_weights``
resumes the weights, then the KV cache). The phase windows are those verl's plugin records
(tests/trainer/verl_engine/test_plugin_phases.py): a weight sync, generation up to the end of the sleep, the passes.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest

from tests.tuner.trials.test_memory_nvml import A100, A100_B, fake_pynvml
from tuner.trials import memory
from tuner.trials.memory import MemorySampler
from tuner.trials.timeline import Timeline, held_in_windows

GIB = 1 << 30
ASLEEP_GB = 0.1  # vLLM's worker while its pool is unmapped: its CUDA context
VLLM_GB = 30.0  # vLLM's weights and KV cache (gpu_memory_utilization of the device) while awake

#: (phase, start, end, each FSDP rank's GB, each vLLM worker's GB): the v1 sync trainer's order (on_init_end's
#: weight sync, generation, the sleep, the passes, on_step_end's weight sync), two steps; rank 1 holds 1 GB less
SCRIPT = [
    ("weight_sync", 0.0, 2.0, 6.0, VLLM_GB),
    ("generation", 2.0, 5.0, 4.0, VLLM_GB),
    ("old_log_prob", 5.5, 6.5, 12.0, ASLEEP_GB),
    ("update_actor", 7.0, 9.0, 20.0, ASLEEP_GB),
    ("weight_sync", 9.5, 11.5, 6.0, VLLM_GB),
    ("generation", 11.5, 14.5, 4.0, VLLM_GB),
    ("old_log_prob", 15.0, 16.0, 12.0, ASLEEP_GB),
    ("update_actor", 16.5, 18.5, 26.0, ASLEEP_GB),
    ("weight_sync", 19.0, 21.0, 6.0, VLLM_GB),
]
STEP_OF = [1, 1, 1, 1, 1, 2, 2, 2, 2]
WINDOWS = [{"step": s, "phase": p, "start": a, "end": b} for s, (p, a, b, _, _) in zip(STEP_OF, SCRIPT)]
RANKS, SERVERS = (101, 102), (201, 202)  # host PIDs: the FSDP ranks, the vLLM workers (one per GPU)


def _held_at(t: float) -> tuple[float, float]:
    """(a rank's GB, a vLLM worker's GB) at ``t``: between two phases the rank keeps 3 GB, vLLM as it last was."""
    vllm = VLLM_GB
    for _, start, end, rank, server in SCRIPT:
        if start <= t <= end:
            return rank, server
        if end < t:
            vllm = server
    return 3.0, vllm


@dataclass
class _Info:  # pynvml.c_nvmlProcessInfo_t's fields the sampler reads
    pid: int
    usedGpuMemory: int


class _Proc:
    """What the sampler reads of a process of the trial's tree (psutil.Process: pid, memory_info, cpu_times)."""

    def __init__(self, pid: int, rss_gb) -> None:
        self.pid, self._rss_gb = pid, rss_gb

    def memory_info(self):
        return namedtuple("pmem", "rss")(int(self._rss_gb() * GIB))

    def cpu_times(self):
        return namedtuple("pcputimes", "user system")(0.0, 0.0)


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(memory.time, "time", lambda: now[0])
    return now


def _sample_through(sampler: MemorySampler, clock: list, until: float = 21.5) -> memory.MemoryPeaks:
    """The sampler's 10 Hz, on the fake clock (the thread's pacing is not what is proven here), off the phases' edges
    (a sample at the very instant one phase ends and the next begins would be either's)."""
    for tick in range(int(until * 10) + 1):
        clock[0] = (tick + 0.5) / 10
        sampler._sample()
    return sampler.stop()


def test_each_phase_reads_what_the_trials_processes_held_vllm_only_while_awake(monkeypatch, clock):
    nv = fake_pynvml([A100, A100_B])
    gpus = [("gpu", A100.uuid), ("gpu", A100_B.uuid)]

    def running(h):
        rank, server = _held_at(clock[0])
        i = gpus.index(h)
        return [_Info(RANKS[i], int((rank - i) * GIB)), _Info(SERVERS[i], int(server * GIB))]

    nv.nvmlDeviceGetComputeRunningProcesses = running
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nv)
    monkeypatch.setattr(memory, "_nvml_ok", None)
    tree = [_Proc(pid, lambda: 1.0) for pid in (100, *RANKS, *SERVERS)]  # the verl driver and its Ray workers
    monkeypatch.setattr(memory, "process_tree", lambda root: tree)
    sampler = MemorySampler(100, gpus=[A100.uuid, A100_B.uuid])
    peaks = _sample_through(sampler, clock)
    assert peaks.external_source == "nvml" and peaks.external_peak_gb == pytest.approx(36.0)  # a weight sync
    held = held_in_windows(peaks.timeline, WINDOWS)
    assert held["by_phase"] == {
        "weight_sync": 36.0,  # the rank's 6 GB beside vLLM's 30 GB awake
        "generation": 34.0,
        "old_log_prob": 12.1,  # vLLM asleep: its context only
        "update_actor": 26.1,
    }
    assert held["by_step"]["1"] == {
        "weight_sync": 36.0,
        "generation": 34.0,
        "old_log_prob": 12.1,
        "update_actor": 20.1,
        "step": 36.0,
    }
    assert held["by_step"]["2"]["update_actor"] == 26.1 and held["by_step"]["2"]["step"] == 36.0


def test_on_a_cpu_the_largest_process_is_the_timeline(monkeypatch, clock):
    """psutil's basis (the external peak of a CPU trial): the largest single process's RSS at each sample."""
    monkeypatch.setattr(memory, "_nvml_ok", False)
    tree = [_Proc(101, lambda: _held_at(clock[0])[0]), _Proc(201, lambda: _held_at(clock[0])[1] / 3)]
    monkeypatch.setattr(memory, "process_tree", lambda root: tree)
    peaks = _sample_through(MemorySampler(100, use_nvml=False), clock)
    held = held_in_windows(peaks.timeline, WINDOWS)
    assert held["by_phase"] == {"weight_sync": 10.0, "generation": 10.0, "old_log_prob": 12.0, "update_actor": 26.0}


def test_a_full_timeline_merges_neighbours_and_still_reads_each_windows_most():
    timeline = Timeline(cap=64)
    for tick in range(1000):
        t = tick / 10
        timeline.add(t, (9.0 if 40.0 <= t <= 40.05 else 1.0, 2.0))  # one sample of 9 GB at t = 40
    assert len(timeline.buckets) <= 64
    assert timeline.peak(40.0, 40.0) == 9.0  # inside a merged bucket: kept as its maximum
    assert timeline.peak(0.0, 30.0) == 2.0
    assert timeline.peak(200.0, 300.0) is None  # after the run: no sample, no figure


def test_no_timeline_or_no_windows_reads_nothing():
    assert held_in_windows(None, WINDOWS) is None
    assert held_in_windows(Timeline(), []) is None
