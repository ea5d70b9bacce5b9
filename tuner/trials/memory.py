"""Memory of a trial, read from outside: NVML (device + per-process) or, without NVML, psutil RSS.

:class:`MemorySampler` is a thread that samples at ``hz`` (>= 10) until stopped and keeps
peaks. With NVML it reads, for each of the trial's GPUs, the device's used memory and the
memory of the trial's own processes (``nvmlDeviceGetComputeRunningProcesses`` filtered to
the trial's process tree) - that includes the CUDA context and NCCL buffers torch's
allocator never sees. Without NVML (``nvmlInit`` raises, e.g. no driver) it sums the RSS of
the trial's process tree. ``source`` says which: ``"nvml"`` or ``"psutil"``.

Like NVML's per-GPU figure, the psutil objective is per rank: the peak RSS of the largest single
process of the tree (on CPU a rank stands for a GPU, and ``--memory-limit-gb`` caps each process).
The summed RSS of the whole tree is kept beside it (``tree_rss_peak_gb``).

The same thread meters the trial's load (:class:`LoadMeter`): the host's CPU time spent outside the trial's
process tree and outside the tuner itself, and other processes on the trial's GPUs (NVML). A trial measured beside
another job runs slower for a reason that is not its knobs: :func:`is_loaded` marks it, and the confirmation claims
nothing from a round with such a run.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import psutil

__all__ = [
    "MemoryPeaks",
    "MemorySampler",
    "LoadMeter",
    "LOADED_CPU_SHARE",
    "is_loaded",
    "nvml_available",
    "visible_gpus",
    "gpu_info",
    "process_tree",
]

GIB = float(1 << 30)
#: a trial is measured under load when processes outside it (and outside the tuner) kept more than this share of
#: the host's CPUs busy on average: a CPU trial then shares its cores, a GPU trial its host-side launch threads
LOADED_CPU_SHARE = 0.25
_MIN_METERED_S = 0.5  # a shorter window says nothing about the load (the kernel counts CPU time in 10 ms ticks)

_nvml_lock = threading.Lock()
_nvml_ok: Optional[bool] = None


def nvml_available() -> bool:
    """``nvmlInit()`` once per process; False when the library or the driver is missing."""
    global _nvml_ok
    with _nvml_lock:
        if _nvml_ok is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml_ok = pynvml.nvmlDeviceGetCount() > 0
            except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded / ImportError
                _nvml_ok = False
        return _nvml_ok


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    if not nvml_available():
        return []
    import pynvml

    return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]


def _handle(ident: str):
    import pynvml

    if ident.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(ident))
    return pynvml.nvmlDeviceGetHandleByUUID(ident)


def gpu_info(ident: str = "0") -> tuple[Optional[str], Optional[float]]:
    """(name, total memory GB) of a GPU, or (None, None) without NVML."""
    if not nvml_available():
        return None, None
    import pynvml

    try:
        h = _handle(ident)
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        return name, pynvml.nvmlDeviceGetMemoryInfo(h).total / GIB
    except Exception:
        return None, None


def process_tree(root_pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


@dataclass
class MemoryPeaks:
    external_peak_gb: Optional[float] = None  # the external measure: NVML per-process (or device) / summed RSS
    external_source: str = "psutil"  # nvml | psutil
    device_used_peak_gb: Optional[float] = None  # NVML device used memory (max over the trial's GPUs)
    process_peak_gb: Optional[float] = None  # NVML memory of the trial's own processes (max over GPUs)
    tree_rss_peak_gb: Optional[float] = None  # summed RSS of the process tree (always sampled)
    process_rss_peak_gb: Optional[float] = None  # RSS of the largest single process (per rank on CPU)
    samples: int = 0
    pids_seen: tuple = ()
    load: Optional[dict] = None  # LoadMeter.figures(): what ran beside the trial (None: not metered)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("pids_seen")
        d.pop("load")
        return d


def is_loaded(cpu_others_share: Optional[float], gpu_other_processes: int) -> bool:
    """Was a trial measured under load? Other processes on its GPUs, or more than :data:`LOADED_CPU_SHARE` of the
    host's CPUs busy outside it on average (None: not metered, not loaded)."""
    return gpu_other_processes > 0 or (cpu_others_share is not None and cpu_others_share > LOADED_CPU_SHARE)


def _busy_s(times) -> float:
    """CPU seconds a ``psutil.cpu_times()`` reading spent busy (not idle, not waiting for I/O)."""
    idle = getattr(times, "idle", 0.0) + getattr(times, "iowait", 0.0)
    return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


