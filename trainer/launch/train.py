"""``ppotune train``: validate the config, start the ranks, write the result JSON.

This process never imports torch. It starts the ranks (:class:`trainer.launch.ranks.RankGroup`, no torchrun
agent), forwards SIGTERM/SIGINT to them, and once every rank has exited it reads the per-rank status
files and writes the result (``trainer/result_schema.json``). A rank ended because a peer failed exits
with a signal's code, so the files, not the exit codes, say what happened.
"""

from __future__ import annotations

import collections
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from trainer.config import ConfigError, config_to_dict, load_config
from trainer.contracts import RESULT_SCHEMA_VERSION, ExitCode
from trainer.launch.proc import write_json_atomic
from trainer.launch.ranks import RankGroup
from trainer.summary import summarize_steps

__all__ = ["add_arguments", "run", "build_result", "error_result", "serve", "JobDir", "serve_layout", "warm_refusal"]

_TAIL_LINES = 60


def add_arguments(p) -> None:
    p.add_argument("config", help="training config YAML (verl key names)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="processes (GPUs) on this node; sets trainer.n_gpus_per_node"
    )
    p.add_argument("--steps", type=int, default=None, help="PPO steps to run; sets trainer.total_training_steps")
    p.add_argument(
        "--warmup", type=int, default=None, help="leading steps left out of the summary; sets ppotune.warmup_steps"
    )
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        metavar="N",
        help="profile step N (torch.profiler): rank 0 prints its top operators; the step is not measured",
    )
    p.add_argument("--result", default=None, help="write the result JSON here")
    p.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        help="a real per-process memory cap (GPU: allocator fraction; CPU: rlimit)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="sets ppotune.device")
    p.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="save the final actor and critic in HF format here (trainer.default_local_dir)",
    )
    p.add_argument("--wandb", action="store_true", help="log each step to wandb (offline without credentials)")
    p.add_argument(
        "--engine",
        choices=["ppotune", "verl"],
        default="ppotune",
        help="ppotune's own FSDP trainer, or verl's main_ppo (CONFIG is then a verl run file)",
    )
    p.add_argument(
        "--engine-python",
        default=None,
        metavar="PY",
        help="--engine verl: the interpreter of the verl environment (default: this one)",
    )
    p.add_argument(
        "--serve",
        default=None,
        metavar="JOBDIR",
        help="a warm job: start CONFIG's processes once and run, one after another, the trials requested in "
        "JOBDIR (what ppotune search does unless --cold; see trainer/rank/serve.py)",
    )


