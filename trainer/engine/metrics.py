"""Timers, throughput, MFU and memory: measured like a benchmark.

CUDA: allocator peaks (allocated/reserved) reset at each phase (with a colocated vLLM engine, also
the device's used memory at the phase's end), less what the allocator counts for a sleeping engine
(:class:`Unmapped`). CPU: peak RSS (VmHWM), reset at each phase by writing "5" to /proc/self/clear_refs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from trainer.device_specs import peak_flops

__all__ = [
    "PhaseMeter",
    "Unmapped",
    "actor_mfu",
    "phase_flops",
    "peak_flops",
    "profiled",
    "DecodeWindow",
    "PROFILED_DECODE_STEPS",
    "phase_profile",
    "phase_table",
    "rss_gb",
    "rss_now_gb",
    "vm_data_bytes",
]

GB = 1024**3

#: the phases whose FLOPs :func:`phase_flops` counts (the others move no model: reward, advantages)
MODEL_PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")


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
    flops = phase_flops(
        num_params=num_params,
        total_tokens=total_tokens,
        sum_seqlen_sq=sum_seqlen_sq,
        head_dim=head_dim,
        num_heads=num_heads,
        num_layers=num_layers,
        actor_epochs=epochs,
        critic_epochs=0,
    )["update_actor"]
    return flops / (seconds * world_size * peak)


def phase_flops(
    *,
    num_params: int,
    total_tokens: float,
    sum_seqlen_sq: float,
    head_dim: int,
    num_heads: int,
    num_layers: int,
    actor_epochs: int,
    critic_epochs: int,
) -> dict[str, float]:
    """The model FLOPs of each phase of a step over every rank (verl's estimate: a forward is a third of
    forward+backward): generation counts one forward over every token (prefill and decode with a KV cache),
    the log-prob and value passes one forward, the updates forward+backward per epoch. The critic's backbone is
    the actor's (the head's FLOPs are negligible)."""
    forward = 2.0 * num_params * total_tokens + 2.0 * sum_seqlen_sq * head_dim * num_heads * num_layers
    return {
        "gen": forward,
        "old_log_prob": forward,
        "ref": forward,
        "values": forward,
        "update_critic": 3.0 * forward * critic_epochs,
        "update_actor": 3.0 * forward * actor_epochs,
    }


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


#: Decode steps of an HF generate a profiled step records: the rest of the generate runs unrecorded (each decode
#: step repeats the same kernels, and a realistic shape's whole generate is millions of profiler events)
PROFILED_DECODE_STEPS = 16


class DecodeWindow:
    """An HF ``generate`` streamer (called with the prompt, then once per decode step) that stops the profiler's
    collection after :data:`PROFILED_DECODE_STEPS` decode steps and resumes it when the generate ends."""

    def __init__(self, prof, activities) -> None:
        self.prof, self.activities, self.calls, self.paused = prof, activities, 0, False

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == PROFILED_DECODE_STEPS + 1 and not self.paused:  # the prompt, then the decode steps
            self.prof.toggle_collection_dynamic(False, self.activities)
            self.paused = True

    def end(self) -> None:
        if self.paused:
            self.prof.toggle_collection_dynamic(True, self.activities)
            self.paused = False
        self.calls = 0


@contextlib.contextmanager
def profiled(enabled: bool, device: torch.device, *, rows: int = 25, meter: "PhaseMeter | None" = None):
    """Run the body under torch.profiler when ``enabled``; yields a list that then holds the table of the
    operators that took the most time (self time on the device on CUDA, on the host on CPU) and, with a
    ``meter`` (whose phases are then marked in the trace, and whose ``decode_window`` bounds what an HF generate
    records), the per-phase table of :func:`phase_profile`."""
    out: list[str] = []
    if not enabled:
        yield out
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if meter is not None:
        meter.profiling = True
    try:
        with profile(activities=activities) as prof:
            if meter is not None:
                meter.decode_window = DecodeWindow(prof, activities)
            yield out
    finally:
        if meter is not None:
            meter.profiling, meter.decode_window = False, None
    if cuda:
        torch.cuda.synchronize(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    out.append(prof.key_averages().table(sort_by=key, row_limit=rows))
    if meter is not None:
        meter.profile = phase_profile(prof.events())
        out.append(phase_table(meter.profile))


#: CUDA runtime calls that make the host wait for the device (``.item()``, a blocking copy, a synchronize)
_SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_PHASE_MARK = "phase:"


def phase_profile(events, *, top: int = 3) -> dict[str, dict]:
    """Per phase of a profiled step (the ``phase:<name>`` ranges :class:`PhaseMeter` marks while profiling):
    ``wall_ms``; ``device_busy_ms``, the union of the device's kernels, copies and memsets inside the phase (it
    is synchronized at both ends, so its device work lies within); ``launches`` (kernel launch calls); ``syncs``
    (runtime calls that wait for the device, PhaseMeter's own two included); ``top_host``, the host ranges
    (operators, annotations) with the most self time inside the phase, in ms."""
    import bisect

    from torch.autograd import DeviceType

    marks = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith(_PHASE_MARK)]
    device = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type != DeviceType.CPU and e.name
    )
    host = sorted(
        (e for e in events if e.device_type == DeviceType.CPU and not e.name.startswith(_PHASE_MARK)),
        key=lambda e: e.time_range.start,
    )
    starts = [e.time_range.start for e in host]
    device_starts = [a for a, _ in device]
    out: dict[str, dict] = {}
    for mark in marks:
        start, end = mark.time_range.start, mark.time_range.end
        inside = host[bisect.bisect_left(starts, start) : bisect.bisect_left(starts, end)]
        self_ms: dict[str, float] = {}
        for e in inside:
            if not e.name.startswith(("cuda", "cu")):
                self_ms[e.name] = self_ms.get(e.name, 0.0) + e.self_cpu_time_total / 1e3
        phase = out.setdefault(
            mark.name[len(_PHASE_MARK) :], {"wall_ms": 0.0, "device_busy_ms": 0.0, "launches": 0, "syncs": 0}
        )
        phase["wall_ms"] += (end - start) / 1e3
        lo, hi = bisect.bisect_left(device_starts, start), bisect.bisect_left(device_starts, end)
        phase["device_busy_ms"] += _union_ms(device[lo:hi], start, end)
        phase["launches"] += sum(1 for e in inside if "LaunchKernel" in e.name or e.name == "cudaGraphLaunch")
        phase["syncs"] += sum(1 for e in inside if e.name in _SYNC_CALLS)
        phase["top_host"] = sorted(self_ms.items(), key=lambda kv: -kv[1])[:top]
    return out


def _union_ms(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length (ms) of the union of sorted (start, end) intervals in µs, clipped to [start, end)."""
    total, reach = 0.0, start
    for a, b in intervals:
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total / 1e3


def phase_table(profile: dict[str, dict]) -> str:
    """:func:`phase_profile` as text, one line per phase."""
    lines = [f"{'phase':<15}{'wall ms':>10}{'busy ms':>10}{'busy %':>8}{'launches':>10}{'syncs':>7}  top host ranges"]
    for name, p in profile.items():
        busy = 100.0 * p["device_busy_ms"] / p["wall_ms"] if p["wall_ms"] else 0.0
        top = ", ".join(f"{n} {ms:.1f}" for n, ms in p.get("top_host", []))
        lines.append(
            f"{name:<15}{p['wall_ms']:>10.1f}{p['device_busy_ms']:>10.1f}{busy:>8.1f}{p['launches']:>10}"
            f"{p['syncs']:>7}  {top}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Unmapped:
    """Bytes torch's caching allocator counts on a device whose physical memory is unmapped: a sleeping vLLM
    engine's pool (trainer.engine.vllm_rollout.unmapped_pool_bytes). ``allocated``: its share of the allocated
    counter (live tensors); ``reserved``: of the reserved counter and the per-process fraction (segments)."""

    allocated: int = 0
    reserved: int = 0


class PhaseMeter:
    """Times each PPO phase and records its memory peak on this rank.

    CUDA: a phase's peak is what the device held for it: torch's allocated peak less what the allocator counted
    for a sleeping engine while the peak could occur (``unmapped``, read again at each :meth:`engine_changed`),
    plus, with ``device_wide``, what the device held outside the allocator (:meth:`sample`)."""

    def __init__(self, device: torch.device, on_phase=None, *, device_wide: bool = False):
        self.device = device
        # CUDA: also count what the device holds beyond torch's allocator (the CUDA context, NCCL's buffers and
        # the cuBLAS workspace a colocated vLLM engine creates)
        self.device_wide = device_wide
        self._outside_peak = 0.0
        self.on_phase = on_phase  # told each phase's name as it starts (so an OOM report can name it)
        #: what torch counts that the device does not hold now (set by the trial for a sleeping engine)
        self.unmapped: Callable[[], Unmapped] = Unmapped
        self._window = Unmapped()  # what was unmapped since the peak counters were last reset
        self._in_phase = False
        self._phase_peaks = (0, 0)  # (allocated, reserved) bytes the device held for the phase so far
        self.timing: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self.allocated_peak = 0.0
        self.reserved_peak = 0.0
        self.profiling = False  # set by profiled(): each phase is then a named range in the trace
        self.decode_window: Optional[DecodeWindow] = None  # set by profiled(): what an HF generate records
        self.profile: dict = {}  # the last profiled step's phase_profile

    def sample(self) -> None:
        """CUDA with ``device_wide``: count the device memory held outside torch's allocator now in the
        current phase's peak (call it where that memory is at its height, e.g. before an engine sleeps).
        A sleeping engine's segments are in torch's reserved count but not on the device: they come off it."""
        if self.device_wide and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            held = torch.cuda.memory_reserved(self.device) - self.unmapped().reserved
            self._outside_peak = max(self._outside_peak, (total - free - held) / GB)

    def engine_changed(self) -> None:
        """Call right after a colocated engine slept or woke: torch's counters did not move, what the device
        holds did. The peak so far is taken with what was unmapped until now, and the counters start again."""
        if self.device.type == "cuda" and self._in_phase:
            self._fold()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._window = self.unmapped()

    def _fold(self) -> None:
        allocated = torch.cuda.max_memory_allocated(self.device) - self._window.allocated
        reserved = torch.cuda.max_memory_reserved(self.device) - self._window.reserved
        self._phase_peaks = (max(self._phase_peaks[0], allocated), max(self._phase_peaks[1], reserved))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.on_phase is not None:
            self.on_phase(name)
        self._sync()
        self._outside_peak = 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._window, self._phase_peaks = self.unmapped(), (0, 0)
        else:
            _reset_rss_peak()
        t0 = time.perf_counter()
        self._in_phase = True
        try:
            with torch.profiler.record_function(_PHASE_MARK + name) if self.profiling else contextlib.nullcontext():
                yield
                self._sync()
        finally:
            self._in_phase = False
        self.timing[name] = self.timing.get(name, 0.0) + time.perf_counter() - t0
        if self.device.type == "cuda":
            self._fold()
            alloc, reserved = (b / GB for b in self._phase_peaks)
            self.allocated_peak = max(self.allocated_peak, alloc)
            self.reserved_peak = max(self.reserved_peak, reserved)
            self.sample()
            # what this phase itself needs: the allocator's cache keeps every earlier phase's blocks
            # reserved, so the reserved peak reads the same in every phase (docs/gpu.md); the
            # step's reserved peak and NVML stay the objective
            self.memory[name] = max(self.memory.get(name, 0.0), alloc + self._outside_peak)
        else:
            self.memory[name] = max(self.memory.get(name, 0.0), rss_gb() or 0.0)

    def reset(self) -> None:
        self.timing, self.memory = {}, {}
        self.allocated_peak = self.reserved_peak = 0.0
