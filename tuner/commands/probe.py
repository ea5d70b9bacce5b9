"""``ppotune probe CONFIG``: one worst-case step of a config (:func:`tuner.trials.probe.probe`), alone.

CONFIG is a training config, or a verl run file (what export wrote for an ``--engine verl`` study: probed through
verl itself). Exit codes (``ExitCode``): 0 it fits, 3 it ran out of memory, 2 bad input (one line naming the file
and the key), 1 another failure (crash, hang), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from trainer.config import (
    ConfigError,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    parse_override,
    read_yaml_mapping,
)
from trainer.contracts import ExitCode, Status
from tuner.commands.flags import add_device_flag, add_override_flag, cap_below_floor, cap_text
from tuner.trials.launch import add_hang_flags, next_numbered_dir, stop_on_signals
from tuner.trials.memory import nvml_available
from tuner.trials.probe import PROBE_KEYS, probe
from tuner.trials.runners import SubprocessRunner, VerlEngine

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the config to probe (a training config, e.g. ppotune export's best_config.yaml)")
    add_override_flag(p, what="the config")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes (GPUs) on this node; sets trainer.n_gpus_per_node (default: the config's)",
    )
    p.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        help="a real per-process memory cap (GPU: allocator fraction; CPU: RLIMIT_DATA); sets ppotune.memory_limit_gb "
        "(default: the config's)",
    )
    add_device_flag(p)
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="the probe's files go to DIR/probe/<k>/ (default: CONFIG's directory)",
    )
    p.add_argument(
        "--engine-python",
        metavar="PY",
        default=None,
        help="CONFIG a verl run file (export of an --engine verl study): the interpreter of your verl environment "
        "(default: CONFIG's ppotune.python, else this one)",
    )
    add_hang_flags(p, subject="a probe", step=False)  # one step: no next step to wait for


def _config_of(args) -> dict:
    """CONFIG + ``-o`` overrides + flags -> the probe's validated nested config; ConfigError naming the key."""
    data = read_yaml_mapping(args.config, what="the config to probe")
    flat = dict(parse_override(o) for o in args.override)
    flags = {
        "trainer.n_gpus_per_node": args.nproc,
        "ppotune.memory_limit_gb": args.memory_limit_gb,
        "ppotune.device": args.device,
    }
    flat.update({k: v for k, v in flags.items() if v is not None})
    checked = config_to_dict(config_from_dict(apply_overrides(data, flat), source=args.config))
    return config_to_dict(config_from_dict(apply_overrides(checked, PROBE_KEYS), source=args.config))


def _verl_of(args) -> tuple[dict, VerlEngine]:
    """A verl run file (what export wrote for an ``--engine verl`` study) + ``-o`` (Hydra overrides) + flags -> (the
    probe's nested config: verl's composed config read into ours, the trial's ``ppotune`` keys; how it runs)."""
    from trainer.verl_engine import adapter

    spec = adapter.load_run(
        args.config, list(args.override), python=args.engine_python, memory_limit_gb=args.memory_limit_gb
    )
    if args.nproc is not None:
        spec.overrides.append(f"trainer.n_gpus_per_node={args.nproc}")
    spec.device = args.device or spec.device
    device = adapter.run_device(spec)  # the one reading of a run file (tuner.trials.verl.verl_search's)
    nested = adapter.decision_base(spec, device=device)
    if nested["trainer"]["nnodes"] != 1:
        raise ConfigError(
            "trainer.nnodes",
            f"{nested['trainer']['nnodes']}: a probe runs on this node; pass -o trainer.nnodes=1 with the global "
            "sizes of one node, or probe within the search (ppotune search --probe K: at the trials' world)",
            source=args.config,
        )
    nested = apply_overrides(nested, {"ppotune.memory_limit_gb": spec.memory_limit_gb, "ppotune.device": device})
    engine = VerlEngine(spec.python, tuple(spec.overrides), steps=1, warmup=0, memory_limit_gb=spec.memory_limit_gb)
    return config_to_dict(config_from_dict(apply_overrides(nested, PROBE_KEYS), source=args.config)), engine


def _session_dir(args) -> Path:
    return next_numbered_dir((Path(args.out) if args.out else Path(args.config).resolve().parent) / "probe")


_EXIT = {Status.OK: ExitCode.OK, Status.OOM: ExitCode.OOM, Status.INVALID: ExitCode.USAGE}


def run(args) -> int:
    try:  # a verl run file (overrides: [...]) is probed through verl itself
        verl = isinstance(read_yaml_mapping(args.config, what="the config to probe").get("overrides"), list)
        config, engine = _verl_of(args) if verl else (_config_of(args), None)
    except ConfigError as e:
        print(f"ppotune probe: error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    nproc = config["trainer"]["n_gpus_per_node"]
    device = "cuda" if config["ppotune"]["device"] != "cpu" and nvml_available() else "cpu"
    limit = config["ppotune"]["memory_limit_gb"]
    cap = cap_text("--memory-limit-gb", args.memory_limit_gb, "ppotune.memory_limit_gb", limit)
    below = cap_below_floor("probe", config, limit_gb=limit, cap=cap, source=args.config, on_gpu=device == "cuda")
    if below is not None:  # a probe under it would die in its set-up, differently every run
        print(f"ppotune probe: error: {below}", file=sys.stderr)
        return ExitCode.USAGE
    runner = SubprocessRunner(
        device_kind=device,
        nproc=nproc,
        grace_s=args.kill_grace,
        startup_timeout_s=args.startup_timeout,
        verl=engine,
    )
    try:
        out = _session_dir(args)
    except OSError as e:
        print(f"ppotune probe: error: --out: {e}", file=sys.stderr)
        return ExitCode.USAGE
    data = config["data"]
    print(
        f"ppotune probe: {args.config}: one worst-case step (every prompt {data['max_prompt_length']} tokens, "
        f"every response {data['max_response_length']} tokens, EOS ignored) on {device} x{nproc}; files in {out}",
        flush=True,
    )
    stop = threading.Event()
    with stop_on_signals(stop) as got:
        result = probe(config, runner=runner, trial_dir=out, stop=stop)
    (out / "probe.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if got or result.status is Status.INTERRUPTED:
        print(f"ppotune probe: stopped{f' by {signal.Signals(got[0]).name}' if got else ''}; nothing measured")
        return ExitCode.INTERRUPTED if not got or got[0] == signal.SIGINT else 128 + got[0]
    for line in result.lines():
        print(line)
    for note in result.notes:
        print(f"note: {note}")
    print(f"ppotune probe: {result.status.value} ({out / 'probe.json'})", flush=True)
    return _EXIT.get(result.status, ExitCode.ERROR)