def _overrides(args) -> list[str]:
    out = list(args.overrides)
    flags = {
        "trainer.n_gpus_per_node": args.nproc,
        "trainer.total_training_steps": args.steps,
        "ppotune.warmup_steps": args.warmup,
        "ppotune.profile_step": args.profile_step,
        "ppotune.memory_limit_gb": args.memory_limit_gb,
        "ppotune.device": args.device,
        "trainer.default_local_dir": args.save,
        "ppotune.wandb": True if args.wandb else None,
    }
    out += [f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    return out


def error_result(message: str, *, config: dict | None = None, wall_s: float = 0.0, log_tail: str | None = None) -> dict:
    return {
        "schema_version": RESULT_SCHEMA_VERSION,
        "status": "error",
        "error": message,
        "oom_rank": None,
        "oom_phase": None,
        "config": config or {},
        "steps": [],
        "summary": summarize_steps([], device_type="cpu"),
        "environment": {"device": "cpu", "world_size": 0, "backend": "gloo"},
        "notes": [],
        "log_tail": log_tail,
        "wall_s": wall_s,
    }


def build_result(
    rank_files: dict[int, dict], *, config: dict, nproc: int, returncode: int, wall_s: float, log_tail: str
) -> dict:
    """Combine per-rank status files into the result: an OOM on any rank makes the run ``oom``."""
    lead = rank_files.get(0, {})
    ooms = sorted(r for r, f in rank_files.items() if f.get("status") == "oom")
    errors = sorted(r for r, f in rank_files.items() if f.get("status") == "error")
    all_ok = len(rank_files) == nproc and all(f.get("status") == "ok" for f in rank_files.values())
    if ooms:
        status, first = "oom", rank_files[ooms[0]]
        error = f"rank {ooms[0]} out of memory in phase {first.get('phase')}: {first.get('error')}"
    elif all_ok and returncode == 0:
        status, error = "ok", None
    else:
        status = "error"
        missing = sorted(set(range(nproc)) - set(rank_files))
        parts = []
        if missing:  # the root cause: a rank that died without writing (a signal); peers only saw broken links
            parts.append(
                f"rank(s) {missing} exited without a status (killed by a signal?); ranks' exit code {returncode}"
            )
        if errors:
            first = rank_files[errors[0]]
            parts.append(f"rank {errors[0]} failed in phase {first.get('phase')}: {first.get('error')}")
        error = "; ".join(parts) or f"ranks' exit code {returncode}"
    env = lead.get("environment") or next((f["environment"] for f in rank_files.values() if f.get("environment")), None)
    notes = list(
        dict.fromkeys(lead.get("notes") or next((f["notes"] for f in rank_files.values() if f.get("notes")), []))
    )
    return {
        "schema_version": RESULT_SCHEMA_VERSION,
        "status": status,
        "error": error,
        "oom_rank": ooms[0] if ooms else None,
        "oom_phase": rank_files[ooms[0]].get("phase") if ooms else None,
        "config": config,
        "model": lead.get("model") or next((f["model"] for f in rank_files.values() if f.get("model")), None),
        "per_gpu": lead.get("per_gpu"),
        "steps": lead.get("steps", []),
        "summary": lead.get("summary") or summarize_steps([], device_type="cpu"),
        "environment": env or {"device": "cpu", "world_size": nproc, "backend": "gloo"},
        "notes": notes,
        "log_tail": None if status == "ok" else log_tail,
        "wall_s": wall_s,
    }


def run(args) -> int:
    if args.serve and args.engine != "ppotune":
        print("ppotune train: error: --serve runs ppotune's own trainer (--engine ppotune)", file=sys.stderr)
        return ExitCode.USAGE
    if args.engine == "verl":
        from trainer.verl_engine.adapter import run as run_verl

        return run_verl(args)
    t0 = time.time()
    result_path = Path(args.result) if args.result else None
    try:
        overrides = _overrides(args)
        if args.steps is not None and args.warmup is None:
            # --steps alone keeps the config's warm-up when it fits, else leaves one measured step
            draft = load_config(args.config, overrides, validate=False)
            overrides.append(f"ppotune.warmup_steps={min(draft.ppotune.warmup_steps, max(0, args.steps - 1))}")
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"ppotune train: error: {e}", file=sys.stderr)
        if result_path:
            write_json_atomic(result_path, error_result(f"config: {e}"))
        return ExitCode.USAGE
    config = config_to_dict(cfg)
    if args.serve:
        return serve(Path(args.serve), config)
    nproc = cfg.trainer.n_gpus_per_node
    if result_path:
        result_path.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ppotune_run_", dir=result_path.parent if result_path else None))
    cfg_file = workdir / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = RankGroup(["trainer.rank.run", str(cfg_file), "--rank-dir", str(workdir)], nproc=nproc)
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    def forward(signum, _frame):
        # the ranks write what they were doing and exit; then we still collect and write what happened.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
        returncode = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    rank_files = _read_rank_files(workdir, nproc)
    result = build_result(
        rank_files, config=config, nproc=nproc, returncode=returncode, wall_s=time.time() - t0, log_tail="\n".join(tail)
    )
    if result_path:
        write_json_atomic(result_path, result)
    shutil.rmtree(workdir, ignore_errors=True)  # the result holds everything the rank files had
    out, err = _outcome_lines(result)
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return _exit_code(result)


def _outcome_lines(result: dict) -> tuple[list[str], list[str]]:
    """What ``ppotune train`` says about a finished run: (stdout lines, stderr lines)."""
    s = result["summary"]
    if result["status"] != "ok":
        return [], [f"ppotune train: {result['status']}: {result['error']}"]
    thr = s.get("throughput")
    head = (
        f"ppotune train: ok | throughput {thr:.1f} tokens/s/GPU | step {s.get('step_s'):.2f} s | "
        f"peak memory {s.get('peak_memory_gb'):.2f} GB ({s.get('memory_source')})"
        if thr is not None
        else "ppotune train: ok"
    )
    return [head, *(f"note: {note}" for note in result["notes"])], []


def _exit_code(result: dict) -> int:
    return {"ok": ExitCode.OK, "oom": ExitCode.OOM}.get(result["status"], ExitCode.ERROR)


