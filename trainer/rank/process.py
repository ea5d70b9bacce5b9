"""A rank's process (torch, imported inside the functions): its start, its status file, its failure.

:func:`start_rank` sets up what a rank keeps across trials (device, process group, the result's
``environment``); :func:`new_state` is the rank's status file (``<rank-dir>/rank<r>.json``) before anything
ran, :func:`on_sigterm_write` and :func:`fail_rank` what it says when the rank is stopped or fails. An OOM anywhere
is caught, recorded, and the rank exits at once (code 3): its peers, blocked in a collective, are then ended
by the launcher, which reads the files. The host-memory bookkeeping a trial counts from
(:class:`MemoryLevel`, :func:`malloc_trim`) and its cap (:func:`apply_memory_limit`) live here too.

torch is imported inside the functions: a rank's entry (trainer/rank/run.py, trainer/rank/serve.py) sets its
signal handling before the slow import, so a failure while importing is recorded like any other.
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Optional

from trainer.contracts import ExitCode, MemoryMessage, MemoryOutcome, memory_message
from trainer.launch.proc import write_json_atomic

__all__ = [
    "is_oom_error",
    "start_rank",
    "RankProcess",
    "MemoryLevel",
    "malloc_trim",
    "apply_memory_limit",
    "cap_device_memory",
    "fail_rank",
    "new_state",
    "on_sigterm_write",
]


def _memory_failure(exc: BaseException) -> Optional[MemoryMessage]:
    """The entry of trainer.contracts.MEMORY_MESSAGES (the table verl's log is read with too) that the exception's
    type and message say; a ``MemoryError`` of any name is Python's."""
    found = memory_message(f"{type(exc).__name__}: {exc}")
    if found is None and isinstance(exc, MemoryError):
        found = memory_message("MemoryError")
    return found


def is_oom_error(exc: BaseException) -> bool:
    """An OOM of :data:`trainer.contracts.MEMORY_MESSAGES`: CUDA's, the CPU allocator's under an rlimit, Python's,
    NCCL's, a colocated vLLM engine that cannot get its ``gpu_memory_utilization`` share of the device. Not an engine
    whose share is too small to hold a sequence: more memory is what it needs (:func:`fail_rank` records it)."""
    found = _memory_failure(exc)
    return found is not None and found.outcome is MemoryOutcome.OOM


def apply_memory_limit(limit_gb: float | None, device, notes: list[str], *, base_bytes: int) -> None:
    """A real cap: on GPU the allocator's per-process fraction; on CPU RLIMIT_DATA, ``limit_gb`` of
    private writable memory above ``base_bytes`` (what the rank holds once torch and the process group are up).

    RLIMIT_DATA, not RLIMIT_AS: address-space reservations (malloc arenas, thread stacks) make an
    AS cap fire at a different point on every run; a data cap fails where the memory is used.
    """
    if limit_gb is None:
        return
    if device.type == "cuda":
        cap_device_memory(limit_gb, device)
        return
    base = base_bytes  # in use: a run first reuses what malloc holds free, then grows VmData up to the cap
    cap = int(base + limit_gb * 1024**3)
    # the soft limit (what the kernel enforces): a warm job lifts it again after the trial (serve.py)
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    resource.setrlimit(resource.RLIMIT_DATA, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    notes.append(
        f"ppotune.memory_limit_gb: CPU cap is RLIMIT_DATA = {base / 1024**3:.2f} GiB in use at the start "
        f"+ {limit_gb} GiB"
    )


def cap_device_memory(limit_gb: float, device, *, unmapped_bytes: int = 0) -> None:
    """The CUDA cap: torch's per-process fraction, so that what the allocator holds on the device stays under
    ``limit_gb``. The fraction counts every segment the allocator reserved (c10/cuda/CUDACachingAllocator.cpp
    alloc_block: ``total_allocated_memory + size > allowed_memory_maximum``), a sleeping vLLM engine's unmapped
    pool segments included: ``unmapped_bytes`` of them are allowed on top, so the cap is on what the device holds."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (limit_gb * 1024**3 + unmapped_bytes) / total), device)


def _environment(device, world: int) -> dict:
    import torch
    import transformers

    name, total = platform.processor() or "cpu", None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total = props.name, props.total_memory / 1024**3
    return {
        "device": device.type,
        "device_name": name,
        "device_memory_total_gb": total,
        "world_size": world,
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }


def new_state() -> dict:
    """A rank's status file, before anything ran: an error until the run says otherwise."""
    return {"status": "error", "error": None, "phase": "setup", "steps": [], "notes": [], "environment": None}


def on_sigterm_write(current: dict) -> None:
    """On SIGTERM write ``current["state"]`` to ``current["rank_file"]`` and exit. The launcher SIGTERMs the peers
    of a failed rank: say so, so the launcher can tell the rank that died first (no status file) from the
    ones that were stopped. ``current`` is read when the signal comes (a warm job points it at each trial)."""

    def handler(signum, _frame):
        state = current["state"]
        # A rank that already recorded its own failure keeps it (fail_rank blocks SIGTERM; this is the backstop)
        if state.get("status") == "error" and state.get("error") is None:
            state["error"] = f"stopped by signal {signum} (the launcher ends the other ranks when one fails)"
        try:
            write_json_atomic(current["rank_file"], state)
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def fail_rank(exc: BaseException, rank: int, rank_file: Path, state: dict) -> NoReturn:
    """Record a failure in the rank's status file and leave at once (3 for an OOM, 1 else)."""
    # When two ranks fail together the launcher SIGTERMs this one while it records its own failure: the
    # handler would replace this rank's error with "stopped by signal". Block the signal; we exit below anyway.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    found = _memory_failure(exc)
    oom = found is not None and found.outcome is MemoryOutcome.OOM
    state["status"] = "oom" if oom else "error"
    error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if found is not None and found.outcome is MemoryOutcome.UNDERSIZED:  # a config refusal: the fit's lower bound
        error = found.error(error)
    state["error"] = error[:500]
    state["traceback"] = traceback.format_exc()[-4000:]
    try:
        write_json_atomic(rank_file, state)
    except OSError:
        pass
    print(f"[rank {rank}] {state['status']} in phase {state['phase']}: {state['error']}", file=sys.stderr, flush=True)
    # Peers may be blocked in a collective: leave now, the launcher ends them.
    os._exit(ExitCode.OOM if oom else ExitCode.ERROR)


def malloc_trim() -> None:
    """Hand the free memory glibc's malloc still holds back to the OS (``malloc_trim(0)``); no-op elsewhere."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _malloc_free_bytes() -> int:
    """Bytes glibc's malloc holds free in its arenas (``mallinfo2().fordblks``); 0 where unknown (not glibc)."""
    import ctypes

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]  # fmt: skip

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    fn.restype = _Mallinfo2
    return int(fn().fordblks)


@dataclass(frozen=True)
class MemoryLevel:
    """A rank's host memory at one moment: resident (GiB), and private writable bytes in use: VmData (what
    RLIMIT_DATA counts) less what malloc holds free (memory the process reuses before it asks the OS for more,
    so a cap counted from VmData alone would let a run use it on top of the limit)."""

    rss_gb: float
    data_bytes: int

    @classmethod
    def now(cls) -> "MemoryLevel":
        from trainer.engine.metrics import rss_now_gb, vm_data_bytes

        return cls(rss_now_gb() or 0.0, (vm_data_bytes() or 0) - _malloc_free_bytes())

    def __sub__(self, other: "MemoryLevel") -> "MemoryLevel":
        return MemoryLevel(self.rss_gb - other.rss_gb, self.data_bytes - other.data_bytes)


@dataclass(frozen=True)
class RankProcess:
    """What a rank sets up once, before any trial: its device and the process group."""

    device: Any  # torch.device
    world: int
    environment: dict  # the result's ``environment``


def start_rank(cfg) -> RankProcess:
    """The device and the process group (``ppotune.device``, ``ppotune.dist_timeout_s``) of this rank."""
    import torch
    import torch.distributed as dist

    want = cfg.ppotune.device
    use_cuda = torch.cuda.is_available() if want == "auto" else want == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("ppotune.device=cuda but no CUDA device is visible")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        timeout=datetime.timedelta(seconds=cfg.ppotune.dist_timeout_s),
        **({"device_id": device} if use_cuda else {}),
    )
    # The cap counts from after this: the runtime's own threads (intra-op pool, gloo) are up, so their
    # stacks do not eat the budget differently on a machine with more cores.
    torch.ones(1 << 16).sum()
    world = dist.get_world_size()
    return RankProcess(device=device, world=world, environment=_environment(device, world))
