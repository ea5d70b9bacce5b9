"""``ppotune``: one CLI, subcommands (optuna/cli.py style).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so
``ppotune search`` never imports torch.

Every command reads the same way: ``--out DIR`` is where it writes, ``--storage``/``--study`` the study it reads,
``-o KEY=VALUE`` an override of its config; every flag's help shows its default; a misspelt command, flag or
choice gets the closest real one; an error is one line, ``ppotune COMMAND: error: ...``, exit 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys

from trainer.contracts import ExitCode

__all__ = ["main", "build_parser", "version"]

# command -> (module, one-line help)
_COMMANDS = {
    "train": ("tuner.commands.train", "run one PPO config on this node's ranks (a trial or a full training run)"),
    "search": ("tuner.commands.search", "run an Optuna study of short, isolated PPO trials"),
    "check": ("tuner.commands.check", "validate a training config without launching anything (no GPU needed)"),
    "space": ("tuner.commands.space", "validate a search space YAML and print its size"),
    "report": ("tuner.commands.report", "write the Pareto report (HTML, PNG, CSV, summary.md) of a study"),
    "export": ("tuner.commands.export", "write the chosen config: best_config.yaml, verl overrides, why.md"),
    "validate": (
        "tuner.commands.validate",
        "run the exported config against the baseline, interleaved: PASS/FAIL vs the study",
    ),
    "fit": (
        "tuner.commands.fit",
        "the largest per-GPU sizes whose worst-case step keeps the headroom free: a few worst-case probes",
    ),
    "probe": (
        "tuner.commands.probe",
        "run one worst-case-length step of a config (longest prompts and responses): its peaks",
    ),
    "storage-proxy": (
        "tuner.commands.storage_proxy",
        "serve a study database to many workers through Optuna's gRPC proxy",
    ),
    "make-preset": (
        "tuner.commands.make_preset",
        "write a tiny offline job (model, tokenizer, data, reward) for an engine: verl",
    ),
}


def version() -> str:
    """The installed package's version (its metadata), else the source tree's ``tuner.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("ppotune")
    except PackageNotFoundError:
        from tuner import __version__

        return __version__


class _Formatter(argparse.HelpFormatter):
    """Help that shows every flag's default (unless its help already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, [], argparse.SUPPRESS) and action.nargs != 0
        if action.option_strings and shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """`` (did you mean X?)`` for an unknown flag or choice in ``message``, or ``""``."""
    m = _CHOICE.search(message)
    if m:
        word, choices = m.group(1), re.findall(r"'([^']*)'", m.group(2))
    elif message.startswith("unrecognized arguments:"):
        flags = [w for w in message.split(":", 1)[1].split() if w.startswith("-")]
        if not flags:
            return ""
        word = flags[0].split("=", 1)[0]
        choices = [o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
    else:
        return ""
    near = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {near[0]}?)" if near else ""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, the program name once, exit 2
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message}{_suggestion(self, message)}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="ppotune", description="Tune the per-GPU knobs of FSDP PPO training.")
    parser.add_argument("--version", action="version", version=f"ppotune {version()}", help="print the version")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def _leaf(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser that parsed the command ``args`` came from: ``ppotune space check``'s, not ``ppotune``'s."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                return _leaf(action.choices[chosen], args)
    return parser


def _options(parser: argparse.ArgumentParser, *, hidden: bool = False) -> list[str]:
    """Every flag of ``parser`` and of its subcommands (``hidden``: the suppressed ones too)."""
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            out += [o for p in a.choices.values() for o in _options(p, hidden=hidden)]
        elif hidden or a.help != argparse.SUPPRESS:
            out += a.option_strings
    return out


def _unknown_flag(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The first ``--flag`` in ``argv`` that is no flag of the command (nor the start of one), said with the
    closest real one: checked before argparse, whose "required" error would hide a misspelt required flag."""
    known, shown = _options(parser, hidden=True), _options(parser)
    for word in argv:
        if word == "--":
            return None
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and not any(o.startswith(flag) for o in known):
            near = difflib.get_close_matches(flag, shown, n=1, cutoff=0.6)
            return f"unrecognized arguments: {flag}" + (f" (did you mean {near[0]}?)" if near else "")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in _COMMANDS else None
    parser = build_parser(only=command or "")  # no command: no command's module imported (--version, --help)
    if command is None:
        if not argv or argv[0] in ("-h", "--help", "--version"):
            if argv and argv[0] == "--version":
                parser.parse_args(argv)
            parser.print_help()
            return ExitCode.OK if argv else ExitCode.USAGE
        near = difflib.get_close_matches(argv[0], list(_COMMANDS), n=1, cutoff=0.5)
        hint = f"did you mean {near[0]}?" if near else f"choose from {', '.join(_COMMANDS)}"
        parser.error(f"unknown command {argv[0]!r} ({hint})")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    bad = _unknown_flag(sub, argv[1:])
    if bad:
        sub.exit(ExitCode.USAGE, f"{sub.prog}: error: {bad}\n")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _leaf(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    module = importlib.import_module(_COMMANDS[command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