def _read_rank_files(rank_dir: Path, nproc: int) -> dict[int, dict]:
    rank_files = {}
    for r in range(nproc):
        f = rank_dir / f"rank{r}.json"
        if f.is_file():
            try:
                rank_files[r] = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                pass
    return rank_files


# --------------------------------------------------------------------------- a warm job (--serve)
@dataclass(frozen=True)
class JobDir:
    """The files through which a warm job (``ppotune train CONFIG --serve JOBDIR``) is driven, named once
    for its three parties: the tuner (``tuner.trials.warm.WarmRunner``), this launcher and the ranks
    (trainer/rank/serve.py).

    The tuner writes request ``n`` (``{config, result, log}``: the trial's complete config, where its result
    JSON and its log go), one at a time, or ``stop``. The launcher validates it (a refused config is
    answered at once and never reaches the ranks), writes the trial's config beside the ranks' status files
    in ``trial_dir(k)`` and hands it to the ranks as their next task ``k`` (``{config, rank_dir}``, or
    ``{stop: true}``); once every rank's status file says ``done`` (or the job ended), it writes the
    trial's result JSON where the request said and takes the next request.
    """

    root: Path
    #: how often the launcher and the ranks look for their next file (seconds)
    POLL_S = 0.02

    def request(self, seq: int) -> Path:
        return self.root / "requests" / f"{seq:06d}.json"

    def task(self, seq: int) -> Path:
        return self.root / "tasks" / f"{seq:06d}.json"

    def trial_dir(self, seq: int) -> Path:
        return self.root / f"trial{seq:06d}"

    @property
    def stop(self) -> Path:
        """Touched by the tuner: end the job once the trial in flight (if any) is done."""
        return self.root / "stop"

    @property
    def setup_dir(self) -> Path:
        """The ranks' status files when the job fails before its first trial (process group, device)."""
        return self.root / "setup"

    def make(self) -> "JobDir":
        for d in (self.root / "requests", self.root / "tasks", self.setup_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self


def serve_layout(config: dict) -> dict:
    """What a warm job's processes fix for all of its trials (a complete nested config -> the keys): a trial
    whose layout differs needs other processes, so it runs in another job."""
    return {
        "nproc": config["trainer"]["n_gpus_per_node"],
        "nnodes": config["trainer"]["nnodes"],
        "device": config["ppotune"]["device"],
        "dist_timeout_s": config["ppotune"]["dist_timeout_s"],
    }


def warm_refusal(config: dict) -> Optional[str]:
    """Why this (complete, nested) config cannot run as a trial of a warm job, or None."""
    if config["actor_rollout_ref"]["rollout"]["name"] == "vllm":
        return (
            "actor_rollout_ref.rollout.name=vllm: a process keeps its in-process vLLM engine alive on purpose "
            "(trainer/engine/vllm_rollout.py), so each vLLM trial gets fresh processes"
        )
    if config["trainer"]["nnodes"] != 1:
        return "trainer.nnodes > 1: a warm job is one node's processes"
    return None


class _LinePump(threading.Thread):
    """The ranks' output, line by line, to our stdout (the job's log) and to the log of the
    trial in flight; keeps that trial's last lines for its result's ``log_tail``."""

    def __init__(self, proc: RankGroup):
        super().__init__(name="ppotune-serve-output", daemon=True)
        self.proc = proc
        self._lock = threading.Lock()
        self._file = None
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._write(line)

    def _write(self, line: str) -> None:
        with self._lock:
            sys.stdout.write(line)
            sys.stdout.flush()
            if self._file is not None:
                self._file.write(line)
                self._file.flush()
            self._tail.append(line.rstrip("\n"))

    def begin(self, log: Optional[str]) -> None:
        """From now on the output also goes to ``log`` (the trial's train.log), after what is there."""
        with self._lock:
            self._file = open(log, "a") if log else None
            self._tail.clear()

    def end(self, lines: list[str]) -> None:
        """Write the trial's last ``lines`` (what ``ppotune train`` says about a run) and close its log."""
        for line in lines:
            self._write(line + "\n")
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file = None

    def tail(self) -> str:
        with self._lock:
            return "\n".join(self._tail)


def serve(job_root: Path, config: dict) -> int:
    """``ppotune train CONFIG --serve JOBDIR``: one group of ranks (trainer/rank/serve.py) that start once and
    then run trial after trial as :class:`JobDir` hands them over, each trial the same code a cold
    ``ppotune train`` runs, with the same result JSON.

    An OOM, a crash or a signal ends the job the way it ends a cold run: the trial in flight gets its result
    from the ranks' status files and the job exits with that run's exit code (3 OOM, 1 else); the tuner starts
    another job for the next trial. A trial whose config is refused (exit code 2 when cold) gets a ``config:``
    error result and the job goes on. ``stop`` (or SIGTERM) ends it; exit code 0 when no trial failed.
    """
    refusal = warm_refusal(config)
    if refusal:
        print(f"ppotune train: error: --serve: {refusal}", file=sys.stderr)
        return ExitCode.USAGE
    job = JobDir(job_root.resolve()).make()
    layout = serve_layout(config)
    cfg_file = job.root / "job.yaml"
    cfg_file.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = RankGroup(["trainer.rank.serve", str(cfg_file), "--job-dir", str(job.root)], nproc=layout["nproc"])
    pump = _LinePump(proc)
    pump.start()

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # to every rank; the trial in flight still gets its result

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    failed: Optional[dict] = None
    seq = tasks = 0  # requests answered; tasks handed to the ranks (a refused request is not one)
    try:
        while True:
            request = _next_request(job, seq + 1, proc)
            if request is None:
                break
            seq += 1
            result, ended, handed = _serve_trial(job, seq, tasks + 1, request, layout, proc, pump)
            tasks += handed
            write_json_atomic(Path(request["result"]), result)
            if ended:
                failed = result
                break
        if proc.poll() is None:
            write_json_atomic(job.task(tasks + 1), {"stop": True})
        returncode = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    pump.join(timeout=10)
    if failed is not None:
        return _exit_code(failed)
    return ExitCode.OK if returncode == 0 else ExitCode.ERROR


def _next_request(job: JobDir, seq: int, proc: RankGroup) -> Optional[dict]:
    """Request ``seq`` once it is there (answered even if the job has ended meanwhile); None on ``stop`` or
    when the job ended with no request waiting."""
    path = job.request(seq)
    while True:
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):  # written through a rename: only a broken writer
                return {"result": str(path.with_suffix(".result.json")), "config": None, "log": None}
        if job.stop.exists() or proc.poll() is not None:
            return None
        time.sleep(JobDir.POLL_S)


