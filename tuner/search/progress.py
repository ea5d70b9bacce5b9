"""What ``ppotune search`` shows: one plain line per finished trial, always; a rich progress
bar (trials done/total, best throughput and its memory, OOMs, ETA) when stdout is a TTY; the summary at the end
(the Pareto front, the confirmed finalists, the worst-case probes)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional

import optuna

from trainer.contracts import Status, TrialRecord, short_knob
from tuner.rules.units import gb
from tuner.search.session import TrialEvent

__all__ = ["Display", "trial_line", "format_knobs", "ConsoleObserver", "seed_display", "summary"]


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


# --------------------------------------------------------------------------- the search's console
class ConsoleObserver:
    """One plain line per finished trial (and the progress bar), plus a wandb run per trial."""

    def __init__(self, display: Display, tracker: Any = None):
        self.display = display
        self.tracker = tracker

    def trial_done(self, e: TrialEvent) -> None:
        r = e.record
        thr = r.throughput if e.status == Status.OK else None
        line = trial_line(
            e.number,
            e.status,
            throughput=thr,
            memory_gb=r.peak_memory_gb,
            seconds=float(r.duration_s or 0.0),
            params=e.params,
            note=e.note,
        )
        self.display.trial_done(
            line,
            counted=e.counted,
            status=e.status,
            throughput=thr,
            memory_gb=r.peak_memory_gb,
            number=e.number,
            duration_s=float(r.duration_s or 0.0),
        )
        if self.tracker is not None and e.status != Status.DUPLICATE:
            self.tracker.log_trial(
                e.number,
                status=str(e.status),
                params=e.params,
                overrides=r.overrides or {},
                attrs=r.to_user_attrs(),
                values=e.values,
            )

    def message(self, text: str) -> None:
        self.display.message(text)


def seed_display(display: Display, trials: list) -> None:
    """A resumed study: the progress line starts from what the study already holds."""
    recs = [(t, TrialRecord.from_user_attrs(t.user_attrs)) for t in trials]
    ok = [(t, r) for t, r in recs if r.status == Status.OK and t.values]
    if ok:
        b, _ = max(ok, key=lambda tr: tr[0].values[0])
        display.seed(
            best=(b.values[0], b.values[1], b.number),
            ooms=sum(r.status in (Status.OOM, Status.INFERRED_OOM) for _, r in recs),
        )


def summary(study: optuna.Study, search: Any) -> None:
    """The search's last lines: why it stopped, its trials by status, the front, the confirmation, the probes."""
    from tuner.study.frame import trials_frame

    df = trials_frame(study)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(df["status"].value_counts().items())) if not df.empty else ""
    print(f"ppotune search: done ({search.stopped_reason or 'stopped'}) | {len(df)} trials: {counts}", flush=True)
    if df.empty:
        return
    loaded_summary(study)
    front = df[df["pareto"]].sort_values("throughput", ascending=False)
    base = df[df["baseline"] & (df["status"] == Status.OK)]
    base_thr = float(base["throughput"].iloc[0]) if len(base) and base["throughput"].iloc[0] else None
    for _, r in front.head(5).iterrows():
        rel = f" ({r['throughput'] / base_thr:.2f}x baseline)" if base_thr else ""
        print(
            f"  pareto: trial {r['number']}: {r['throughput']:.1f} tok/s/GPU{rel}, {gb(r['peak_memory_gb'])} GB",
            flush=True,
        )
    confirm_summary(study)
    worst_case_summary(study)


def loaded_summary(study: optuna.Study) -> None:
    """How many launched trials ran under load (TrialRecord.load), when any did."""
    recs = [TrialRecord.from_user_attrs(t.user_attrs) for t in study.get_trials(deepcopy=False)]
    metered = [r for r in recs if r.load]
    loaded = [r for r in metered if r.loaded]
    if loaded:
        reruns = sum(1 for r in loaded if r.confirm_of is not None)
        print(
            f"ppotune search: {len(loaded)} of {len(metered)} launched trials ran under load (other processes busy on "
            f"their CPUs or GPUs; {reruns} of them confirmation re-runs, whose rounds are not claimed from)",
            flush=True,
        )


def worst_case_summary(study: optuna.Study) -> None:
    """The worst-case probes (study attr ``worst_case``), one line each."""
    from tuner.trials.probe import WORST_CASE_ATTR, ProbeResult

    for n, d in sorted((study.user_attrs.get(WORST_CASE_ATTR) or {}).items(), key=lambda kv: int(kv[0])):
        print(f"  worst case: trial {n}: {ProbeResult.from_dict(d).lines()[-1]}", flush=True)


def confirm_summary(study: optuna.Study) -> None:
    """The confirmed finalists (study attr ``confirmation``), as export ranks them."""
    from tuner.rules.finalists import CONFIRMATION_ATTR, describe, rounds_text

    conf = study.user_attrs.get(CONFIRMATION_ATTR)
    if not conf:
        return
    state = "" if conf.get("complete") else " (incomplete: re-run the same command to finish)"
    state = f", {rounds_text(conf)}" + state
    print(f"ppotune search: confirmed side by side with baseline #{conf.get('baseline')}{state}:", flush=True)
    for e in conf.get("finalists") or []:
        mem = f", peak {gb(e['peak_memory_gb'])} GB" if e.get("peak_memory_gb") is not None else ""
        failed = f", {e['failed']} re-run(s) not ok: {', '.join(e.get('statuses') or [])}" if e.get("failed") else ""
        print(f"  confirmed: trial {e['number']}: {describe(e)}{mem}{failed}", flush=True)
