"""Memory of a trial, read from outside: NVML (device + per-process) or, without NVML, psutil RSS.

:class:`MemorySampler` is a thread that samples at ``hz`` (>= 10) until stopped and keeps
peaks. With NVML it reads, for each of the trial's GPUs, the device's used memory and the
memory of the trial's own processes (``nvmlDeviceGetComputeRunningProcesses`` filtered to
the trial's process tree) - that includes the CUDA context and NCCL buffers torch's
allocator never sees. Without NVML (``nvmlInit`` raises, e.g. no driver) it sums the RSS of
the trial's process tree. ``source`` says which: ``"nvml"`` or ``"psutil"``.

The trial's GPUs are CUDA_VISIBLE_DEVICES entries, which name devices in CUDA's terms (an ordinal in CUDA's
device order, a UUID or a unique prefix of one, a MIG device); :func:`resolve_gpus` finds each in NVML as CUDA
would, by UUID and PCI bus ID, never by NVML's index. An entry it cannot resolve, or whose device it can only
guess (FASTEST_FIRST on a node of mixed models), is a line in ``MemoryPeaks.notes``.

Like NVML's per-GPU figure, the psutil objective is per rank: the peak RSS of the largest single
process of the tree (on CPU a rank stands for a GPU, and ``--memory-limit-gb`` caps each process).
The summed RSS of the whole tree is kept beside it (``tree_rss_peak_gb``).

The sampler also keeps a bounded :class:`Timeline` of what the trial held (``time.time()``: the clock verl's plugin
stamps its phases with, on the same host): per GPU the trial's processes' NVML memory (the device's used memory where
NVML's PIDs never matched the trial's), or on a CPU the largest process's RSS, each on the basis of the external peak.
:func:`held_in_windows` reads it over a run's phase windows (trainer.verl_engine.plugin): what the trial held in each
phase, vLLM's servers included while they are awake and not while they sleep.

The same thread meters the trial's load (:class:`LoadMeter`): the host's CPU time spent outside the trial's
process tree and outside the tuner itself, and other processes on the trial's GPUs (NVML). A trial measured beside
another job runs slower for a reason that is not its knobs: :func:`is_loaded` marks it, and the confirmation claims
nothing from a round with such a run.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import psutil

from tuner.trials.timeline import Timeline

__all__ = [
    "MemoryPeaks",
    "MemorySampler",
    "LoadMeter",
    "host_load",
    "LOADED_CPU_SHARE",
    "is_loaded",
    "nvml_available",
    "visible_gpus",
    "cuda_order",
    "resolve_gpus",
    "resolve_visible",
    "Resolved",
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
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs) in CUDA's reading: a
    negative index ends the list (the CUDA Programming Guide, "CUDA Environment Variables": ``0,2,-1,1`` makes
    devices 0 and 2 visible)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        out = []
        for d in (d.strip() for d in env.split(",")):
            if not d or d.startswith("-"):
                break
            out.append(d)
        return out
    if not nvml_available():
        return []
    import pynvml

    return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]


# ---------------------------------------------------------------------------- CUDA's devices in NVML's terms
# What a CUDA_VISIBLE_DEVICES entry names, as CUDA reads it (the CUDA Programming Guide, "CUDA Environment
# Variables": CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER; torch mirrors the driver's parser in
# torch/cuda/__init__.py::_parse_visible_devices and ::_transform_uuid_to_ordinals):
# * an index is a CUDA ordinal. With CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA orders the devices "by PCI bus ID in
#   ascending order"; the default, FASTEST_FIRST, "in fastest to slowest order using a simple heuristic" that is
#   documented no further (commonly: compute capability descending, ties by PCI bus ID). NVML numbers devices in
#   its own order and promises neither, so each device is placed by its PCI bus ID here, never by NVML's index;
# * a UUID may be cut to a prefix that names exactly one GPU; an ambiguous or unknown one, like a negative index,
#   ends what CUDA makes visible;
# * a MIG device is named by its own UUID ("MIG-...") or, in CUDA 11.0's form, "MIG-GPU-<uuid>/<gi>/<ci>"; an
#   index names no MIG device for NVML.


@dataclass(frozen=True)
class _Gpu:
    """One physical GPU as NVML sees it."""

    handle: object
    uuid: str
    bus: tuple  # (domain, bus, device): PCI_BUS_ID's order
    name: str
    capability: tuple  # (major, minor)
    mig: tuple = ()  # MIG mode on: ((uuid, handle, gpu instance id, compute instance id), ...) of its MIG devices


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _mig_devices(pynvml, h) -> tuple:
    try:
        if pynvml.nvmlDeviceGetMigMode(h)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return ()
    except pynvml.NVMLError:  # NotSupported: a GPU without MIG
        return ()
    out = []
    for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except pynvml.NVMLError:  # NotFound: an empty slot
            continue
        gi, ci = pynvml.nvmlDeviceGetGpuInstanceId(m), pynvml.nvmlDeviceGetComputeInstanceId(m)
        out.append((_text(pynvml.nvmlDeviceGetUUID(m)), m, gi, ci))
    return tuple(out)


def _nvml_gpus() -> list[_Gpu]:
    """Every GPU NVML sees (in NVML's order, which means nothing to CUDA)."""
    import pynvml

    gpus = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        pci = pynvml.nvmlDeviceGetPciInfo(h)
        gpus.append(
            _Gpu(
                handle=h,
                uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                bus=(pci.domain, pci.bus, pci.device),
                name=_text(pynvml.nvmlDeviceGetName(h)),
                capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                mig=_mig_devices(pynvml, h),
            )
        )
    return gpus


def cuda_order(gpus: Sequence[_Gpu], device_order: Optional[str]) -> tuple[list[_Gpu], Optional[str]]:
    """``gpus`` in CUDA's ordinal order under ``CUDA_DEVICE_ORDER`` and, when that order is a guess, why."""
    by_bus = sorted(gpus, key=lambda g: g.bus)
    if (device_order or "").strip().upper() == "PCI_BUS_ID":
        return by_bus, None
    fastest = sorted(by_bus, key=lambda g: (-g.capability[0], -g.capability[1]))  # stable: ties by PCI bus ID
    models = sorted({g.name for g in gpus})
    if len(models) < 2:  # one model: the heuristic has nothing to tell apart
        return fastest, None
    return fastest, (
        f"GPU indices read in CUDA's FASTEST_FIRST order (CUDA_DEVICE_ORDER unset) on a node of {' and '.join(models)}:"
        " CUDA documents that order only as a heuristic, taken here as compute capability descending, then PCI bus"
        " ID; set CUDA_DEVICE_ORDER=PCI_BUS_ID or name the GPUs by UUID for a certain mapping"
    )


def _uuid_candidates(entry: str, gpus: Sequence[_Gpu]) -> list[tuple[str, object]]:
    """(UUID, NVML handle) of each device whose UUID starts with ``entry`` (a whole GPU or a MIG device)."""
    if entry.startswith("MIG-GPU-") and "/" in entry:  # CUDA 11.0's form: MIG-GPU-<uuid>/<gi>/<ci>
        parent, _, ids = entry[len("MIG-") :].partition("/")
        return [(u, m) for g in gpus if g.uuid.startswith(parent) for u, m, gi, ci in g.mig if f"{gi}/{ci}" == ids]
    if entry.startswith("MIG-"):
        return [(u, m) for g in gpus for u, m, _, _ in g.mig if u.startswith(entry)]
    # CUDA documents UUIDs with their "GPU-" prefix; one given without it is matched in its GPU- form
    full = entry if entry.startswith("GPU-") else "GPU-" + entry
    return [(g.uuid, g) for g in gpus if g.uuid.startswith(full)]


def _by_uuid(entry: str, gpus: Sequence[_Gpu]) -> tuple[object, Optional[str]]:
    """(NVML handle, None) of the one device whose UUID starts with ``entry``, or (None, why not)."""
    cands = _uuid_candidates(entry, gpus)
    if not cands:
        return None, f"{entry}: no GPU or MIG device has a UUID that starts so"
    if len(cands) > 1:
        return None, f"{entry}: ambiguous, a prefix of {len(cands)} UUIDs ({', '.join(sorted(u for u, _ in cands))})"
    found = cands[0][1]
    if isinstance(found, _Gpu):
        if found.mig:  # CUDA sees its MIG devices, not the GPU: which one the trial got is not in the entry
            return None, f"{entry}: GPU {found.uuid} is in MIG mode; name one of its MIG devices (MIG-...)"
        return found.handle, None
    return found, None


def _by_index(entry: str, ordered: Sequence[_Gpu]) -> tuple[object, Optional[str]]:
    """(NVML handle, None) of the CUDA ordinal ``entry`` (read like strtoul, as CUDA does), or (None, why not)."""
    digits = entry.lstrip("+")
    k = int(digits[: len(digits) - len(digits.lstrip("0123456789"))] or -1)
    if not 0 <= k < len(ordered):
        return None, f"{entry}: no CUDA device {k} among {len(ordered)}"
    if ordered[k].mig:
        return None, f"{entry}: GPU {ordered[k].uuid} is in MIG mode; an index names none of its MIG devices"
    return ordered[k].handle, None


@dataclass
class Resolved:
    """What CUDA_VISIBLE_DEVICES entries name in NVML: a handle per entry resolved, and a note per doubt."""

    handles: list
    notes: list


def resolve_gpus(entries: Sequence[str], *, gpus: Sequence[_Gpu], device_order: Optional[str]) -> Resolved:
    """NVML handles of ``entries`` (CUDA_VISIBLE_DEVICES entries), resolved as CUDA resolves them; an entry that
    cannot be, and any after it (CUDA makes none of them visible), is noted and left out."""
    ordered, doubt = cuda_order(gpus, device_order)
    handles: list = []
    notes: list[str] = []
    for n, entry in enumerate(entries):
        by_index = entry[:1].isdigit() or entry[:1] in ("+", "-")
        handle, why = _by_index(entry, ordered) if by_index else _by_uuid(entry, gpus)
        if handle is not None:
            handles.append(handle)
            if by_index and doubt and doubt not in notes:
                notes.append(doubt)
            if not by_index and not entry.startswith(("GPU-", "MIG-")):
                notes.append(
                    f"CUDA_VISIBLE_DEVICES entry {entry} read as GPU-{entry}: CUDA documents UUIDs with their GPU-"
                    " prefix, and torch's parser stops at an entry without it"
                )
            continue
        rest = entries[n + 1 :]
        after = f" (and {', '.join(rest)} after it, which CUDA then does not make visible)" if rest else ""
        notes.append(f"CUDA_VISIBLE_DEVICES entry {why}{after}: its memory is not read through NVML")
        break
    return Resolved(handles, notes)


def resolve_visible(entries: Sequence[str]) -> Resolved:
    """:func:`resolve_gpus` over the GPUs NVML sees, in this process's CUDA_DEVICE_ORDER (which the trials
    inherit); no handles, and a note why, when NVML cannot list them."""
    try:
        gpus = _nvml_gpus()
    except Exception as e:  # noqa: BLE001 - an NVML that cannot list its devices measures nothing
        return Resolved([], [f"NVML could not list the GPUs ({type(e).__name__}: {e})"])
    return resolve_gpus(list(entries), gpus=gpus, device_order=os.environ.get("CUDA_DEVICE_ORDER"))


def gpu_info(ident: str = "0") -> tuple[Optional[str], Optional[float]]:
    """(name, total memory GB) of a GPU, or (None, None) without NVML."""
    if not nvml_available():
        return None, None
    import pynvml

    try:
        resolved = resolve_visible([ident])
        if not resolved.handles:
            return None, None
        h = resolved.handles[0]
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
    # why the figures are not what they claim to be (a GPU NVML could not resolve, a device order guessed): one
    # line each, for the trial's notes
    notes: list = field(default_factory=list)
    # what the trial held over time, on the external peak's basis (None: not sampled)
    timeline: Optional[Timeline] = None

    def to_dict(self) -> dict:
        d = asdict(dataclasses.replace(self, timeline=None))
        for key in ("pids_seen", "load", "timeline"):
            d.pop(key)
        return d


def is_loaded(cpu_others_share: Optional[float], gpu_other_processes: int) -> bool:
    """Was a trial measured under load? Other processes on its GPUs, or more than :data:`LOADED_CPU_SHARE` of the
    host's CPUs busy outside it on average (None: not metered, not loaded)."""
    return gpu_other_processes > 0 or (cpu_others_share is not None and cpu_others_share > LOADED_CPU_SHARE)


def _busy_s(times) -> float:
    """CPU seconds a ``psutil.cpu_times()`` reading spent busy (not idle, not waiting for I/O)."""
    idle = getattr(times, "idle", 0.0) + getattr(times, "iowait", 0.0)
    return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


#: why the other processes on a trial's GPUs are not known (LoadMeter.note)
GPU_OTHERS_UNKNOWN = (
    "NVML lists processes on the trial's GPUs, none of them in its process tree: NVML gives the host's PIDs (the "
    "driver knows no PID namespace) and this tuner sees another namespace's (a container without --pid=host), where "
    "/proc shows no way to map them. Other processes on its GPUs are unknown: the load reading counts CPUs only "
    "(run the container with --pid=host to count them)"
)


class LoadMeter:
    """What runs beside a trial: the host's busy CPU time less the trial's process tree's and the tuner's own (the
    tuner and every process it started; each process's CPU time counted from when it was first seen), and the other
    processes on its GPUs (NVML: those not in its tree).

    NVML reports the PIDs the driver sees, the host's, whatever namespace asks; psutil's are those of the namespace
    whose /proc it reads. In the host's namespace they match. In a container without the host's, none of NVML's
    matches the trial's, and nothing here can map them: ``/proc/<pid>/status``'s ``NSpid`` lists a process's PIDs
    from the namespace of the /proc being read inward, so inside the container it holds the container's PID only (the
    host's appears only in the host's /proc, where psutil's PIDs are the host's already). Guessing how many of the
    listed processes are the trial's fails with a colocated vLLM (two of the trial's processes per GPU under verl): so
    once NVML's processes never include one of the trial's, the other processes are "unknown", never load."""

    def __init__(self) -> None:
        self._t0: Optional[float] = None
        self._busy0 = 0.0
        self._last: tuple = (0.0, 0.0)  # (monotonic, host busy seconds) at the last sample
        self._cpu: dict[int, tuple[float, float]] = {}  # pid -> (CPU seconds when first seen, last seen)
        self._me = psutil.Process()
        self.gpu_others = 0
        self.gpu_other_bytes = 0
        self._matched = False  # an NVML process was one of the trial's: NVML and psutil share a PID namespace
        self._unmatched = (0, 0)  # (most processes, their bytes) on a GPU at a sample where none was the trial's

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
        others = [pr for pr in running if pr.pid not in pids]
        held = sum(getattr(pr, "usedGpuMemory", 0) or 0 for pr in others)
        if len(others) < len(running):
            self._matched = True
            self.gpu_others = max(self.gpu_others, len(others))
            self.gpu_other_bytes = max(self.gpu_other_bytes, held)
        else:  # none is the trial's: it has not reached the GPU yet, or NVML's PIDs are another namespace's
            self._unmatched = (max(self._unmatched[0], len(others)), max(self._unmatched[1], held))

    @property
    def gpu_known(self) -> bool:
        """Whether the other processes on the trial's GPUs can be told: NVML listed one of the trial's (processes
        listed when none was are others too: the trial had not reached the GPU), or never listed any."""
        return self._matched or self._unmatched[0] == 0

    def note(self) -> Optional[str]:
        """Why the load reading says nothing of the GPUs, when it cannot (None: it can)."""
        return None if self.gpu_known else GPU_OTHERS_UNKNOWN

    def figures(self) -> Optional[dict]:
        """``{cpu_others, cpu_others_share, cpu_trial, gpu_other_processes, gpu_other_memory_gb, loaded}`` (CPUs
        busy on average over the window; TrialRecord.load), or None for a window too short to say."""
        if self._t0 is None or self._last[0] - self._t0 < _MIN_METERED_S:
            return None
        wall = self._last[0] - self._t0
        ours = sum(last - first for first, last in self._cpu.values())
        others = max(0.0, (self._last[1] - self._busy0) - ours) / wall
        share = others / float(psutil.cpu_count() or 1)
        gpu = max(self.gpu_others, self._unmatched[0]) if self._matched else self.gpu_others
        held = max(self.gpu_other_bytes, self._unmatched[1]) if self._matched else self.gpu_other_bytes
        return {
            "cpu_others": round(others, 3),
            "cpu_others_share": round(share, 3),
            "cpu_trial": round(ours / wall, 3),
            "gpu_other_processes": gpu if self.gpu_known else "unknown",
            "gpu_other_memory_gb": round(held / GIB, 3) if self.gpu_known else None,
            "loaded": is_loaded(share, gpu if self.gpu_known else 0),
        }


def _running(handle) -> list:
    """NVML's compute processes on one GPU (``pid``, ``usedGpuMemory``): what the sampler and the load read."""
    import pynvml

    return list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))


