"""Timers, throughput, MFU and memory: measured like a benchmark.

CUDA: allocator peaks (allocated/reserved) reset at each phase (with a colocated vLLM engine, also
the device's used memory at the phase's end). CPU: peak RSS (VmHWM), reset at each phase by writing
"5" to /proc/self/clear_refs.
"""

from __future__ import annotations

import contextlib
import time

import torch

__all__ = ["PhaseMeter", "actor_mfu", "peak_flops", "profiled", "rss_gb", "rss_now_gb", "vm_data_bytes"]

GB = 1024**3

# Dense bf16 peak FLOP/s per device (vendor sheets); None where unknown -> MFU is null.
_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "L4": 121e12,
    "4090": 165e12,
    "V100": 125e12,
}


def peak_flops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, value in _PEAK_FLOPS.items():
        if key in device_name.upper():
            return value
    return None


def actor_mfu(
    *,
    num_params: int,
    total_tokens: float,
    sum_seqlen_sq: float,
    head_dim: int,
    num_heads: int,
    num_layers: int,
    epochs: int,
    seconds: float,
    world_size: int,
    peak: float | None,
) -> float | None:
    """Actor-update MFU per GPU (verl's estimate): training FLOPs of forward+backward,
    (6·N·Σtokens + 6·ΣL²·head_dim·heads·layers) x epochs, over (seconds x world size x peak FLOP/s)."""
    if not peak or seconds <= 0:
        return None
    flops = (6.0 * num_params * total_tokens + 6.0 * sum_seqlen_sq * head_dim * num_heads * num_layers) * epochs
    return flops / (seconds * world_size * peak)


def _read_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_gb() -> float | None:
    v = _read_status("VmHWM")
    return None if v is None else v / GB


def rss_now_gb() -> float | None:
    """Resident memory of this process now (VmRSS)."""
    v = _read_status("VmRSS")
    return None if v is None else v / GB


def vm_data_bytes() -> int | None:
    """Private writable memory of this process (what RLIMIT_DATA counts)."""
    return _read_status("VmData")


def _reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@contextlib.contextmanager
def profiled(enabled: bool, device: torch.device, *, rows: int = 25):
    """Run the body under torch.profiler when ``enabled``; yields a list that then holds one line: the
    table of the operators that took the most time (self time on the device on CUDA, on the host on CPU)."""
    out: list[str] = []
    if not enabled:
        yield out
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield out
    if cuda:
        torch.cuda.synchronize(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    out.append(prof.key_averages().table(sort_by=key, row_limit=rows))


class PhaseMeter:
    """Times each PPO phase and records its memory peak on this rank."""

    def __init__(self, device: torch.device, on_phase=None, *, device_wide: bool = False):
        self.device = device
        # CUDA: also count what the device holds beyond torch's allocator (a colocated vLLM engine's
        # KV cache and weights can live in vLLM's own memory pool)
        self.device_wide = device_wide
        self._outside_peak = 0.0
        self.on_phase = on_phase  # told each phase's name as it starts (so an OOM report can name it)
        self.timing: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self.allocated_peak = 0.0
        self.reserved_peak = 0.0

    def sample(self) -> None:
        """CUDA with ``device_wide``: count the device memory held outside torch's allocator now in the
        current phase's peak (call it where that memory is at its height, e.g. before an engine sleeps)."""
        if self.device_wide and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            outside = (total - free - torch.cuda.memory_reserved(self.device)) / GB
            self._outside_peak = max(self._outside_peak, outside)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.on_phase is not None:
            self.on_phase(name)
        self._sync()
        self._outside_peak = 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_rss_peak()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.timing[name] = self.timing.get(name, 0.0) + time.perf_counter() - t0
        if self.device.type == "cuda":
            alloc = torch.cuda.max_memory_allocated() / GB
            reserved = torch.cuda.max_memory_reserved() / GB
            self.allocated_peak = max(self.allocated_peak, alloc)
            self.reserved_peak = max(self.reserved_peak, reserved)
            self.sample()
            # what this phase itself needs: the allocator's cache keeps every earlier phase's blocks
            # reserved, so the reserved peak reads the same in every phase (seen on an H200); the
            # step's reserved peak and NVML stay the objective
            self.memory[name] = max(self.memory.get(name, 0.0), alloc + self._outside_peak)
        else:
            self.memory[name] = max(self.memory.get(name, 0.0), rss_gb() or 0.0)

    def reset(self) -> None:
        self.timing, self.memory = {}, {}
        self.allocated_peak = self.reserved_peak = 0.0