class LoadMeter:
    """What runs beside a trial: the host's busy CPU time less the trial's process tree's and the tuner's own (the
    tuner and every process it started; each process's CPU time counted from when it was first seen), and the other
    processes on its GPUs (NVML: those not in its tree; where NVML's PIDs are another namespace's, more than one
    process on a GPU)."""

    def __init__(self) -> None:
        self._t0: Optional[float] = None
        self._busy0 = 0.0
        self._last: tuple = (0.0, 0.0)  # (monotonic, host busy seconds) at the last sample
        self._cpu: dict[int, tuple[float, float]] = {}  # pid -> (CPU seconds when first seen, last seen)
        self._me = psutil.Process()
        self.gpu_others = 0
        self.gpu_other_bytes = 0

    def sample(self, procs: list) -> None:
        now, busy = time.monotonic(), _busy_s(psutil.cpu_times())
        if self._t0 is None:
            self._t0, self._busy0 = now, busy
        self._last = (now, busy)
        try:  # the tuner's whole tree is ours: a warm job it started ahead for the next trial is not load
            tuner = [self._me, *self._me.children(recursive=True)]
        except psutil.Error:
            tuner = [self._me]
        for p in [*procs, *tuner]:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total = t.user + t.system
            first, _ = self._cpu.get(p.pid, (total, total))
            self._cpu[p.pid] = (first, total)

    def gpu(self, running: list, pids: set) -> None:
        """One GPU's compute processes (NVML's list) at this sample; ``pids``: the trial's tree."""
        if not running:
            return
        if any(pr.pid in pids for pr in running):
            others = [pr for pr in running if pr.pid not in pids]
        else:  # NVML reports another PID namespace (a container): one rank per GPU is the trial's
            others = sorted(running, key=lambda pr: getattr(pr, "usedGpuMemory", 0) or 0)[:-1]
        self.gpu_others = max(self.gpu_others, len(others))
        self.gpu_other_bytes = max(self.gpu_other_bytes, sum(getattr(pr, "usedGpuMemory", 0) or 0 for pr in others))

    def figures(self) -> Optional[dict]:
        """``{cpu_others, cpu_others_share, cpu_trial, gpu_other_processes, gpu_other_memory_gb, loaded}`` (CPUs
        busy on average over the window; TrialRecord.load), or None for a window too short to say."""
        if self._t0 is None or self._last[0] - self._t0 < _MIN_METERED_S:
            return None
        wall = self._last[0] - self._t0
        ours = sum(last - first for first, last in self._cpu.values())
        others = max(0.0, (self._last[1] - self._busy0) - ours) / wall
        share = others / float(psutil.cpu_count() or 1)
        return {
            "cpu_others": round(others, 3),
            "cpu_others_share": round(share, 3),
            "cpu_trial": round(ours / wall, 3),
            "gpu_other_processes": self.gpu_others,
            "gpu_other_memory_gb": round(self.gpu_other_bytes / GIB, 3),
            "loaded": is_loaded(share, self.gpu_others),
        }


class MemorySampler(threading.Thread):
    """Sample a process tree's memory at ``hz`` until :meth:`stop`; keep the peaks."""

    def __init__(self, root_pid: int, *, gpus: Optional[Sequence[str]] = None, use_nvml: bool = True, hz: float = 10.0):
        super().__init__(name=f"memory-sampler-{root_pid}", daemon=True)
        assert hz >= 10.0, "sample at 10 Hz or more: short phases peak for well under a second"
        self.root_pid = root_pid
        self.interval_s = 1.0 / hz
        self._stop_event = threading.Event()
        self._handles = []
        if use_nvml and nvml_available():
            for ident in gpus if gpus is not None else visible_gpus():
                try:
                    self._handles.append(_handle(str(ident)))
                except Exception:
                    pass
        self.source = "nvml" if self._handles else "psutil"
        self.peaks = MemoryPeaks(external_source=self.source)
        self.load = LoadMeter()
        self._pids: set[int] = set()

    # ---- sampling
    def _sample(self) -> None:
        procs = process_tree(self.root_pid)
        pids = {p.pid for p in procs}
        self._pids |= pids
        rss, largest = 0, 0
        for p in procs:
            try:
                r = p.memory_info().rss
            except psutil.Error:
                continue
            rss += r
            largest = max(largest, r)
        self.load.sample(procs)
        pk = self.peaks
        pk.samples += 1
        if procs:
            pk.tree_rss_peak_gb = max(pk.tree_rss_peak_gb or 0.0, rss / GIB)
            pk.process_rss_peak_gb = max(pk.process_rss_peak_gb or 0.0, largest / GIB)
        if self._handles:
            import pynvml

            dev_used, proc_used = 0, 0
            for h in self._handles:
                try:
                    dev_used = max(dev_used, pynvml.nvmlDeviceGetMemoryInfo(h).used)
                    running = list(pynvml.nvmlDeviceGetComputeRunningProcesses(h))
                    self.load.gpu(running, pids)
                    mine = sum((getattr(pr, "usedGpuMemory", None) or 0) for pr in running if pr.pid in pids)
                    proc_used = max(proc_used, mine)
                except Exception:
                    continue
            pk.device_used_peak_gb = max(pk.device_used_peak_gb or 0.0, dev_used / GIB)
            if proc_used:
                pk.process_peak_gb = max(pk.process_peak_gb or 0.0, proc_used / GIB)

    def run(self) -> None:
        while not self._stop_event.is_set():
            t = time.monotonic()
            try:
                self._sample()
            except Exception:  # never let a sampling hiccup end the measurement
                pass
            self._stop_event.wait(max(0.0, self.interval_s - (time.monotonic() - t)))

    def stop(self) -> MemoryPeaks:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5)
        pk = self.peaks
        if self.source == "nvml":
            # PIDs in a container's namespace often do not match NVML's host PIDs: then the
            # device's used memory is the best outside view there is.
            pk.external_peak_gb = pk.process_peak_gb if pk.process_peak_gb is not None else pk.device_used_peak_gb
        else:
            pk.external_peak_gb = pk.process_rss_peak_gb
        pk.pids_seen = tuple(sorted(self._pids))
        pk.load = self.load.figures()
        return pk

    @property
    def pids_seen(self) -> set[int]:
        return set(self._pids)
