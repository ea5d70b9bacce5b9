"""``ppotune train``: validate the config and its inputs, start the ranks, write the result JSON.

The inputs that can be checked without training (the data files and their columns, the model directory, its
tokenizer: :mod:`trainer.launch.preflight`) are checked before any rank starts: a bad one is one line naming the
file and the key, exit 2, as a refused config is.

This process never imports torch. It starts the ranks (:class:`trainer.launch.ranks.RankGroup`, no torchrun
agent), forwards SIGTERM/SIGINT to them, and once every rank has exited it reads the per-rank status
files and writes the result (``trainer/result_schema.json``). A rank ended because a peer failed exits
with a signal's code, so the files, not the exit codes, say what happened.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import yaml

from trainer.config import ConfigError, config_to_dict, load_config
from trainer.contracts import ExitCode
from trainer.launch.device import detect_device
from trainer.launch.jobdir import JobDir, serve_layout, warm_refusal
from trainer.launch.preflight import preflight, preflight_verl
from trainer.launch.proc import write_json_atomic
from trainer.launch.ranks import RankGroup
from trainer.launch.result import build_result, error_result, exit_code, outcome_lines, read_rank_files
from tuner.commands.flags import add_config_arguments, add_device_flag, cap_below_floor, cap_text, overrides_of

__all__ = ["add_arguments", "run", "serve"]

_TAIL_LINES = 60


def add_arguments(p) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="PPO steps to run; sets trainer.total_training_steps (default: the config's)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="leading steps left out of the summary; sets ppotune.warmup_steps (default: the config's, at most "
        "--steps - 1)",
    )
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        metavar="N",
        help="profile step N (torch.profiler): rank 0 prints its top operators; the step is not measured "
        "(default: none)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where this run's files go: DIR/result.json (default: none written, the summary is printed)",
    )
    p.add_argument(
        "--result",
        default=None,
        metavar="FILE",
        help="write the result JSON to exactly FILE (what a trial uses; default: DIR/result.json with --out)",
    )
    p.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        help="a real per-process memory cap (GPU: allocator fraction; CPU: rlimit; default: the config's)",
    )
    add_device_flag(p)
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
        help=argparse.SUPPRESS,  # internal: a warm job (CONFIG's processes start once and run, one after another,
        # the trials requested in JOBDIR: what ppotune search does unless --cold; see trainer/rank/serve.py)
    )


def _overrides(args) -> list[str]:
    out = overrides_of(args)
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


def run(args) -> int:
    if args.serve and args.engine != "ppotune":
        print("ppotune train: error: --serve runs ppotune's own trainer (--engine ppotune)", file=sys.stderr)
        return ExitCode.USAGE
    args.overrides = overrides_of(args)  # positional key=value and -o, in order (the verl adapter reads them here)
    args.override = []
    result_path = Path(args.result) if args.result else (Path(args.out) / "result.json" if args.out else None)
    if args.engine == "verl":
        from trainer.verl_engine.adapter import train_verl

        refused = _verl_inputs_refused(args) or _verl_below_floor(args)
        if refused is not None:
            return _refuse(refused, result_path)
        if result_path:  # --out DIR as for ppotune's engine: DIR/result.json, DIR made here
            result_path.parent.mkdir(parents=True, exist_ok=True)
            args.result = str(result_path)
        return train_verl(args)
    t0 = time.time()
    try:
        overrides = _overrides(args)
        if args.steps is not None and args.warmup is None:
            # --steps alone keeps the config's warm-up when it fits, else leaves one measured step
            draft = load_config(args.config, overrides, validate=False)
            overrides.append(f"ppotune.warmup_steps={min(draft.ppotune.warmup_steps, max(0, args.steps - 1))}")
        cfg = load_config(args.config, overrides)
        preflight(cfg, source=args.config)
    except ConfigError as e:
        return _refuse(e, result_path)
    config = config_to_dict(cfg)
    below = _below_floor(config, args.config, flag=args.memory_limit_gb)
    if below is not None:
        return _refuse(below, result_path)
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
    rank_files = read_rank_files(workdir, nproc)
    result = build_result(
        rank_files, config=config, nproc=nproc, returncode=returncode, wall_s=time.time() - t0, log_tail="\n".join(tail)
    )
    if result_path:
        write_json_atomic(result_path, result)
    shutil.rmtree(workdir, ignore_errors=True)  # the result holds everything the rank files had
    out, err = outcome_lines(result)
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return exit_code(result)


def _below_floor(config: dict, source: str, *, flag: Optional[float]) -> Optional[str]:
    """The one line when the config's cap is below the models' states (:mod:`tuner.memory_model.floor`): checked
    here, before any rank starts, since a rank under such a cap dies in its set-up in a different way every run."""
    limit = config["ppotune"]["memory_limit_gb"]
    on_gpu = detect_device(config["ppotune"]["device"]) == "cuda"
    cap = cap_text("--memory-limit-gb", flag, "ppotune.memory_limit_gb", limit)
    return cap_below_floor("train", config, limit_gb=limit, cap=cap, source=source, on_gpu=on_gpu)


def _verl_below_floor(args) -> Optional[str]:
    """``--engine verl``: the cap against the models' states of verl's composed config (its model's
    ``config.json``); None when there is no cap or the run file is refused (the adapter says why, as before)."""
    from trainer.verl_engine.adapter import decision_base, load_run, run_device

    try:
        spec = load_run(
            args.config,
            list(args.overrides),
            python=args.engine_python,
            memory_limit_gb=args.memory_limit_gb,
            device=args.device,
            nproc=args.nproc,
        )
        if spec.memory_limit_gb is None:
            return None
        device = run_device(spec)
        config = decision_base(spec, device=device)
    except ConfigError:
        return None
    cap = cap_text("--memory-limit-gb", args.memory_limit_gb, "ppotune.memory_limit_gb", spec.memory_limit_gb)
    return cap_below_floor(
        "train", config, limit_gb=spec.memory_limit_gb, cap=cap, source=args.config, on_gpu=device == "cuda"
    )


def _refuse(e: "ConfigError | str", result_path: Optional[Path]) -> int:
    """A refused config or input: one line, the result file the tuner reads (``config:`` error), exit 2."""
    print(f"ppotune train: error: {e}", file=sys.stderr)
    if result_path:
        write_json_atomic(result_path, error_result(f"config: {e}"))
    return ExitCode.USAGE


def _verl_inputs_refused(args) -> Optional[ConfigError]:
    """The verl run's inputs (its data files, model and tokenizer), checked before verl starts; None when they
    pass or when the run file itself is refused (verl's adapter says why, as before)."""
    from trainer.verl_engine.adapter import load_run

    try:
        spec = load_run(args.config, list(args.overrides), python=args.engine_python)
    except ConfigError:
        return None
    try:
        preflight_verl(spec.get, source=spec.source)
    except ConfigError as e:
        return e
    return None


# --------------------------------------------------------------------------- a warm job (--serve)


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
        return exit_code(failed)
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
    below = _below_floor(config, request["config"], flag=None)  # refused as a cold run refuses it
    if below is not None:
        pump.end([f"ppotune train: error: {below}"])
        return error_result(f"config: {below}", config=config, wall_s=time.time() - t0), False, False
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
        files = read_rank_files(rank_dir, nproc)
        if len(files) == nproc and all(f.get("done") for f in files.values()):
            returncode, ended = 0, False
            break
        if proc.poll() is not None:
            returncode, ended = proc.wait(), True
            pump.join(timeout=10)  # every line the ranks wrote is in the log and the tail
            files = read_rank_files(rank_dir, nproc) or read_rank_files(job.setup_dir, nproc)
            break
        time.sleep(JobDir.POLL_S)
    result = build_result(
        files, config=config, nproc=nproc, returncode=returncode, wall_s=time.time() - t0, log_tail=pump.tail()
    )
    out, err = outcome_lines(result)
    pump.end(out + err)
    shutil.rmtree(rank_dir, ignore_errors=True)  # the result holds everything the rank files had
    return result, ended, True
