"""One trial as a subprocess: its own process group, a hard timeout, a log, a classification.

The tuner starts ``python -m tuner.trials.launch --reap ... -- ppotune train ...`` in a new session.
That tiny wrapper ("reaper") is what makes a trial die with the tuner:

* it sets ``PR_SET_PDEATHSIG`` (SIGTERM when the tuner dies, even by SIGKILL) and
  ``PR_SET_CHILD_SUBREAPER`` (a rank whose launcher died is re-parented to the wrapper, not
  to init, so it is still found);
* on SIGTERM it terminates its whole tree (process group + every descendant): SIGTERM,
  a grace period, then SIGKILL; when the trial exits by itself it kills any leftover.

The tuner's side (:func:`launch_trial`) waits with a hard timeout, samples memory
(:mod:`tuner.trials.memory`), and classifies the finished process from its exit code and result
JSON (:func:`classify`): ``ok | oom | hang | crash | invalid`` (+ ``interrupted`` when the
tuner itself is stopping).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import psutil

from trainer.contracts import ExitCode, Status, undersized
from trainer.launch.proc import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    kill_descendants,
    prctl,
    signals_caught,
    with_pythonpath,
)
from tuner.memory_model.floor import BELOW_FLOOR
from tuner.trials.memory import MemoryPeaks, MemorySampler
from tuner.trials.watch import PollVerdict, StepWatch, poll_trial, timeout_reason, total_timeout_text

__all__ = [
    "add_hang_flags",
    "STARTUP_TIMEOUT_S",
    "STEP_TIMEOUT_S",
    "HANG_MARGIN",
    "positive_seconds",
    "stop_on_signals",
    "next_numbered_dir",
    "TrialRun",
    "train_command",
    "launch_trial",
    "finished_run",
    "classify",
    "log_tail",
    "read_result",
    "start_reaped",
    "terminate_reaped",
    "kill_leftovers",
    "REPO_ROOT",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
_SIGNAL_POLL_S = 0.05  # how soon a caught SIGINT/SIGTERM is acted on (the reaper, the stop event)


@dataclass
class TrialRun:
    status: Status  # OK | OOM | HANG | CRASH | INVALID | INTERRUPTED
    error: Optional[str]
    returncode: Optional[int]
    result: Optional[dict]
    duration_s: float
    log_path: str
    result_path: str
    log_tail: Optional[str] = None
    memory: MemoryPeaks = field(default_factory=MemoryPeaks)
    leftover_pids: list = field(default_factory=list)  # processes still alive after cleanup (should be [])


def train_command(
    config_path: str | Path, *, result_path: str | Path, engine: str = "ppotune", python: str = sys.executable
) -> list[str]:
    """``ppotune train CONFIG --result FILE`` through ``python -m tuner.cli`` (works without the console
    script). The config file is complete (world size, steps, warm-up, memory cap): no flag repeats it.
    ``engine="verl"``: CONFIG is a verl run file (trainer.verl_engine.adapter)."""
    cmd = [python, "-m", "tuner.cli", "train", str(config_path), "--result", str(result_path)]
    return cmd if engine == "ppotune" else [*cmd, "--engine", engine]


def log_tail(path: str | Path, *, lines: int = 40, max_chars: int = 4000) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    tail = "\n".join(text.splitlines()[-lines:])
    return tail[-max_chars:] or None


def classify(
    returncode: Optional[int],
    result: Optional[dict],
    *,
    timed_out: bool = False,
    interrupted: bool = False,
    timeout_s: Optional[float] = None,
    timeout_reason: Optional[str] = None,
    stderr_hint: Optional[str] = None,
) -> tuple[Status, Optional[str]]:
    """(status, one-line error) of a finished trial process.

    ``invalid``: the config was refused (exit code 2, or a result error starting with
    ``config:``); ``oom``: result status oom; ``crash``: a signal, an exit without a result
    file, or any other error; ``hang``: one of our timeouts fired first (``timeout_reason`` says which).
    """
    if interrupted:
        return Status.INTERRUPTED, "interrupted: the tuner was stopped while the trial ran"
    if timed_out:
        why = timeout_reason or (total_timeout_text(timeout_s) if timeout_s is not None else "trial timed out")
        return Status.HANG, f"{why}; trial process group killed"
    if result is not None:
        status, error = result.get("status"), result.get("error")
        if status == "ok":
            thr = (result.get("summary") or {}).get("throughput")
            if thr is None:
                return Status.CRASH, "result status ok but no measured throughput (no step after warm-up?)"
            return Status.OK, None
        if status == "oom":
            return Status.OOM, error or "out of memory"
        if status == "error" and BELOW_FLOOR in (error or ""):
            # this config's states alone are over the trial's cap: out of memory there, as hungrier configs are
            return Status.OOM, error
        if status == "error":
            # a rank's "failed in phase ...: config: <key> too small" (vLLM's share) is the config's, as verl's is
            if (error or "").startswith("config:") or returncode == ExitCode.USAGE or undersized(error):
                return Status.INVALID, error
            return Status.CRASH, error or f"exit code {returncode}"
        return Status.CRASH, f"result file has unknown status {status!r}"
    if returncode is None:
        return Status.CRASH, "the trial process did not exit"
    if returncode == ExitCode.USAGE:
        return Status.INVALID, stderr_hint or "config refused (exit code 2)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return Status.CRASH, f"killed by {name} without a result file"
    if returncode == ExitCode.OOM:
        return Status.OOM, "exit code 3 (out of memory) without a result file"
    return Status.CRASH, f"exited with code {returncode} without a result file"


def read_result(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the result JSON, None) or (None, why it could not be read); (None, None) when there is none."""
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return None, f"unreadable result file: {e}"
    if not isinstance(data, dict):
        return None, "result file is not a JSON object"
    return data, None


