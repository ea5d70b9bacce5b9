"""What every ``ppotune`` command spells the same way: ``-o KEY=VALUE`` overrides, the one error line, the
one-line note on a deprecated spelling."""

from __future__ import annotations

import argparse
import sys

from trainer.contracts import ExitCode

__all__ = ["add_override_flag", "overrides_of", "command_error", "deprecated"]


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