#: how often a reading of the host's load samples: a trial's own meter's rate (MemorySampler's 10 Hz), so the tuner's
#: own processes that start and end inside a window are counted as its own, as they are in a trial
_LOAD_SAMPLE_S = 0.1


def host_load(window_s: float, *, wait: Callable[[float], object] = time.sleep) -> Optional[dict]:
    """The load a trial started now would be measured under: :class:`LoadMeter` run over ``window_s`` seconds with
    no trial (every process outside this tuner's tree is another's: the same definition a trial's load has,
    :func:`is_loaded`), NVML's processes on this tuner's GPUs counted as the meter counts them. Its figures
    (``loaded`` among them), or None when the window said nothing or ``wait`` said stop (an Event's wait: True)."""
    meter = LoadMeter()
    end = time.monotonic() + window_s
    while True:
        meter.sample([])
        left = end - time.monotonic()
        if left <= 0:
            break
        if wait(min(_LOAD_SAMPLE_S, left)):
            return None
    if nvml_available():
        mine = {p.pid for p in process_tree(os.getpid())}
        for h in resolve_visible(visible_gpus()).handles:
            try:
                meter.gpu(_running(h), mine)
            except Exception:  # noqa: BLE001 - a GPU NVML cannot read adds no load to the reading
                continue
    return meter.figures()