def _last_error_line(path: Path) -> Optional[str]:
    tail = log_tail(path, lines=20) or ""
    for line in reversed(tail.splitlines()):
        if "error" in line.lower():
            return line.strip()
    return None


def _alive(pids: Sequence[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _trial_env(extra_env: Optional[dict]) -> dict:
    env = with_pythonpath(dict(os.environ), REPO_ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's indices == NVML's indices
    if extra_env:
        env.update({k: str(v) for k, v in extra_env.items() if v is not None})
    return env


def positive_seconds(text: str) -> float:
    """argparse ``type=`` of a timeout flag: seconds, > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


#: the hang limits of a command that launches runs (``--startup-timeout``, ``--step-timeout``), in seconds; a search
#: draws its own from a trial's estimated time and never goes below these (tuner.search.trial_time.hang_limits)
STARTUP_TIMEOUT_S, STEP_TIMEOUT_S = 900.0, 300.0
#: a search's hang limits are this many times a trial's estimated start-up and step: a slow setting (eager
#: decoding, offload, micro-batch 1) is a slow trial, not a hang (docs/decisions.md#trial-time-from-the-job)
HANG_MARGIN = 3.0


def add_hang_flags(p: argparse.ArgumentParser, *, subject: str, step: bool = True, estimated: bool = False) -> None:
    """The hang timeouts of a command that launches ``subject`` (``"a trial"``, ``"a run"``, ``"a probe"``):
    ``--startup-timeout`` (to the first step), ``--step-timeout`` (between steps; with ``step``) and the
    hidden ``--kill-grace`` (SIGTERM to SIGKILL); what :func:`tuner.trials.watch.timeout_reason` enforces.
    ``estimated``: the defaults are None, for the command to draw them from its estimate of a run's time."""

    def default(floor: float, what: str) -> str:
        return f"{HANG_MARGIN:g} x the estimated {what}, at least {floor:g}" if estimated else f"{floor:g}"

    p.add_argument(
        "--startup-timeout",
        type=positive_seconds,
        default=None if estimated else STARTUP_TIMEOUT_S,
        metavar="S",
        help=f"a hang: {subject} logging no first step after S seconds (start-up, model and engine build, one step; "
        f"default {default(STARTUP_TIMEOUT_S, 'start-up and first step')})",
    )
    if step:
        p.add_argument(
            "--step-timeout",
            type=positive_seconds,
            default=None if estimated else STEP_TIMEOUT_S,
            metavar="S",
            help=f"a hang: {subject} logging no next step for S seconds once it has stepped "
            f"(default {default(STEP_TIMEOUT_S, 'step')})",
        )
    p.add_argument("--kill-grace", type=positive_seconds, default=10.0, metavar="S", help=argparse.SUPPRESS)


def launch_trial(
    cmd: Sequence[str],
    *,
    trial_dir: str | Path,
    result_path: str | Path,
    timeout_s: Optional[float],
    grace_s: float = 10.0,
    extra_env: Optional[dict] = None,
    stop_event: Optional[threading.Event] = None,
    gpus: Optional[Sequence[str]] = None,
    use_nvml: bool = False,
    sample_hz: float = 10.0,
    on_start: Optional[callable] = None,
    step_line: Optional[str] = None,
    startup_timeout_s: Optional[float] = None,
    step_timeout_s: Optional[float] = None,
) -> TrialRun:
    """Run ``cmd`` as one trial and classify it. Never raises for what the trial does.

    Timeouts (each ``None`` = off): ``timeout_s`` caps the whole trial; with ``step_line`` (a regex for the
    line the trial logs after each step), ``startup_timeout_s`` caps the time to the first step (imports,
    model and engine build, the first step) and ``step_timeout_s`` the time between two steps, so a slow
    start-up is not taken for a hang and a hang mid-run is caught without waiting for the whole cap.
    """
    trial_dir = Path(trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    log_path = trial_dir / "train.log"
    result_path = Path(result_path)
    if result_path.exists():
        result_path.unlink()
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
    proc = start_reaped(cmd, log_path=log_path, grace_s=grace_s, extra_env=extra_env)
    if on_start is not None:
        on_start(proc.pid)
    sampler = MemorySampler(proc.pid, gpus=gpus, use_nvml=use_nvml, hz=sample_hz)
    sampler.start()
    watch = StepWatch(log_path, step_line) if step_line else None

    def reason_of(elapsed_s: float, w: Optional[StepWatch], now: float) -> Optional[str]:
        limits = dict(total_s=timeout_s, startup_s=startup_timeout_s, step_s=step_timeout_s)
        return timeout_reason(elapsed_s, w, **limits, now=now)

    rc, verdict = _wait(proc, t0, watch, stop_event, reason_of, log_path=log_path, grace_s=grace_s, sampler=sampler)
    duration = time.monotonic() - t0
    peaks = sampler.stop()
    leftovers = kill_leftovers(peaks.pids_seen)  # the wrapper should have done this; be certain
    result, read_error = read_result(result_path)
    return finished_run(
        rc,
        result,
        read_error,
        verdict,
        timeout_s=timeout_s,
        duration_s=duration,
        log_path=log_path,
        result_path=result_path,
        memory=peaks,
        leftover_pids=leftovers,
        stderr_hint=_last_error_line(log_path),
    )


def _wait(
    proc: subprocess.Popen,
    t0: float,
    watch: Optional[StepWatch],
    stop_event: Optional[threading.Event],
    reason_of: Callable[[float, Optional[StepWatch], float], Optional[str]],
    *,
    log_path: Path,
    grace_s: float,
    sampler: MemorySampler,
) -> tuple[Optional[int], PollVerdict]:
    """Poll the trial until it exits, or until the watch ends it (then its tree is terminated, with every process
    the sampler saw): (its exit code, the last verdict)."""
    verdict = PollVerdict()
    while True:
        try:
            rc = proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        verdict = poll_trial(t0, watch, stop_event, reason_of, log_path=log_path, what="its process group")
        if verdict.ends:
            rc = terminate_reaped(proc, grace_s, sampler.pids_seen)
            break
    return rc, verdict


def finished_run(
    returncode: Optional[int],
    result: Optional[dict],
    read_error: Optional[str],
    verdict: PollVerdict,
    *,
    timeout_s: Optional[float],
    duration_s: float,
    log_path: Path,
    result_path: Path,
    memory: MemoryPeaks,
    leftover_pids: list,
    stderr_hint: Optional[str] = None,
) -> TrialRun:
    """A finished trial (cold or warm) classified (:func:`classify`): a crash with no result says why its result
    could not be read; a trial that did not end ok keeps its log's tail."""
    status, error = classify(
        returncode,
        result,
        timed_out=verdict.timed_out,
        interrupted=verdict.interrupted,
        timeout_s=timeout_s,
        timeout_reason=verdict.reason,
        stderr_hint=stderr_hint,
    )
    if read_error and status == Status.CRASH and result is None:
        error = read_error
    tail = log_tail(log_path) if status != Status.OK else None
    return TrialRun(
        status=status,
        error=error,
        returncode=returncode,
        result=result,
        duration_s=duration_s,
        log_path=str(log_path),
        result_path=str(result_path),
        log_tail=tail,
        memory=memory,
        leftover_pids=leftover_pids,
    )


def start_reaped(
    cmd: Sequence[str], *, log_path: Path, grace_s: float, extra_env: Optional[dict] = None
) -> subprocess.Popen:
    """Start ``cmd`` under the reaper (``python -m tuner.trials.launch --reap``) in a new session, its output
    appended to ``log_path``: it dies with this process, even by SIGKILL, and leaves no orphan."""
    wrapper = [
        sys.executable,
        "-m",
        "tuner.trials.launch",
        "--reap",
        "--ppid",
        str(os.getpid()),
        "--grace",
        repr(float(grace_s)),
        "--",
        *cmd,
    ]
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            wrapper,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=_trial_env(extra_env),
            cwd=str(REPO_ROOT),
        )


def kill_leftovers(pids: Sequence[int]) -> list[int]:
    """SIGKILL any of ``pids`` still alive; -> the ones that survive even that (should be [])."""
    leftovers = _alive(pids)
    if leftovers:
        _signal_all(leftovers, signal.SIGKILL)
        time.sleep(0.2)
        leftovers = _alive(leftovers)
    return leftovers


_REAPER_MARGIN_S = 15.0


def terminate_reaped(proc: subprocess.Popen, grace_s: float, known_pids: set) -> Optional[int]:
    """SIGTERM the wrapper (it terminates its tree), then SIGKILL whatever is left (``known_pids``: the
    tree's processes seen while it ran, in case the wrapper itself is gone)."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        # the wrapper's own end takes up to its grace and its SIGKILL wait (trainer.launch.proc.kill_descendants):
        # cut short, its group's SIGKILL would orphan what sits in groups of its own (Ray's workers) to init
        return proc.wait(timeout=grace_s + _REAPER_MARGIN_S)
    except subprocess.TimeoutExpired:
        pass
    pids = set(known_pids) | {p.pid for p in _tree(proc.pid)}
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _signal_all(list(pids), signal.SIGKILL)
    try:
        return proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return None


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


# --------------------------------------------------------------------------- the reaper (child side)
def _reap_main(argv: list[str]) -> int:
    """``python -m tuner.trials.launch --reap --ppid PID --grace S -- CMD...``"""
    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1 :]
    ppid = int(opts[opts.index("--ppid") + 1]) if "--ppid" in opts else None
    grace = float(opts[opts.index("--grace") + 1]) if "--grace" in opts else 10.0
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    if ppid is not None and os.getppid() != ppid:
        return 143  # the tuner died before we could watch it

    def parent_gone() -> bool:  # PDEATHSIG's backstop: a dead tuner's children are re-parented
        return ppid is not None and os.getppid() != ppid

    with signals_caught((signal.SIGTERM, signal.SIGINT, signal.SIGHUP)) as got:
        child = subprocess.Popen(cmd)  # same process group: our session
        me = os.getpid()
        rc: Optional[int] = None
        while rc is None and not got and not parent_gone():
            # We are a subreaper: reap adopted orphans too, and find our child's status among them.
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid, status = 0, 0
            if pid == child.pid:
                rc = os.waitstatus_to_exitcode(status)
                child.returncode = rc
                continue
            if pid == 0:
                time.sleep(_SIGNAL_POLL_S)
        # Whatever is still below us now is either being stopped or an orphan of a finished trial.
        kill_descendants(grace if rc is None else 2.0)
    if rc is None:
        return 128 + signal.SIGTERM
    if rc < 0:  # re-raise the child's signal so the tuner sees it
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL/SIGSTOP have no handler to reset
            pass
        os.kill(me, -rc)
        time.sleep(1)
    return rc


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--reap":
        sys.exit(_reap_main(sys.argv[2:]))
    print("usage: python -m tuner.trials.launch --reap --ppid PID --grace S -- CMD...", file=sys.stderr)
    sys.exit(2)


@contextmanager
def stop_on_signals(stop: threading.Event):
    """While in the block, SIGINT and SIGTERM set ``stop`` (the runner then ends its trial and the caller
    records what it has) instead of raising; yields the list of signals received; the handlers are restored
    on the way out. For ``ppotune search``, ``validate`` and ``probe``: Ctrl-C keeps what was measured.

    A relay thread sets ``stop``: the handler itself must not take the event's lock
    (:func:`trainer.launch.proc.signals_caught` says why)."""
    done = threading.Event()
    with signals_caught((signal.SIGINT, signal.SIGTERM)) as got:

        def relay() -> None:
            while not done.wait(_SIGNAL_POLL_S):
                if got:
                    stop.set()

        relay_thread = threading.Thread(target=relay, name="signal-relay", daemon=True)
        relay_thread.start()
        try:
            yield got
        finally:
            done.set()
            relay_thread.join()
            if got:
                stop.set()


def next_numbered_dir(root: Path) -> Path:
    """A new directory ``root/<k>``, k one past the highest number there: one per ``ppotune validate`` or
    ``ppotune probe`` session, so a second run never overwrites the first's files."""
    root.mkdir(parents=True, exist_ok=True)
    k = 1 + max((int(p.name) for p in root.iterdir() if p.name.isdigit()), default=0)
    d = root / str(k)
    d.mkdir()
    return d