def _serve_trial(
    job: JobDir, seq: int, task: int, request: dict, layout: dict, proc: RankGroup, pump: _LinePump
) -> tuple[dict, bool, bool]:
    """Run request ``seq`` in the job as the ranks' task ``task``: -> (its result, whether the job ended with
    it, whether it was handed to the ranks)."""
    t0 = time.time()
    pump.begin(request.get("log"))
    try:
        if not request.get("config"):
            raise ConfigError("config", f"request {seq} of {job.root} names no config file")
        cfg = load_config(request["config"])  # the trust boundary, as for a cold run
    except ConfigError as e:
        pump.end([f"ppotune train: error: {e}"])
        return error_result(f"config: {e}", wall_s=time.time() - t0), False, False
    config = config_to_dict(cfg)
    if serve_layout(config) != layout or warm_refusal(config):
        why = warm_refusal(config) or f"its layout {serve_layout(config)} is not this job's {layout}"
        pump.end([f"ppotune train: error: not a trial for this warm job: {why}"])
        return (
            error_result(f"not a trial for this warm job: {why}", config=config, wall_s=time.time() - t0),
            False,
            False,
        )
    nproc = layout["nproc"]
    rank_dir = job.trial_dir(task)
    rank_dir.mkdir(parents=True, exist_ok=True)
    (rank_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    write_json_atomic(job.task(task), {"config": str(rank_dir / "config.yaml"), "rank_dir": str(rank_dir)})
    while True:
        files = _read_rank_files(rank_dir, nproc)
        if len(files) == nproc and all(f.get("done") for f in files.values()):
            returncode, ended = 0, False
            break
        if proc.poll() is not None:
            returncode, ended = proc.wait(), True
            pump.join(timeout=10)  # every line the ranks wrote is in the log and the tail
            files = _read_rank_files(rank_dir, nproc) or _read_rank_files(job.setup_dir, nproc)
            break
        time.sleep(JobDir.POLL_S)
    result = build_result(
        files, config=config, nproc=nproc, returncode=returncode, wall_s=time.time() - t0, log_tail=pump.tail()
    )
    out, err = _outcome_lines(result)
    pump.end(out + err)
    shutil.rmtree(rank_dir, ignore_errors=True)  # the result holds everything the rank files had
    return result, ended, True
