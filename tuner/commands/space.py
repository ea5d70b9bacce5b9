"""``ppotune space check [BASE] --space FILE [-o KEY=VALUE] [--nproc N] [--engine verl --engine-python PY]``: validate
a search space against a base config, print its size. (The argument order is ``ppotune search``'s; the old
``space check FILE --base BASE`` still works for one release, with a note.) With ``--engine verl`` BASE is a verl run
file: verl composes it (Hydra, in verl's own interpreter) as a trial on this machine runs it (the run file's
``ppotune.device``; on a CPU with the CPU shim's keys), and the space is checked against that config read into ours:
the one reading ``ppotune search --engine verl`` and its ``--dry-run`` make (:func:`tuner.trials.verl.verl_search`).

Exit 0 when the space is usable; exit 2 with one line naming the file and the key
otherwise (malformed YAML, a knob that is not a config key, an empty space, a bad
expression, constraints that nothing satisfies, a space the trainer config refuses).
"""

from __future__ import annotations

import argparse

from trainer.config import ConfigError, parse_override
from trainer.config.io import blame_command_line, check_override_keys
from trainer.contracts import short_knob
from tuner.commands.flags import add_override_flag, command_error, deprecated
from tuner.space.grid import GRID_LIMIT
from tuner.space.load import base_flat_config, load_space

__all__ = ["add_arguments", "run", "check"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="space_command", metavar="ACTION", required=True, parser_class=type(parser))
    p = sub.add_parser("check", help="validate a space against a base config and print its size and knobs")
    p.add_argument("base_config", nargs="?", default=None, help="base config YAML (default: the embedded defaults)")
    p.add_argument("--space", default=None, help="search space YAML (e.g. search_spaces/default.yaml)")
    add_override_flag(p, what="the base config")
    p.add_argument("--base", default=None, help=argparse.SUPPRESS)  # deprecated: the positional BASE
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes (GPUs) per trial; default: the base config's trainer.n_gpus_per_node",
    )
    p.add_argument(
        "--engine",
        choices=["ppotune", "verl"],
        default="ppotune",
        help="ppotune: BASE is a ppotune config; verl: BASE is a verl run file, composed by verl as a trial on this "
        "machine runs it, as ppotune search reads it (the run file's ppotune.device; default ppotune)",
    )
    p.add_argument(
        "--engine-python",
        default=None,
        help="--engine verl: the interpreter of the verl environment (default: the run file's ppotune.python)",
    )


def check(
    file: str,
    base: str | None = None,
    nproc: int | None = None,
    overrides: dict | None = None,
    *,
    verl_python: str | None = None,
    engine: str = "ppotune",
) -> tuple[object, dict, dict]:
    """Load + validate; raises SpaceError / ConfigError (both one-line ValueErrors). ``overrides``: the command
    line's ``-o`` on the base config (an error on one of their keys names the command line)."""
    space = load_space(file)
    over = dict(overrides or {})
    if engine == "verl":
        flat = _verl_base(space, base, nproc, over, python=verl_python)
        return space, flat, space.validate(flat)
    check_override_keys(over, over=base)
    try:
        _, flat = base_flat_config(base, nproc=nproc, extra={**over, **space.fixed})
    except ConfigError as e:
        raise blame_command_line(e, over, over=base) from None
    report = space.validate(flat)
    return space, flat, report


def _verl_base(space, run_file: str | None, nproc: int | None, over: dict, *, python: str | None) -> dict:
    """A verl run file as the search's decision base, read exactly as ``ppotune search --engine verl`` reads it
    (:func:`tuner.trials.verl.verl_search`: composed by verl for the device a trial runs on, the CPU keys on a CPU),
    with ``-o`` as Hydra overrides. A space search refuses is refused (:func:`tuner.trials.verl.check_verl_space`)."""
    from trainer.config import flatten
    from trainer.verl_engine.overrides import hydra_value
    from tuner.trials.verl import check_verl_space, verl_search

    if run_file is None:
        raise ValueError("--engine verl: give the verl run file: ppotune space check RUN --space SPACE --engine verl")
    check_verl_space(space)
    extra = [f"{k}={hydra_value(v)}" for k, v in over.items()]
    nested, _, _ = verl_search(
        run_file, python=python, nproc=nproc, steps=3, warmup=1, memory_limit_gb=None, extra=extra
    )
    return flatten(nested)


def _files(args: argparse.Namespace) -> tuple[str, str | None]:
    """(the space, the base config): ``BASE --space SPACE``, or the old ``SPACE --base BASE`` with its note."""
    if args.space is not None:
        if args.base is not None:
            raise ValueError("give the base config once: ppotune space check BASE --space SPACE")
        return args.space, args.base_config
    if args.base_config is None:
        raise ValueError("the following arguments are required: --space")
    old = "space check SPACE" + (" --base BASE" if args.base is not None else "")
    new = "space check " + ("BASE " if args.base is not None else "") + "--space SPACE"
    deprecated("space check", old, new)
    return args.base_config, args.base


def run(args: argparse.Namespace) -> int:
    try:
        args.file, args.base = _files(args)
        over = dict(parse_override(o) for o in args.override)
        space, flat, report = check(
            args.file, args.base, args.nproc, over, verl_python=args.engine_python, engine=args.engine
        )
    except ValueError as e:  # SpaceError, trainer.config.ConfigError
        return command_error("space check", str(e))
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
    dropped = dict(space.dropped(flat))
    print(f"knobs ({len(space.knobs) - len(dropped)}):")
    for knob in space.knobs:
        if knob.key not in dropped:
            print(f"  {knob.describe()}  [base: {flat[knob.key]!r}]")
    if dropped:
        print(f"dropped ({len(dropped)}), not searched: the base config does not build their role:")
        for key, why in dropped.items():
            print(f"  {key}: {why}")
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
