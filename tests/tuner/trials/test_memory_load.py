"""Other processes on a trial's GPUs (tuner.trials.memory.LoadMeter) across PID namespaces, proven on a CPU.

The fake follows nvidia-ml-py: ``nvmlDeviceGetComputeRunningProcesses`` returns ``c_nvmlProcessInfo_t`` records with
``pid`` and ``usedGpuMemory``, the PIDs the driver sees: the host's, whatever namespace asks (the driver knows no PID
namespace: NVIDIA/nvidia-docker#1483). psutil's PIDs are those of the namespace whose /proc it reads. Under verl with a
colocated vLLM each GPU holds two of the trial's processes: the FSDP rank (a Ray worker) and vLLM's worker (a child of
verl's vLLMHttpServer, executor "mp": verl/workers/rollout/vllm_rollout/vllm_async_server.py)."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest

from tuner.trials import memory
from tuner.trials.memory import GPU_OTHERS_UNKNOWN, LoadMeter

GIB = 1 << 30


@dataclass
class ProcessInfo:  # pynvml.c_nvmlProcessInfo_t's fields the meter reads
    pid: int
    usedGpuMemory: int


@pytest.fixture
def clock(monkeypatch):
    """A metered window long enough to say something, the host's CPUs idle (the GPUs alone decide)."""
    now = [100.0]
    monkeypatch.setattr(memory.time, "monotonic", lambda: now[0])
    idle = namedtuple("scputimes", "user system idle")(0.0, 0.0, 1000.0)  # psutil.cpu_times()'s fields read
    monkeypatch.setattr(memory.psutil, "cpu_times", lambda: idle)
    return now


def _metered(clock, meter: LoadMeter) -> dict:
    meter.sample([])
    clock[0] += 10.0
    meter.sample([])
    return meter.figures()


def test_a_container_without_the_hosts_pids_says_unknown_never_loaded(clock):
    """The trial's tree is {7, 8, 9} in the container; NVML lists its rank and vLLM worker by their host PIDs."""
    meter = LoadMeter()
    for _ in range(3):
        meter.gpu([ProcessInfo(401207, 30 * GIB), ProcessInfo(401388, 40 * GIB)], pids={7, 8, 9})
    got = _metered(clock, meter)
    assert got["gpu_other_processes"] == "unknown" and got["gpu_other_memory_gb"] is None
    assert got["loaded"] is False  # the confirmation may claim from it: nothing ran beside it that it could see
    assert meter.note() == GPU_OTHERS_UNKNOWN and "--pid=host" in meter.note()


def test_in_the_hosts_namespace_both_of_the_trials_processes_are_its_own_and_a_third_is_load(clock):
    meter = LoadMeter()
    meter.gpu([ProcessInfo(401207, 30 * GIB), ProcessInfo(401388, 40 * GIB)], pids={401207, 401388, 401000})
    assert _metered(clock, meter)["loaded"] is False and meter.note() is None
    meter.gpu(
        [ProcessInfo(401207, 30 * GIB), ProcessInfo(401388, 40 * GIB), ProcessInfo(5, GIB)], pids={401207, 401388}
    )
    got = meter.figures()
    assert got["gpu_other_processes"] == 1 and got["gpu_other_memory_gb"] == 1.0 and got["loaded"] is True


def test_another_job_on_the_gpu_before_the_trial_reaches_it_is_load_once_the_trial_shows(clock):
    """Early samples list only the other job (the trial is still loading its model); a later one lists the trial's
    own process: NVML and psutil share the namespace, so the early ones were all others."""
    meter = LoadMeter()
    meter.gpu([ProcessInfo(5, 2 * GIB)], pids={400, 401})
    meter.gpu([ProcessInfo(5, 2 * GIB), ProcessInfo(400, 10 * GIB)], pids={400, 401})
    got = _metered(clock, meter)
    assert got["gpu_other_processes"] == 1 and got["gpu_other_memory_gb"] == 2.0 and got["loaded"] is True
