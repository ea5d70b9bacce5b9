"""What every ``ppotune`` command spells the same way: ``-o KEY=VALUE`` overrides, the one error line, the
one-line note on a deprecated spelling, the check of a memory cap against the models' states."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Mapping, Optional

from trainer.contracts import ExitCode
from trainer.verl_engine.result import actor_shape
from tuner.memory_model import ModelShape, flat_config
from tuner.memory_model.floor import MemoryFloor, below_floor, memory_floor, tiny_shape

__all__ = [
    "add_override_flag",
    "overrides_of",
    "command_error",
    "deprecated",
    "floor_of",
    "cap_below_floor",
    "cap_text",
]


def add_override_flag(p: argparse.ArgumentParser, *, positional: bool = False, what: str = "the config") -> None:
    """``-o/--override KEY=VALUE`` (repeatable) on ``what``; with ``positional`` also trailing ``key=value``
    words (train and check took them first: both spellings stay)."""
    if positional:
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="key=value",
            help="dotted overrides, as -o (kept for train and check)",
        )
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a dotted override of {what} (repeatable), e.g. -o data.max_response_length=4096 (default: none)",
    )


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """A training config, its ``key=value`` overrides and ``--nproc``: how ``train`` and ``check`` take a job."""
    p.add_argument("config", help="training config YAML (verl key names)")
    add_override_flag(p, positional=True)
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes (GPUs) on this node; sets trainer.n_gpus_per_node (default: the config's)",
    )


def add_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default=None, help="sets ppotune.device (default: the config's)"
    )


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The command line's ``key=value`` overrides in order: positional ones first, then ``-o``."""
    return [*(getattr(args, "overrides", None) or []), *(getattr(args, "override", None) or [])]


def command_error(command: str, message: str, code: int = ExitCode.USAGE) -> int:
    """``ppotune COMMAND: error: MESSAGE`` on stderr (one line); returns ``code`` (2: bad input)."""
    print(f"ppotune {command}: error: {message}", file=sys.stderr, flush=True)
    return code


def deprecated(command: str, old: str, new: str) -> None:
    """The one-line note an old spelling gets for one release: ``ppotune CMD: note: OLD is deprecated ...``."""
    print(
        f"ppotune {command}: note: {old} is deprecated and goes in the next release; use {new}",
        file=sys.stderr,
        flush=True,
    )


def _shapes(config: Mapping[str, Any]) -> tuple[list[ModelShape], Optional[str]]:
    """The models' shapes (the actor's, the critic's when it is another checkpoint) read here without weights, or
    ([], why not)."""
    tiny = tiny_shape(config)
    if tiny is not None:
        return [tiny], None
    flat = flat_config(config)
    paths = dict.fromkeys(p for p in (flat["actor_rollout_ref.model.path"], flat.get("critic.model.path")) if p)
    shapes = []
    for path in paths:
        found = actor_shape(path)
        if found is None:
            return [], f"no config.json readable here at {path}"
        try:
            shapes.append(ModelShape.from_dict(found))
        except ValueError as e:
            return [], f"{path}: {e}"
    return shapes, None


def floor_of(command: str, config: Mapping[str, Any], *, cap: str, on_gpu: bool) -> Optional[MemoryFloor]:
    """The models' states in ``config`` (nested or flat, at the run's world: :mod:`tuner.memory_model.floor`), or None
    with a note that ``cap`` is not checked where the model's shape cannot be read here (a verl run file's hub id)."""
    shapes, why = _shapes(config)
    if not shapes:
        print(f"ppotune {command}: note: {cap} not checked against the models' states: {why}", file=sys.stderr)
        return None
    return memory_floor(config, shapes, on_gpu=on_gpu)


def cap_below_floor(
    command: str, config: Mapping[str, Any], *, limit_gb: Optional[float], cap: str, source: str, on_gpu: bool
) -> Optional[str]:
    """The one line (:func:`tuner.memory_model.floor.below_floor`) when a cap of ``limit_gb`` GiB per rank is below
    the models' states in ``config``, else None. ``cap`` names the key and its value."""
    if limit_gb is None:
        return None
    floor = floor_of(command, config, cap=cap, on_gpu=on_gpu)
    return below_floor(limit_gb, floor, cap=cap, source=source) if floor is not None else None


def cap_text(flag: str, flag_value: Optional[float], key: str, value: Optional[float]) -> str:
    """How a refusal names the cap: the command line's flag when it set it, else the config's key."""
    if flag_value is not None:
        return f"{flag} {flag_value:g}"
    return f"{key}: {value:g}" if value is not None else key
