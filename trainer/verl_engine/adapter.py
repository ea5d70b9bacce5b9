"""``ppotune train --engine verl RUN.yaml``: one run of verl's own trainer, measured like ours.

verl is the production trainer; this engine runs ``python -m verl.trainer.main_ppo`` itself (with the
interpreter of the user's verl environment, ``--engine-python``) for a few steps and turns verl's own
per-step metrics (its file logger's JSONL) into ppotune's result JSON (``trainer/result_schema.json``),
so the tuner, the report and export read a verl trial exactly like one of ours. This module never
imports torch or verl.

A run file is the verl config as Hydra overrides, verl's keys only, plus how to run it::

    overrides:                       # or a nested/flat mapping of verl keys
      - actor_rollout_ref.model.path=/models/qwen2.5-7b
      - data.train_files=/data/train.parquet
      - actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    ppotune:                         # optional; flags win
      python: /envs/verl/bin/python
      steps: 3
      warmup: 1
      memory_limit_gb: null
      device: auto                   # auto | cpu | cuda
      precision: null                # stop measuring once the throughput interval is this tight (the search's)
      worst_case: false              # the worst-case probe (trainer.verl_engine.worst_case)

What a trial adds to the user's overrides (and export leaves out): ``TRIAL_KEYS`` (step count,
no validation or checkpoints, the file logger, no Ray dashboard unless the run file asks for one).
A run with ``precision`` (or a study's ``front``) reads verl's per-step JSONL as it is written and
ends verl once :func:`trainer.summary.measuring_done` says it has measured enough, as our own trainer
does (status ok, ``stopped_early`` in the summary). On a CPU-only machine it also loads the CPU shim
(:mod:`trainer.verl_engine.cpu`, verl 0.9.1 only) and adds ``CPU_KEYS``: nothing of it on a GPU.

Each run starts a local Ray of its own in a folder of its own (never a cluster RAY_ADDRESS or ``ray start`` left on
the node), and every process of it, Ray's daemons and workers included, has ended before the result is written
(docs/verl.md, "Ray: each trial's own").
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from trainer.config import ConfigError, flatten
from trainer.contracts import MEMORY_LINE, ExitCode, MemoryOutcome, memory_message
from trainer.launch.device import detect_device
from trainer.launch.proc import (
    PR_SET_CHILD_SUBREAPER,
    die_with_parent,
    kill_descendants,
    prctl,
    processes_of,
    with_pythonpath,
    write_json_atomic,
)
from trainer.verl_engine.metrics import Enough, lengths_of, steps_from_jsonl
from trainer.verl_engine.result import verl_result
from trainer.verl_engine.run_file import RunSpec, load_run
from trainer.verl_engine.schedule import LOG_ENV, RUN_ENV, SWEEP_ENV

__all__ = [
    "RunSpec",
    "load_run",
    "run_overrides",
    "run_device",
    "decision_base",
    "critic_as_verl_runs",
    "verl_env",
    "steps_from_jsonl",
    "lengths_of",
    "classify_failure",
    "train_verl",
    "SUPPORTED_VERL",
    "TRIAL_KEYS",
    "CPU_KEYS",
]

SUPPORTED_VERL = "0.9.1"  # the version the CPU shim is written against (a GPU runs any verl as shipped)
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # trainer/: what verl's processes import from us
SHIM_MODULE = "trainer.verl_engine.cpu"
CAP_MODULE = "trainer.verl_engine.cap"
PLUGIN_MODULE = "trainer.verl_engine.plugin"
#: keys a trial sets for itself (left out of what export recommends)
TRIAL_KEYS = (
    "trainer.total_training_steps",
    "trainer.val_before_train",
    "trainer.test_freq",
    "trainer.save_freq",
    "trainer.logger",  # the file logger first: a step's row is on disk before its console line
    "trainer.default_local_dir",
    "trainer.resume_mode",
    "ray_kwargs.ray_init.include_dashboard",  # unless the run file sets it: no web UI to start in a short trial
    "ray_kwargs.ray_init.address",  # "local": the trial's own Ray, whatever RAY_ADDRESS or a running cluster says
    "ray_kwargs.ray_init._temp_dir",  # that Ray's sessions, sockets and logs: a folder of the trial's own
)
#: keys the CPU shim needs (verl 0.9.1 on a machine with no accelerator; never set on a GPU)
CPU_KEYS = (
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.agent.num_workers",
    "reward.num_workers",
    "actor_rollout_ref.model.use_remove_padding",
    "critic.model.use_remove_padding",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units",
    "ray_kwargs.ray_init.num_gpus",
    "ray_kwargs.ray_init.num_cpus",
)
STRATEGY_KEYS = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy")
#: a line that says memory decided the run (trainer.contracts.MEMORY_MESSAGES, the table a rank's exception is read
#: with too): an OOM, or a vLLM share too small for one sequence (verl may wait on that server for ever as well)
_OOM = MEMORY_LINE
_TAIL_LINES = 80
OOM_GRACE_S = 30.0  # after an OOM line, how long verl gets to end by itself before it is ended


# --------------------------------------------------------------------------- the command
def run_device(spec: RunSpec) -> str:
    """``cpu`` or ``cuda``: what a run of ``spec`` runs on (its ``ppotune.device``; auto: a GPU when NVML sees one).
    Every reading of a run file (``space check``, ``search`` and its ``--dry-run``, ``probe``, the run) asks this."""
    return detect_device(spec.device)


def run_overrides(spec: RunSpec, *, device: str, workdir: Path, ray_dir: Optional[Path] = None) -> list[str]:
    """The user's overrides, then what a trial adds (``++``: set whether or not verl's config has the key).
    ``ray_dir``: the trial's Ray folder (:func:`ray_temp_dir`; default ``workdir/ray``, for a config composed only)."""
    out = list(spec.overrides)
    out += [
        f"++trainer.total_training_steps={spec.total_steps}",
        "++trainer.val_before_train=False",
        "++trainer.test_freq=-1",
        "++trainer.save_freq=-1",
        '++trainer.logger=["file","console"]',
        f"++trainer.default_local_dir={workdir / 'checkpoints'}",
        "++trainer.resume_mode=disable",
    ]
    if spec.get("ray_kwargs.ray_init.include_dashboard") is None:
        out.append("++ray_kwargs.ray_init.include_dashboard=False")  # docs/decisions.md#verl-no-ray-dashboard
    out += _own_ray(spec, ray_dir or workdir / "ray")
    if device == "cpu":
        for key in STRATEGY_KEYS:
            value = spec.get(key)
            if value is not None and value != "fsdp2":
                raise ConfigError(
                    key,
                    f"{value} cannot run verl on a CPU (FSDP1 refuses CPU parameters with "
                    "sync_module_states); use fsdp2",
                    source=spec.source,
                )
            out.append(f"++{key}=fsdp2")
        name = spec.get("actor_rollout_ref.rollout.name")
        if name not in (None, "hf"):
            spec.notes.append(f"actor_rollout_ref.rollout.name={name}: no effect on CPU (generated with HF generate)")
        for key in ("actor_rollout_ref.model.use_remove_padding", "critic.model.use_remove_padding"):
            if (spec.get(key) or "").lower() == "true":
                spec.notes.append(f"{key}: no effect on CPU (no flash-attn varlen kernel; run padded)")
        out += [
            "++actor_rollout_ref.rollout.name=hf",
            "++actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "++actor_rollout_ref.rollout.agent.num_workers=1",
            "++reward.num_workers=1",
            "++actor_rollout_ref.model.use_remove_padding=False",
            "++critic.model.use_remove_padding=False",
            # verl's default trainer (v1) keeps a step's batch in TransferQueue, one storage actor of 1 logical
            # CPU each (8 by default): one is enough on one node of a few ranks
            "++transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        ]
        # Ray must see one logical GPU per trainer rank, and each placement bundle asks 3 CPUs, plus
        # TransferQueue's controller and storage actor (with too few verl waits forever, with no error); a value
        # the user set wins
        for key, value in (
            ("ray_kwargs.ray_init.num_gpus", spec.nproc),
            ("ray_kwargs.ray_init.num_cpus", max(8, 4 * spec.nproc + 4) + 2),
        ):
            if spec.get(key) is None:
                out.append(f"++{key}={value}")
    return out


#: a folder of each trial's Ray is at most this long: Ray puts its sockets at
#: ``<folder>/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store``, and a Unix socket's path has at most
#: 107 bytes on Linux (``ray/_private/utils.py::validate_socket_filepath``)
RAY_DIR_MAX_CHARS = 40


def ray_temp_dir() -> Path:
    """A new folder for one trial's Ray (``ray.init(_temp_dir=...)``): under the system's temporary folder when the
    socket paths below it fit, else under ``/tmp``. Its own per trial: two ``--parallel`` trials share no session,
    socket or log file of Ray's."""
    root = tempfile.gettempdir()
    if len(os.path.join(root, "ppotune-ray-XXXXXXXX")) > RAY_DIR_MAX_CHARS:
        root = "/tmp"
    return Path(tempfile.mkdtemp(prefix="ppotune-ray-", dir=root))


def _own_ray(spec: RunSpec, ray_dir: Path) -> list[str]:
    """A local Ray of the trial's own. verl's ``main_ppo`` calls ``ray.init(**ray_kwargs.ray_init)``; with no
    address Ray joins the cluster RAY_ADDRESS names, else the last ``ray start``'s
    (``ray/_private/services.py::get_ray_address_from_environment``): the trial's processes would be that cluster's,
    started with its environment (no plugin, no file logger), out of the trial's reach. ``address=local`` starts a new
    one whatever either says (``canonicalize_bootstrap_address``)."""
    for key, ours in (("ray_kwargs.ray_init.address", "local"), ("ray_kwargs.ray_init._temp_dir", None)):
        value = spec.get(key)
        if value is not None and value != ours:
            spec.notes.append(f"{key}={value}: not in a trial, which starts a Ray of its own (ended with the trial)")
    return ["++ray_kwargs.ray_init.address=local", f"++ray_kwargs.ray_init._temp_dir={ray_dir}"]


def shim_path(workdir: Path) -> Path:
    """A folder holding only our ``trainer`` package (a link): verl's processes import the shim from it and
    nothing else of ours (never this environment's site-packages, whose libraries would shadow verl's)."""
    d = workdir / "pythonpath"
    d.mkdir(parents=True, exist_ok=True)
    link = d / PACKAGE_DIR.name
    if not link.exists():
        link.symlink_to(PACKAGE_DIR, target_is_directory=True)
    return d


def verl_env(spec: RunSpec, *, device: str, metrics_path: Path, run_id: str = "") -> dict[str, str]:
    """verl's environment: ours, less RAY_ADDRESS (the trial's Ray is its own: :func:`_own_ray`), with the plugin,
    the shim on a CPU, the file logger's path and ``RUN_ENV=run_id`` (its processes found wherever they went)."""
    env = with_pythonpath(dict(os.environ), shim_path(metrics_path.parent))
    env.pop("RAY_ADDRESS", None)
    if run_id:
        env[RUN_ENV] = run_id
    env["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("RAY_DEDUP_LOGS", "0")  # every worker's error lines reach the log we classify
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    modules = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if device == "cpu":
        env["VERL_PLATFORM"] = "cpu"
        env["VERL_ENGINE_DEVICE"] = "cuda"  # verl 0.9.1 registers its FSDP engine for cuda/npu only
        modules.append(SHIM_MODULE)
    if spec.memory_limit_gb is not None:
        env["PPOTUNE_MEMORY_LIMIT_GB"] = repr(float(spec.memory_limit_gb))
        modules.append(CAP_MODULE)
    env[LOG_ENV] = str(metrics_path.parent / "phases.jsonl")  # per-pass peaks and micro-batches (the plugin)
    modules.append(PLUGIN_MODULE)
    if modules:
        env["VERL_USE_EXTERNAL_MODULES"] = ",".join(dict.fromkeys(modules))
    return env


_PROBE = (
    "import importlib.metadata as m, importlib.util as u; "
    "print(m.version('verl'), u.find_spec('transfer_queue') is not None)"
)


def verl_probe(python: str) -> tuple[Optional[str], bool]:
    """(verl's version in the engine's environment, None when there is none; whether TransferQueue, which verl's
    default trainer keeps a step's batch in, is installed beside it)."""
    r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not r.stdout.strip():
        return None, False
    version, tq = r.stdout.split()[-2:]
    return version, tq == "True"


_COMPOSE = """
import importlib.util, json, os, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
root = os.path.dirname(importlib.util.find_spec("verl").origin)
with initialize_config_dir(config_dir=os.path.join(root, "trainer", "config"), version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=json.loads(sys.argv[1]))
print(json.dumps(OmegaConf.to_container(cfg, resolve=True), default=str))
"""


def compose_verl(spec: RunSpec, overrides: Optional[list[str]] = None) -> dict:
    """verl's own ``ppo_trainer`` config with the overrides, composed by Hydra in the engine's environment
    (verl's defaults of the verl version the user runs; verl itself is not imported)."""
    overrides = spec.overrides if overrides is None else overrides
    r = subprocess.run(
        [spec.python, "-c", _COMPOSE, json.dumps(overrides)], capture_output=True, text=True, timeout=120
    )
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise ConfigError("overrides", f"verl refused the config: {last}", source=spec.source)
    return json.loads(r.stdout.strip().splitlines()[-1])


def decision_base(spec: RunSpec, *, device: Optional[str] = None) -> dict:
    """The config a trial on ``device`` (default :func:`run_device`) runs, as ppotune's typed config (every key both
    have, verl's values), validated: what the search's constraints, config checks and memory rules reason about.
    The overrides are the run's own (:func:`run_overrides`: on a CPU with ``CPU_KEYS``). Raises ConfigError."""
    import copy

    from trainer.config import PPOConfig, config_from_dict, config_to_dict, unflatten

    device = device or run_device(spec)
    effective = run_overrides(copy.deepcopy(spec), device=device, workdir=Path(tempfile.gettempdir()))
    verl_flat = flatten(compose_verl(spec, effective))
    verl_flat.update(critic_as_verl_runs(verl_flat))
    ours = flatten(config_to_dict(PPOConfig()))
    taken = {}
    for key in ours:
        if key in verl_flat and not key.startswith("ppotune."):
            try:  # keep a value only where our type accepts verl's (e.g. not verl's list of train files)
                config_from_dict(unflatten({key: verl_flat[key]}), validate=False)
                taken[key] = verl_flat[key]
            except ConfigError:
                pass
    return config_to_dict(config_from_dict(unflatten(taken), source=spec.source))


#: verl 0.9.1's defaults for what its composed config leaves out: CriticConfig.ppo_infer_max_token_len_per_gpu
#: (workers/config/critic.py) and EngineConfig.use_dynamic_bsz (workers/config/engine.py)
_CRITIC_INFER_BUDGET, _ENGINE_DYNAMIC_BSZ = 32768, True


def critic_as_verl_runs(verl_flat: dict) -> dict:
    """ppotune's critic batching keys as verl 0.9.1 runs its critic (a TrainingWorker on the engine config
    ``critic.fsdp``): dynamic bsz and micro-batches from ``critic.fsdp``, the values pass's budget
    ``critic.ppo_infer_max_token_len_per_gpu``, the update's the same on the v1 trainer (its default) and
    ``critic.ppo_max_token_len_per_gpu`` on the legacy one (``trainer/ppo/v1/trainer_base.py:PPOTrainer._setup``,
    ``trainer/ppo/ray_trainer.py:RayPPOTrainer.init_workers``). The decision base and the memory model then reason
    about the critic verl runs, not the keys it ignores (``tuner.space.registry.VERL_NO_OPS``)."""
    infer = verl_flat.get("critic.ppo_infer_max_token_len_per_gpu") or _CRITIC_INFER_BUDGET
    v1 = str(verl_flat.get("trainer.use_v1", True)).lower() == "true"
    return {
        "critic.use_dynamic_bsz": verl_flat.get("critic.fsdp.use_dynamic_bsz", _ENGINE_DYNAMIC_BSZ),
        "critic.ppo_micro_batch_size_per_gpu": verl_flat.get("critic.fsdp.micro_batch_size_per_gpu"),
        "critic.forward_micro_batch_size_per_gpu": verl_flat.get("critic.fsdp.infer_micro_batch_size_per_gpu"),
        "critic.ppo_max_token_len_per_gpu": infer if v1 else verl_flat["critic.ppo_max_token_len_per_gpu"],
        "critic.forward_max_token_len_per_gpu": infer,
    }


# --------------------------------------------------------------------------- verl's metrics -> our result
def classify_failure(returncode: int, log_tail: str) -> tuple[str, str]:
    """(result status, one-line error) of a verl run that did not finish, from the first line any process said about
    memory (the message surfaces inside Ray task errors and worker logs): ``oom`` when it ran out; a config refusal
    (``error`` with ``config:``: the trial is ``invalid``) when vLLM's share of the device holds no sequence, the
    lower bound ``ppotune fit`` reads back; else ``error``."""
    lines = log_tail.splitlines()
    for line in lines:
        found = memory_message(line)
        if found is not None:
            text = line.strip()  # its last 300 characters, or 300 from where the message starts when it is earlier
            start = min(re.search(found.pattern, text, re.IGNORECASE).start(), max(0, len(text) - 300))
            status = "oom" if found.outcome is MemoryOutcome.OOM else "error"
            return status, found.error(text[start : start + 300])
    err = next((ln.strip() for ln in reversed(lines) if re.search(r"Error|error:|Exception", ln)), None)
    return "error", (err or f"verl exited with code {returncode}")[-300:]


# --------------------------------------------------------------------------- the run
def run_verl(spec: RunSpec, *, result_path: Optional[Path]) -> int:
    """Run verl for ``spec.steps`` steps (fewer when it has measured enough), write the result JSON, return the
    exit code (ExitCode)."""
    t0 = time.time()
    device = run_device(spec)
    # absolute: verl's processes (Ray's workers) do not run in our working directory
    workdir = Path(tempfile.mkdtemp(prefix="ppotune_verl_", dir=result_path.parent if result_path else None)).resolve()
    metrics = workdir / "metrics.jsonl"
    ray_dir = ray_temp_dir()
    version, has_tq = verl_probe(spec.python)
    config = {"engine": "verl", "verl_version": version, "python": spec.python, "overrides": spec.overrides}

    def finish(status: str, error: Optional[str], rows: list, tail: Optional[str], code: int, stopped=None) -> int:
        result = verl_result(
            spec,
            device=device,
            version=version,
            config=config,
            status=status,
            error=error,
            rows=rows,
            tail=tail,
            t0=t0,
            stopped=stopped,
        )
        if result_path:
            write_json_atomic(result_path, result)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(ray_dir, ignore_errors=True)
        return code

    try:
        _check_version(spec, device, version, has_tq)
        overrides = run_overrides(spec, device=device, workdir=workdir, ray_dir=ray_dir)
        if spec.worst_case:
            overrides += _worst_case(spec, workdir)
    except ConfigError as e:
        print(f"ppotune train: error: {e}", file=sys.stderr)
        return finish("error", f"config: {e}", [], None, ExitCode.USAGE)
    if device == "cpu":
        spec.notes.append(
            "verl CPU shim loaded (trainer.verl_engine.cpu): cpu platform, gloo, eager attention, HF rollout"
        )
    cmd = [spec.python, "-m", "verl.trainer.main_ppo", *overrides]
    config["command"] = cmd
    print("$ " + " ".join(cmd), flush=True)
    watch = Enough(spec, metrics, device)
    env = verl_env(spec, device=device, metrics_path=metrics, run_id=ray_dir.name)
    if spec.sweep:  # the plugin reads the schedule; a sweep measures every setting for its steps (no early stop)
        (workdir / "sweep.json").write_text(spec.schedule.to_json())
        env[SWEEP_ENV] = str(workdir / "sweep.json")
        spec.notes.append(f"in-run sweep: {len(spec.sweep)} settings of the per-step knobs in one verl run")
    returncode, text, oom_line = _stream(cmd, env=env, cwd=workdir, enough=watch, end=lambda: _end_run(spec, ray_dir))
    text_rows = metrics.read_text() if metrics.is_file() else ""
    rows = steps_from_jsonl(text_rows, warmup=spec.warmup, device=device, schedule=spec.schedule)
    measured = [r for r in rows if not r["warmup"]]
    if watch.stopped and measured:  # it measured enough: ended by us, not by a failure
        return finish("ok", None, rows, None, ExitCode.OK, watch.stopped)
    if returncode == 0 and len(rows) >= spec.total_steps and measured:
        return finish("ok", None, rows, None, ExitCode.OK)
    status, error = classify_failure(returncode, "\n".join([*oom_line, text]))  # an OOM line from anywhere in the log
    if returncode == 0 and status == "error":
        error = f"verl exited 0 after {len(rows)} of {spec.total_steps} steps"
    return finish(status, error, rows, text, ExitCode.OOM if status == "oom" else ExitCode.ERROR)


def _worst_case(spec: RunSpec, workdir: Path) -> list[str]:
    """The worst-case probe's overrides, its prompts generated first (trainer.verl_engine.worst_case)."""
    from trainer.verl_engine.worst_case import worst_case_overrides, write_worst_case_data

    print("ppotune train: generating the worst-case prompts (data.max_prompt_length real tokens each)", flush=True)
    data = write_worst_case_data(spec.python, spec.overrides, workdir / "worst_case.parquet", source=spec.source)
    spec.notes.append(
        "worst case: every prompt data.max_prompt_length real tokens (generated from the train file), "
        "actor_rollout_ref.rollout.ignore_eos=True"
    )
    return worst_case_overrides(data)


def _check_version(spec: RunSpec, device: str, version: Optional[str], has_tq: bool) -> None:
    """ConfigError when the engine's environment has no verl, a verl the CPU shim was not written for, or no
    TransferQueue for verl's default trainer path."""
    if version is None:
        raise ConfigError("ppotune.python", f"verl is not installed for {spec.python}", source=spec.source)
    if not has_tq and (spec.get("trainer.use_v1") or "true").lower() != "false":
        raise ConfigError(
            "ppotune.python",
            f"{spec.python}: verl's default trainer (trainer.use_v1: true) keeps a step's batch in TransferQueue, "
            "which this environment lacks: pip install TransferQueue there (verl's verl-core extra)",
            source=spec.source,
        )
    if device == "cpu" and version != SUPPORTED_VERL:
        raise ConfigError(
            "ppotune.python",
            f"verl {version}: the CPU shim supports verl {SUPPORTED_VERL} only "
            "(a GPU machine runs any verl as shipped)",
            source=spec.source,
        )


def _stream(
    cmd: list[str], *, env: dict[str, str], cwd: Path, enough=lambda: None, end=kill_descendants
) -> tuple[int, str, list[str]]:
    """Run verl's driver, its output echoed and its last lines kept: (exit code, the tail, [the first OOM
    line] or []). SIGTERM and SIGINT are passed on to it; so is the end once ``enough()`` says it measured
    enough (asked after each line); once it ends, ``end()`` ends every process it left (its descendants)."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # Ray's daemons that outlive the driver come back to us
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=env,
        cwd=str(cwd),
        preexec_fn=lambda: die_with_parent(signal.SIGTERM),
    )
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    oom_line: list[str] = []

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    # A Ray worker that ran out of memory does not always end the run: verl may wait on it forever.
    # Once an OOM is in the log, give the run OOM_GRACE_S to end by itself, then end it (status oom).
    watchdog = threading.Timer(OOM_GRACE_S, forward, args=(signal.SIGTERM, None))
    watchdog.daemon = True

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
            if not oom_line and _OOM.search(line):
                oom_line.append(line.strip())
                watchdog.start()
            why = None if oom_line or proc.poll() is not None else enough()
            if why:
                print(f"ppotune train: measured enough, ending verl: {why}", flush=True)
                proc.send_signal(signal.SIGTERM)
        returncode = proc.wait()
    finally:
        watchdog.cancel()
        for s, h in old.items():
            signal.signal(s, h)
        end()
    return returncode, "\n".join(tail), oom_line


#: how long the trial's processes get to end by themselves after SIGTERM (Ray's daemons shut their workers down)
END_GRACE_S = 5.0


def _end_run(spec: RunSpec, ray_dir: Path) -> None:
    """End every process of the run before its result is written: what is below us (we are a subreaper: Ray's
    daemons and workers whose parent died come back to us), and what belongs to the trial's Ray session wherever it
    went (its folder on a daemon's command line, ``RUN_ENV`` in a worker's environment, a log open in that folder).
    Only the trial's own Ray is touched: never ``ray stop``, which ends every Ray of the machine (another user's too).
    One that survives SIGKILL (a process stuck in the kernel) is named in the result's notes."""
    left = kill_descendants(END_GRACE_S, also=lambda: processes_of(text=str(ray_dir), env=(RUN_ENV, ray_dir.name)))
    if left:
        print(f"ppotune train: processes of the verl run alive after SIGKILL: {left}", flush=True)
        spec.notes.append(f"processes of the verl run alive after SIGKILL: {left}")


def train_verl(args: Any) -> int:
    """``ppotune train --engine verl`` (the launcher hands its parsed flags over)."""
    result_path = Path(args.result) if args.result else None
    try:
        spec = load_run(
            args.config,
            list(args.overrides),
            python=args.engine_python,
            steps=args.steps,
            warmup=args.warmup,
            memory_limit_gb=args.memory_limit_gb,
            device=args.device,
            nproc=args.nproc,
        )
    except ConfigError as e:
        print(f"ppotune train: error: {e}", file=sys.stderr)
        if result_path:
            from trainer.launch.result import error_result

            write_json_atomic(result_path, error_result(f"config: {e}"))
        return ExitCode.USAGE
    code = run_verl(spec, result_path=result_path)
    print(f"ppotune train: verl run finished with exit code {int(code)}", flush=True)
    return code
