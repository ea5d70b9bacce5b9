"""Warm trials: the trials of one process layout run one after another inside one long-lived job.

A cold trial (:class:`tuner.trials.runners.SubprocessRunner`) pays for its processes every time: the launcher, the
ranks' ``import torch, transformers``, the process group, the model load, before a single step is
measured (most of a short trial: see docs/decisions.md#warm-trials). :class:`WarmRunner` starts one job per
``--parallel`` slot, ``ppotune train CONFIG --serve JOBDIR`` (tuner/commands/train.py, ranks in
trainer/rank/serve.py), under
the same reaper as a cold trial (its own session; it dies with the tuner, even by SIGKILL, and leaves no
orphan), and hands it trial after trial. Each trial runs the code a cold trial runs, builds its models
with its own knobs from a host copy of the weights, and gets the same result JSON.

What stays as for a cold trial: the classification (ok | oom | hang | crash | invalid, interrupted), the
timeouts (the first trial of a job has ``--startup-timeout`` to its first step, a later one
``--step-timeout``: it has no start-up; ``--step-timeout`` between steps and ``--trial-timeout`` over
the trial, as cold), the memory sampled from outside over the trial's own seconds, the trial's files
(``config.yaml``, ``result.json``, ``train.log``: the job writes the trial's part of its output there).
An OOM, a crash, a hang or a stop ends the job (a hang: its process group is killed); the next trial
starts a fresh one. A trial whose layout (world size, device, process-group timeout) differs from the
slot's job gets a new job; one that cannot run warm at all (``trainer.launch.jobdir.warm_refusal``: a vLLM
rollout, several nodes, the verl engine) runs cold, and says so in its notes.

``TrialRecord.duration_s`` is the trial's own wall time: a job's first trial includes the job's
start-up (of a job started ahead by :meth:`WarmRunner.prestart`, what was left of it), a later one
does not. Every warm trial's notes say which job ran it.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from trainer.contracts import ExitCode
from trainer.launch.jobdir import JobDir, serve_layout, warm_refusal
from trainer.launch.proc import write_json_atomic
from tuner.trials.launch import (
    finished_run,
    kill_leftovers,
    read_result,
    start_reaped,
    terminate_reaped,
    train_command,
)
from tuner.trials.memory import MemoryPeaks, MemorySampler
from tuner.trials.runners import STEP_LINE, SubprocessRunner, TrialOutcome, TrialRequest, trial_record
from tuner.trials.watch import PollVerdict, StepWatch, poll_trial, timeout_reason

__all__ = ["WarmRunner"]

_POLL_S = 0.02  # how soon a finished trial's result is seen (the next trial waits on it)
_JUDGE_S = 0.1  # how often its step lines, the timeouts and the stop event are looked at
_CLOSE_S = 30.0  # a job asked to stop between trials gets this long before it is terminated


@dataclass
class _Job:
    """A running warm job and what the runner knows of it."""

    proc: object  # subprocess.Popen of the reaper
    dir: JobDir
    layout: dict
    started_for: Optional[int]  # the trial it was started for (None: started ahead of the search's first)
    trials: int = 0  # trials handed to it so far
    pids: set = field(default_factory=set)  # every process of its tree the samplers saw

    @property
    def name(self) -> str:
        return self.dir.root.name

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class WarmRunner:
    """Trials in warm jobs, one job per ``--parallel`` slot; what cannot run warm goes to ``cold``.

    ``cold`` also carries the settings both share: device kind, processes per trial, the timeouts, the
    kill grace. Call :meth:`close` when the search is done (the jobs also end with the tuner's process)."""

    cold: SubprocessRunner
    jobs_dir: Path  # each job's files (JobDir) and its whole log (job.log) go to jobs_dir/<slot>-<pid>-<n>
    name: str = "ppotune"
    sample_hz: float = 10.0
    _jobs: dict = field(default_factory=dict, repr=False)  # slot -> _Job
    _started: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Jobs are started from this one long-lived thread: the reaper's PDEATHSIG fires when the *thread* that
    # started it ends, and a --parallel worker thread ends before the search does (--confirm runs after).
    _spawner: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="warm-jobs"), repr=False
    )

    # ---- the protocol
    def run(self, request: TrialRequest, stop: threading.Event) -> TrialOutcome:
        why_cold = "the verl engine runs verl's own processes" if self.cold.verl else warm_refusal(request.config)
        if why_cold:
            if self.cold.device_kind == "cuda":
                self._close_slot(request.slot)  # an idle job would hold memory of the GPUs the cold trial uses
            outcome = self.cold.run(request, stop)
            outcome.record.notes.append(f"cold: {why_cold}")
            return outcome
        return self._run_warm(request, stop)

    def prestart(self, config: dict, slot: int = 0) -> None:
        """Start ``slot``'s job now with ``config``'s layout, before any trial is asked: its ranks import
        torch and form their process group while the tuner opens its study and proposes the first trial.
        Nothing for a config that cannot run warm; a first trial of another layout replaces the job."""
        if self.cold.verl or warm_refusal(config):
            return
        with self._lock:
            if slot in self._jobs:
                return
        job = self._start(slot, serve_layout(config), yaml.safe_dump(config, sort_keys=False), started_for=None)
        with self._lock:
            self._jobs[slot] = job

    def close(self, *, wait: bool = True) -> None:
        """Stop every job (between trials: they exit by themselves) and make sure nothing is left.
        ``wait=False``: only ask them to stop (the tuner's summary runs while they exit); a later
        ``close()`` waits for them, ends what is left, and must follow."""
        if not wait:
            with self._lock:
                jobs = list(self._jobs.values())
            for job in jobs:
                if job.trials and job.alive():
                    job.dir.stop.touch()
            return
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            self._stop(job)
        self._spawner.shutdown(wait=True)

    # ---- jobs
    def _job_for(self, request: TrialRequest, layout: dict, config_path: Path) -> _Job:
        with self._lock:
            job = self._jobs.pop(request.slot, None)
        if job is not None and (job.layout != layout or not job.alive()):
            self._stop(job)
            job = None
        if job is None:
            job = self._start(request.slot, layout, config_path.read_text(), started_for=request.number)
        with self._lock:
            self._jobs[request.slot] = job
        return job

    def _start(self, slot: int, layout: dict, config_text: str, started_for: Optional[int]) -> _Job:
        with self._lock:
            self._started += 1
            root = Path(self.jobs_dir) / f"{slot}-{os.getpid()}-{self._started}"
        jd = JobDir(root).make()
        base = root / "base.yaml"  # the job's layout comes from it (the first trial's config)
        base.write_text(config_text)
        gpus = self.cold.gpu_slice(slot)
        proc = self._spawner.submit(
            start_reaped,
            [sys.executable, "-m", "tuner.cli", "train", str(base), "--serve", str(root)],
            log_path=root / "job.log",
            grace_s=self.cold.grace_s,
            extra_env={"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus is not None else None,
        ).result()
        return _Job(proc=proc, dir=jd, layout=layout, started_for=started_for)

    def _close_slot(self, slot: int) -> None:
        with self._lock:
            job = self._jobs.pop(slot, None)
        if job is not None:
            self._stop(job)

    def _stop(self, job: _Job) -> None:
        if job.alive() and job.trials == 0:  # started ahead and never used: no trial to let finish
            terminate_reaped(job.proc, self.cold.grace_s, job.pids)
        elif job.alive():
            job.dir.stop.touch()
            try:
                job.proc.wait(timeout=_CLOSE_S)
            except subprocess.TimeoutExpired:  # terminated as a hung trial is
                terminate_reaped(job.proc, self.cold.grace_s, job.pids)
        kill_leftovers(sorted(job.pids))

    # ---- one trial
    def _run_warm(self, request: TrialRequest, stop: threading.Event) -> TrialOutcome:
        d = request.trial_dir
        d.mkdir(parents=True, exist_ok=True)
        config_path, result_path, log_path = d / "config.yaml", d / "result.json", d / "train.log"
        config_path.write_text(yaml.safe_dump(request.config, sort_keys=False))
        if result_path.exists():
            result_path.unlink()
        job = self._job_for(request, serve_layout(request.config), config_path)
        job.trials += 1
        first = job.trials == 1
        gpus = self.cold.gpu_slice(request.slot)
        cmd = " ".join(train_command(config_path, result_path=result_path))
        with open(log_path, "ab") as log:
            # the command that runs the same trial cold, after which job ran it warm
            log.write(f"$ [warm job {job.name}, its trial {job.trials}] {cmd}\n".encode())
        t0 = time.monotonic()
        request_file = {"config": str(config_path), "result": str(result_path), "log": str(log_path)}
        write_json_atomic(job.dir.request(job.trials), request_file)
        sampler = MemorySampler(job.proc.pid, gpus=gpus, use_nvml=self.cold.device_kind == "cuda", hz=self.sample_hz)
        sampler.start()
        verdict = self._watch(job, first, t0, stop, sampler, log_path=log_path, result_path=result_path)
        duration = time.monotonic() - t0
        result, read_error = read_result(result_path)
        refused = result is not None and (result.get("error") or "").startswith("config:")  # the job goes on
        returncode, peaks, leftovers, ended = self._settle(job, request.slot, sampler, result, refused=refused)
        run = finished_run(
            returncode,
            result,
            read_error,
            verdict,
            timeout_s=self.cold.timeout_s,
            duration_s=duration,
            log_path=log_path,
            result_path=result_path,
            memory=peaks,
            leftover_pids=leftovers,
        )
        record = trial_record(run, config_path=config_path, gpus=gpus, engine=self.name)
        record.notes.append(self._note(job, first, ended))
        return TrialOutcome(run.status, record)

    def _watch(
        self,
        job: _Job,
        first: bool,
        t0: float,
        stop: threading.Event,
        sampler: MemorySampler,
        *,
        log_path: Path,
        result_path: Path,
    ) -> PollVerdict:
        """Poll until the job writes the trial's result or ends; a timeout or a stop terminates the job."""
        watch = StepWatch(log_path, STEP_LINE[self.name])
        verdict = PollVerdict()
        what = f"its warm job's process group ({job.name})"
        judged = t0
        while not result_path.is_file() and job.alive():
            time.sleep(_POLL_S)
            if time.monotonic() - judged < _JUDGE_S:
                continue
            judged = time.monotonic()
            verdict = poll_trial(
                t0, watch, stop, lambda e, w, n: self._timeout(first, e, w, n), log_path=log_path, what=what
            )
            if verdict.ends:
                terminate_reaped(job.proc, self.cold.grace_s, job.pids | sampler.pids_seen)
                break
        return verdict

    def _settle(
        self, job: _Job, slot: int, sampler: MemorySampler, result: Optional[dict], *, refused: bool
    ) -> tuple[Optional[int], MemoryPeaks, list[int], bool]:
        """After the trial: the job it ended is waited for and its processes made sure of, and it leaves the
        slot. (the trial's return code, its memory peaks, the processes left over, whether the job ended)"""
        if result is not None and result.get("status") != "ok" and not refused:
            # a failure ends the job (the launcher exits once it has written the result): wait for it
            try:
                job.proc.wait(timeout=self.cold.grace_s + 10.0)
            except subprocess.TimeoutExpired:
                terminate_reaped(job.proc, self.cold.grace_s, job.pids | sampler.pids_seen)
        peaks = sampler.stop()
        job.pids |= set(peaks.pids_seen)
        ended = not job.alive()
        leftovers: list[int] = []
        if ended:
            with self._lock:
                if self._jobs.get(slot) is job:
                    del self._jobs[slot]
            leftovers = kill_leftovers(sorted(job.pids))
            returncode = job.proc.returncode
        else:
            returncode = ExitCode.USAGE if refused else ExitCode.OK if result else None
        return returncode, peaks, leftovers, ended

    def _timeout(self, first: bool, elapsed_s: float, watch: StepWatch, now: float) -> Optional[str]:
        c = self.cold
        if first:  # the job's start-up is this trial's
            return timeout_reason(
                elapsed_s, watch, total_s=c.timeout_s, startup_s=c.startup_timeout_s, step_s=c.step_timeout_s, now=now
            )
        if watch.steps == 0 and c.step_timeout_s is not None and elapsed_s > c.step_timeout_s:
            return f"no first step after {c.step_timeout_s:g} s in a warm job (--step-timeout: build and one step)"
        return timeout_reason(elapsed_s, watch, total_s=c.timeout_s, startup_s=None, step_s=c.step_timeout_s, now=now)

    @staticmethod
    def _note(job: _Job, first: bool, ended: bool) -> str:
        end = "; the job ended with it" if ended else ""
        ahead = job.started_for is None
        if first:
            part = "what was left of the job's start-up (started ahead of it)" if ahead else "the job's start-up"
            return f"warm: trial 1 of job {job.name}: its seconds include {part}{end}"
        started = "started ahead of the search's first trial" if ahead else f"started for trial {job.started_for}"
        return (
            f"warm: trial {job.trials} of job {job.name} ({started}): process start, "
            f"imports and the weights' load were not repeated{end}"
        )
