"""``ppotune space check FILE [--base CONFIG] [--nproc N]``: validate a search space, print its size.

Exit 0 when the space is usable; exit 2 with one line naming the file and the key
otherwise (malformed YAML, a knob that is not a config key, an empty space, a bad
expression, constraints that nothing satisfies, a space the trainer config refuses).
"""

from __future__ import annotations

import argparse
import sys

from trainer.contracts import ExitCode, short_knob
from tuner.space.grid import GRID_LIMIT
from tuner.space.load import base_flat_config, load_space

__all__ = ["add_arguments", "run", "check"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="space_command", metavar="ACTION", required=True, parser_class=type(parser))
    p = sub.add_parser("check", help="validate a space against a base config and print its size and knobs")
    p.add_argument("file", help="search space YAML (e.g. search_spaces/default.yaml)")
    p.add_argument("--base", default=None, help="base config YAML (default: the embedded defaults)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes (GPUs) per trial; default: the base config's trainer.n_gpus_per_node",
    )


def check(file: str, base: str | None = None, nproc: int | None = None) -> tuple[object, dict, dict]:
    """Load + validate; raises SpaceError / ConfigError (both one-line ValueErrors)."""
    space = load_space(file)
    _, flat = base_flat_config(base, nproc=nproc, extra=space.fixed)
    report = space.validate(flat)
    return space, flat, report


def run(args: argparse.Namespace) -> int:
    try:
        space, flat, report = check(args.file, args.base, args.nproc)
    except ValueError as e:  # SpaceError, trainer.config.ConfigError
        print(f"ppotune space check: {e}", file=sys.stderr)
        return ExitCode.USAGE
    size = report["size"]
    size_text = f">{GRID_LIMIT:,}" if size > GRID_LIMIT else f"{size:,}"
    print(f"{args.file}: OK" + (f" - {space.description}" if space.description else ""))
    print(
        f"size: {size_text} distinct configs after conditions and constraints "
        f"(base {args.base or '<defaults>'}, nproc {flat['trainer.n_gpus_per_node']})"
    )
    print(
        f"trainer config check: {report['accepted']}/{report['sampled']} sampled configs accepted"
        + (f" (first refusal: {report['first_refusal']})" if report["first_refusal"] else "")
    )
    if space.fixed:
        print(f"fixed ({len(space.fixed)}), every trial and the baseline:")
        for key, value in space.fixed.items():
            print(f"  {key} = {value!r}")
    print(f"knobs ({len(space.knobs)}):")
    for knob in space.knobs:
        base_value = flat[knob.key]
        print(f"  {knob.describe()}  [base: {base_value!r}]")
    if space.derived:
        print(f"derived ({len(space.derived)}):")
        for d in space.derived:
            print(f"  {d.key} = {d.expr.text}" + (f"  when {d.when.text}" if d.when else ""))
    if space.constraints:
        print(f"constraints ({len(space.constraints)}):")
        for c in space.constraints:
            print(f"  [{c.index}] {c.expr.text}")
    baseline = space.baseline_values(flat)
    outside = [short_knob(k.key) for k in space.knobs if k.key not in baseline and space.active(k, flat)]
    if outside:
        print(
            f"note: the base config's value is outside the space for {', '.join(outside)} "
            "(the baseline trial still runs the base config as written)"
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    from tuner.cli import main

    sys.exit(main(["space", *sys.argv[1:]]))
