"""The ranks of one run on one node, started directly: no torchrun agent (no torch in this process).

:class:`RankGroup` starts ``nproc`` processes of ``python -m MODULE ARGS`` with the environment torchrun
gives its ranks (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``PORT``;
rank 0 hosts the rendezvous store, as ``init_process_group``'s ``env://`` does), and does for them what
torchrun's agent did for a single-node run:

* their output on one pipe, ``stdout``, read line by line;
* when one rank fails, the others are ended (SIGTERM, then SIGKILL after :data:`FAIL_GRACE_S`): a survivor
  would otherwise wait in a collective for the process group's whole timeout;
* ``send_signal`` reaches every rank, and each rank dies with this process (``PR_SET_PDEATHSIG``);
* ``poll``/``wait`` give the group's exit code: 0 when every rank exited 0, else the first failure's
  (a Popen code: ``-N`` for signal N).

Why not torchrun: its agent imports torch before any rank starts, which delays every cold trial and every
warm job's start (see docs/decisions.md#ranks-without-torchrun).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from trainer.launch.proc import die_with_parent, usable_cpus, with_pythonpath

__all__ = ["RankGroup", "rank_env", "FAIL_GRACE_S"]

#: once a rank has failed, how long the others get between SIGTERM and SIGKILL
FAIL_GRACE_S = 10.0
_POLL_S = 0.05


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _free_port() -> int:
    """A port for rank 0's rendezvous store, free now and below the kernel's ephemeral range: rank 0 binds
    it only once torch is imported (seconds later), and in between an outgoing connection of any process on
    the host could be given an ephemeral port (what ``bind(0)`` returns) and take it. 64 random tries, then
    any free port."""
    low = _ephemeral_low()
    tries = [random.randrange(max(1024, low // 2), low) for _ in range(64)] if low > 2048 else []
    for port in [*tries, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                if port == 0:
                    raise
                continue
            return s.getsockname()[1]
    raise AssertionError("unreachable: port 0 either binds or raises")


def rank_env(base: dict, *, rank: int, nproc: int, port: int) -> dict:
    """The environment of local rank ``rank`` of ``nproc`` on one node (what ``torchrun --standalone`` sets
    that the ranks read), with ``OMP_NUM_THREADS`` splitting the usable cores (:func:`usable_cpus`) unless the
    caller set it."""
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


class RankGroup:
    """``nproc`` ranks of ``python -m MODULE ARGS`` as one job (see the module's docstring)."""

    def __init__(self, module_argv: Sequence[str], *, nproc: int, env: Optional[dict] = None):
        base = with_pythonpath(dict(os.environ if env is None else env), Path(__file__).resolve().parent.parent)
        port = _free_port()
        read_fd, write_fd = os.pipe()
        self._procs: list[subprocess.Popen] = []
        try:
            for rank in range(nproc):
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", *module_argv],
                        stdout=write_fd,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=rank_env(base, rank=rank, nproc=nproc, port=port),
                        # until the rank sets its own (SIGKILL, trainer/rank/run.py), it ends with us too
                        preexec_fn=lambda: die_with_parent(signal.SIGTERM),
                    )
                )
        except BaseException:
            self.send_signal(signal.SIGKILL)
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.stdout = open(read_fd, "r", errors="replace")
        self.returncode: Optional[int] = None
        self.failed_rank: Optional[int] = None
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="ppotune-ranks", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _watch(self) -> None:
        first: Optional[tuple[int, int]] = None  # (rank, its code): the first rank seen failing
        kill_at: Optional[float] = None
        while True:
            codes = [p.poll() for p in self._procs]
            if all(c is not None for c in codes):
                break
            if first is None:
                first = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
                if first is not None:
                    self.send_signal(signal.SIGTERM)
                    kill_at = time.monotonic() + FAIL_GRACE_S
            elif kill_at is not None and time.monotonic() >= kill_at:
                self.send_signal(signal.SIGKILL)
                kill_at = None
            time.sleep(_POLL_S)
        if first is None:
            first = next(((r, c) for r, c in enumerate(codes) if c != 0), None)
        self.failed_rank = first[0] if first else None
        self.returncode = first[1] if first else 0
        self._done.set()

    # ---- the subprocess.Popen surface the launcher uses (safe in a signal handler: no lock taken)
    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("ranks", timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        for p in self._procs:
            if p.returncode is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
