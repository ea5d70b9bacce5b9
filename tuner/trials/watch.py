"""When a running trial is ended: the step lines its log gains (:class:`StepWatch`), the timeouts
(:func:`timeout_reason`) and the tuner's stop, decided at each poll (:func:`poll_trial` -> :class:`PollVerdict`).

Shared by the cold trial (:func:`tuner.trials.launch.launch_trial`) and the warm one
(:class:`tuner.trials.warm.WarmRunner`); ending the processes is theirs.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

__all__ = ["StepWatch", "total_timeout_text", "timeout_reason", "PollVerdict", "poll_trial"]


class StepWatch:
    """The step lines a trial's log gains (``step_line``: a regex matched per line; rank 0 logs one line
    per PPO step): how many so far and when the last one arrived."""

    def __init__(self, path: Path, step_line: str):
        self.path = Path(path)
        self.pattern = re.compile(step_line)
        self.offset = 0
        self.partial = b""
        self.steps = 0
        self.last: Optional[float] = None

    def poll(self, now: float) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        found = sum(1 for line in lines if self.pattern.search(line.decode(errors="replace")))
        if found:
            self.steps += found
            self.last = now


def total_timeout_text(total_s: float) -> str:
    """The ``--trial-timeout`` that fired, in words (also what :func:`tuner.trials.launch.classify` says)."""
    return f"no result after {total_s:g} s (--trial-timeout)"


def timeout_reason(
    elapsed_s: float,
    watch: Optional[StepWatch],
    *,
    total_s: Optional[float],
    startup_s: Optional[float],
    step_s: Optional[float],
    now: float,
) -> Optional[str]:
    """Which timeout fires now, as the flag that sets it (None: none)."""
    if total_s is not None and elapsed_s > total_s:
        return total_timeout_text(total_s)
    if watch is None:
        return None
    if watch.steps == 0:
        if startup_s is not None and elapsed_s > startup_s:
            return f"no first step after {startup_s:g} s (--startup-timeout: start-up, model build and one step)"
        return None
    if step_s is not None and now - watch.last > step_s:
        return f"no step for {step_s:g} s after step {watch.steps} (--step-timeout)"
    return None


@dataclass(frozen=True)
class PollVerdict:
    """What the watch of a running trial decided at one poll: go on, or end it and why."""

    interrupted: bool = False  # the tuner is stopping
    reason: Optional[str] = None  # the timeout that fired (:func:`timeout_reason`)

    @property
    def timed_out(self) -> bool:
        return self.reason is not None

    @property
    def ends(self) -> bool:
        return self.interrupted or self.timed_out


def poll_trial(
    t0: float,
    watch: Optional[StepWatch],
    stop_event: Optional[threading.Event],
    reason_of: Callable[[float, Optional[StepWatch], float], Optional[str]],
    *,
    log_path: Path,
    what: str,
) -> PollVerdict:
    """One poll of a running trial (cold or warm): read its new step lines, then decide. A trial to end
    gets a line in its log saying why (``what``: the processes about to be terminated);
    ``reason_of(elapsed_s, watch, now)`` is the timeout rule of the trial's kind."""
    now = time.monotonic()
    if watch is not None:
        watch.poll(now)
    if stop_event is not None and stop_event.is_set():
        verdict = PollVerdict(interrupted=True)
    else:
        verdict = PollVerdict(reason=reason_of(now - t0, watch, now))
    if verdict.ends:
        why = f"timed out ({verdict.reason})" if verdict.timed_out else "interrupted"
        with open(log_path, "ab") as log:
            log.write(f"\nppotune search: trial {why} after {now - t0:.1f} s; terminating {what}\n".encode())
    return verdict
