"""Process plumbing shared by the launcher, the ranks and the tuner's reaper (no torch)."""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

__all__ = [
    "prctl",
    "kill_descendants",
    "processes_of",
    "die_with_parent",
    "write_json_atomic",
    "leave_rank",
    "signals_caught",
    "with_pythonpath",
    "usable_cpus",
    "quota_cpus",
    "PR_SET_PDEATHSIG",
    "PR_SET_CHILD_SUBREAPER",
]

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, arg: int) -> bool:
    """Linux ``prctl(2)``; False where it is unavailable."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when its parent dies, even by SIGKILL."""
    return prctl(PR_SET_PDEATHSIG, signum)


@contextmanager
def signals_caught(signals: Sequence[int]) -> Iterator[list[int]]:
    """While in the block, each of ``signals`` is appended to the yielded list instead of acting; the old
    handlers come back on the way out. The caller polls the list.

    The handler takes no lock, on purpose. Python runs a handler in the main thread between two bytecodes,
    possibly while that thread holds a lock, e.g. inside ``threading.Event.wait``, which holds the event's
    own non-reentrant lock at moments. A handler that then calls ``Event.set`` waits forever for it: a
    trial's reaper did, and outlived its SIGKILLed tuner with the trial still running below it."""
    got: list[int] = []

    def on_signal(signum, _frame):
        got.append(signum)  # atomic under the GIL; nothing to wait for

    old = {s: signal.signal(s, on_signal) for s in signals}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def quota_cpus(cpu_max: str) -> int | None:
    """The CPUs a cgroup's CPU quota allows, from cgroup v2's ``cpu.max`` text (``"200000 100000"``: 2 CPUs;
    ``"max 100000"``: no quota, None). cgroup v1's ``cfs_quota_us`` and ``cfs_period_us`` read the same way."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] in ("max", "-1"):
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def usable_cpus() -> int:
    """The CPUs this process can keep busy: its affinity, capped by its cgroup's CPU quota. ``os.cpu_count()``
    counts the host's CPUs, which in a container limited by quota (``docker --cpus 2``) can be far more than it
    may use: a thread per host CPU in each of several processes then spins against the quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for files in (
        ("/sys/fs/cgroup/cpu.max",),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    ):
        try:
            text = " ".join(Path(f).read_text().strip() for f in files)
        except OSError:
            continue
        quota = quota_cpus(text)
        if quota is not None:
            n = min(n, quota)
    return max(1, n)


def with_pythonpath(env: dict, first: str | Path) -> dict:
    """``env`` with ``first`` put at the front of its ``PYTHONPATH`` (the rest kept after it)."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(first), env.get("PYTHONPATH", "")) if p)}


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON through a temporary file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _live(procs) -> list:
    """``procs`` less the dead and the zombies (a zombie is reaped, not signalled)."""
    import psutil

    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _reap_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_descendants(grace_s: float = 5.0, *, kill_s: float = 5.0, also: Callable[[], list] | None = None) -> list[int]:
    """SIGTERM every process below this one (and each of ``also()``: psutil processes that are not below it), wait up
    to ``grace_s``, SIGKILL the rest, wait up to ``kill_s``; reap as we go. -> the pids still alive (should be []).

    With ``PR_SET_CHILD_SUBREAPER`` set, that includes orphans whose parent died first (a rank whose launcher died,
    Ray's daemons after its driver): they are re-parented to us, not to init. The set is read again at each poll and
    a process found late gets the signal of the moment: one forked after the first listing (a Ray worker its raylet
    was starting, a daemon re-parented to us) gets its SIGTERM too, its chance to end cleanly."""
    import signal
    import time

    import psutil

    me = os.getpid()

    def live() -> list:
        try:
            procs = psutil.Process().children(recursive=True)
        except psutil.Error:
            procs = []
        if also is not None:
            seen = {p.pid for p in procs}
            procs += [p for p in also() if p.pid not in seen and p.pid != me]
        return _live(procs)

    start = time.monotonic()
    sent: set[tuple[int, int]] = set()  # (pid, signal): SIGTERM once per process, its handler runs once
    procs = live()
    while procs:
        elapsed = time.monotonic() - start
        if elapsed > grace_s + kill_s:
            break
        sig = signal.SIGTERM if elapsed < grace_s else signal.SIGKILL
        for p in procs:
            if (p.pid, sig) not in sent:
                try:
                    p.send_signal(sig)  # psutil checks the pid is still this process (no reuse)
                except psutil.Error:
                    pass
                sent.add((p.pid, sig))
        time.sleep(0.05)
        _reap_children()
        procs = live()
    _reap_children()
    return [p.pid for p in live()]


def processes_of(*, text: str | None = None, env: tuple[str, str] | None = None) -> list:
    """This user's processes (never this one) whose command line holds ``text``, whose environment has ``env`` (name,
    value) or that hold a file open under the folder ``text``: what belongs to one run wherever it was re-parented.
    Ray's daemons name their session's folder on their command line; its workers inherit the environment of the driver
    that started the session; its agents rewrite both, but every Ray process keeps its logs open in that folder."""
    import psutil

    uid, me, out = os.getuid(), os.getpid(), []
    below = text.rstrip("/") + "/" if text else None  # a file in the folder, not in one whose name starts the same
    for p in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            if p.pid == me or p.info["uids"] is None or p.info["uids"].real != uid:
                continue
            if (
                (text and text in " ".join(p.info["cmdline"] or ()))
                or (env and p.environ().get(env[0]) == env[1])
                or (below and any(f.path.startswith(below) for f in p.open_files()))
            ):
                out.append(p)
        except psutil.Error:
            pass
    return out


def leave_rank() -> None:
    """End a finished rank now: flush stdio, then exit 0 without interpreter teardown.

    Call it once the rank's work is recorded and its process group destroyed. Teardown with FSDP
    modules and gloo's threads still alive occasionally aborts ("terminate called without an active
    exception"), which the launcher would report as a failed rank (see docs/decisions.md#exit-without-teardown).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
