"""``ppotune train``: validate the config, run torchrun, write the result JSON.

This process never imports torch. It starts ``python -m torch.distributed.run`` in its own
process group, forwards SIGTERM/SIGINT to it, and once every rank has exited it reads the
per-rank status files and writes the result (``trainer/result_schema.json``). torchrun exits 1
whatever a rank's code was, so the files, not the exit code, say what happened.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from .config import ConfigError, config_to_dict, load_config
from .contracts import RESULT_SCHEMA_VERSION, ExitCode
from .proc import die_with_parent, write_json_atomic
from .summary import summarize_steps

__all__ = ["add_arguments", "run", "build_result", "error_result"]

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


def _overrides(args) -> list[str]:
    out = list(args.overrides)
    flags = {
        "trainer.n_gpus_per_node": args.nproc,
        "trainer.total_training_steps": args.steps,
        "ppotune.warmup_steps": args.warmup,
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
                f"rank(s) {missing} exited without a status (killed by a signal?); torchrun exit code {returncode}"
            )
        if errors:
            first = rank_files[errors[0]]
            parts.append(f"rank {errors[0]} failed in phase {first.get('phase')}: {first.get('error')}")
        error = "; ".join(parts) or f"torchrun exit code {returncode}"
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
        "steps": lead.get("steps", []),
        "summary": lead.get("summary") or summarize_steps([], device_type="cpu"),
        "environment": env or {"device": "cpu", "world_size": nproc, "backend": "gloo"},
        "notes": notes,
        "log_tail": None if status == "ok" else log_tail,
        "wall_s": wall_s,
    }


def run(args) -> int:
    if args.engine == "verl":
        from .verl_engine import run as run_verl

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
    nproc = cfg.trainer.n_gpus_per_node
    if result_path:
        result_path.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ppotune_run_", dir=result_path.parent if result_path else None))
    cfg_file = workdir / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--module",
        "trainer.run",
        str(cfg_file),
        "--rank-dir",
        str(workdir),
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env.setdefault("TORCHELASTIC_ERROR_FILE", str(workdir / "torchelastic_error.json"))
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        bufsize=1,
        # torchrun ends with us even if we are SIGKILLed (it then SIGTERMs its ranks)
        preexec_fn=lambda: die_with_parent(signal.SIGTERM),
    )
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    def forward(signum, _frame):
        # torchrun passes SIGTERM on to its ranks; then we still collect and write what happened.
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
    rank_files = {}
    for r in range(nproc):
        f = workdir / f"rank{r}.json"
        if f.is_file():
            try:
                rank_files[r] = json.loads(f.read_text())
            except json.JSONDecodeError:
                pass
    result = build_result(
        rank_files, config=config, nproc=nproc, returncode=returncode, wall_s=time.time() - t0, log_tail="\n".join(tail)
    )
    if result_path:
        write_json_atomic(result_path, result)
    shutil.rmtree(workdir, ignore_errors=True)  # the result holds everything the rank files had
    s = result["summary"]
    if result["status"] == "ok":
        thr = s.get("throughput")
        print(
            f"ppotune train: ok | throughput {thr:.1f} tokens/s/GPU | step {s.get('step_s'):.2f} s | "
            f"peak memory {s.get('peak_memory_gb'):.2f} GB ({s.get('memory_source')})"
            if thr is not None
            else "ppotune train: ok"
        )
        for note in result["notes"]:
            print(f"note: {note}")
        return ExitCode.OK
    print(f"ppotune train: {result['status']}: {result['error']}", file=sys.stderr)
    return ExitCode.OOM if result["status"] == "oom" else ExitCode.ERROR