class MemorySampler(threading.Thread):
    """Sample a process tree's memory at ``hz`` until :meth:`stop`; keep the peaks."""

    def __init__(self, root_pid: int, *, gpus: Optional[Sequence[str]] = None, use_nvml: bool = True, hz: float = 10.0):
        super().__init__(name=f"memory-sampler-{root_pid}", daemon=True)
        assert hz >= 10.0, "sample at 10 Hz or more: short phases peak for well under a second"
        self.root_pid = root_pid
        self.interval_s = 1.0 / hz
        self._stop_event = threading.Event()
        self._handles = []
        notes: list[str] = []
        if use_nvml and nvml_available():
            resolved = resolve_visible([str(g) for g in (gpus if gpus is not None else visible_gpus())])
            self._handles, notes = resolved.handles, resolved.notes
            if not self._handles:
                notes.append("no GPU of the trial resolved in NVML: its memory is the process tree's RSS (psutil)")
        self.source = "nvml" if self._handles else "psutil"
        self.peaks = MemoryPeaks(external_source=self.source, notes=notes)
        self.load = LoadMeter()
        self._pids: set[int] = set()
        # per GPU the trial's processes and the device's used memory (NVML), or the largest process's RSS: the one
        # on the external peak's basis becomes MemoryPeaks.timeline at stop()
        self._held, self._used = Timeline(), Timeline()

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
        now = time.time()
        pk = self.peaks
        pk.samples += 1
        if procs:
            pk.tree_rss_peak_gb = max(pk.tree_rss_peak_gb or 0.0, rss / GIB)
            pk.process_rss_peak_gb = max(pk.process_rss_peak_gb or 0.0, largest / GIB)
            if not self._handles:
                self._held.add(now, (largest / GIB,))
        if self._handles:
            import pynvml

            dev_used, proc_used = 0, 0
            held, used = [], []
            for h in self._handles:
                try:
                    used.append(pynvml.nvmlDeviceGetMemoryInfo(h).used)
                    dev_used = max(dev_used, used[-1])
                    running = _running(h)
                    self.load.gpu(running, pids)
                    mine = sum((getattr(pr, "usedGpuMemory", None) or 0) for pr in running if pr.pid in pids)
                    held.append(mine)
                    proc_used = max(proc_used, mine)
                except Exception:
                    continue
            self._held.add(now, [b / GIB for b in held])
            self._used.add(now, [b / GIB for b in used])
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
            pk.timeline = self._held if pk.process_peak_gb is not None else self._used
        else:
            pk.external_peak_gb = pk.process_rss_peak_gb
            pk.timeline = self._held
        pk.pids_seen = tuple(sorted(self._pids))
        pk.load = self.load.figures()
        if self.load.note() is not None and pk.load is not None:
            pk.notes.append(self.load.note())
        return pk

    @property
    def pids_seen(self) -> set[int]:
        return set(self._pids)
