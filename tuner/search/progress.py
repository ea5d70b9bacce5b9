"""What ``ppotune search`` shows: one plain line per finished trial, always; a rich progress
bar (trials done/total, best throughput and its memory, OOMs, ETA) when stdout is a TTY."""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional

from trainer.contracts import short_knob
from tuner.units import gb

__all__ = ["Display", "trial_line", "format_knobs"]


def format_knobs(params: dict, *, limit: int = 6) -> str:
    items = [f"{short_knob(k)}={v:.6g}" if isinstance(v, float) else f"{short_knob(k)}={v}" for k, v in params.items()]
    if len(items) > limit:
        items = items[:limit] + [f"(+{len(items) - limit} more)"]
    return " ".join(items)


def trial_line(
    number: int,
    status: str,
    *,
    throughput: Optional[float],
    memory_gb: Optional[float],
    seconds: float,
    params: dict,
    note: str = "",
) -> str:
    thr = f"{throughput:9.1f} tok/s/GPU" if throughput is not None else f"{'-':>9} tok/s/GPU"
    mem = f"{gb(memory_gb, 6)} GB"
    text = f"trial {number:4d} {status:<12} {thr} {mem} {seconds:7.1f} s | {format_knobs(params)}"
    return text + (f" | {note}" if note else "")


class Display:
    """Thread-safe: workers call :meth:`trial_done`; the bar lives only on a TTY."""

    def __init__(self, total: int, *, done: int = 0, parallel: int = 1, tty: Optional[bool] = None):
        self.total = total
        self.done = done
        self.parallel = max(1, parallel)
        self.best: Optional[tuple[float, float, int]] = None  # throughput, memory, trial
        self.ooms = 0
        self.durations: list[float] = []
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._progress = None
        self._task = None
        if self.tty:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]trials[/] {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task = self._progress.add_task("search", total=total, completed=done, info="")
            self._progress.start()

    def seed(self, *, best: Optional[tuple[float, float, int]], ooms: int) -> None:
        self.best, self.ooms = best, ooms
        self._refresh()

    def _eta_s(self) -> Optional[float]:
        measured = [d for d in self.durations if d > 0]
        if not measured:
            return None
        return max(0, self.total - self.done) * (sum(measured) / len(measured)) / self.parallel

    def info(self) -> str:
        parts = []
        if self.best is not None:
            parts.append(f"best {self.best[0]:.1f} tok/s/GPU @ {gb(self.best[1])} GB (trial {self.best[2]})")
        parts.append(f"OOM {self.ooms}")
        eta = self._eta_s()
        if eta is not None:
            parts.append(f"ETA {eta / 60:.1f} min")
        return " | ".join(parts)

    def _refresh(self) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=min(self.done, self.total), info=self.info())

    def trial_done(
        self,
        line: str,
        *,
        counted: bool,
        status: str,
        throughput: Optional[float],
        memory_gb: Optional[float],
        number: int,
        duration_s: float,
    ) -> None:
        with self._lock:
            if counted:
                self.done += 1
            self.durations.append(duration_s)
            if status in ("oom", "inferred_oom"):
                self.ooms += 1
            if status == "ok" and throughput is not None and (self.best is None or throughput > self.best[0]):
                self.best = (throughput, memory_gb or 0.0, number)
            if self._progress is not None:
                self._progress.console.print(line, markup=False, highlight=False)
            else:
                print(line, flush=True)
            self._refresh()

    def message(self, text: str) -> None:
        with self._lock:
            if self._progress is not None:
                self._progress.console.print(text, markup=False, highlight=False)
            else:
                print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
