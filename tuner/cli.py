"""``ppotune``: one CLI, subcommands (optuna/cli.py style).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so
``ppotune search`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from trainer.contracts import ExitCode

__all__ = ["main"]

# command -> (module, one-line help)
_COMMANDS = {
    "train": ("trainer.launch.train", "run one PPO config on this node's ranks (a trial or a full training run)"),
    "search": ("tuner.search.command", "run an Optuna study of short, isolated PPO trials"),
    "check": ("trainer.launch.check", "validate a training config without launching anything (no GPU needed)"),
    "space": ("tuner.space.check", "validate a search space YAML and print its size"),
    "report": ("tuner.results.report", "write the Pareto report (HTML, PNG, CSV, summary.md) of a study"),
    "export": ("tuner.results.export", "write the chosen config: best_config.yaml, verl overrides, why.md"),
    "validate": ("tuner.validate", "run the exported config against the baseline, interleaved: PASS/FAIL vs the study"),
    "probe": (
        "tuner.stages.probe",
        "run one worst-case-length step of a config (longest prompts and responses): its peaks",
    ),
    "storage-proxy": ("tuner.study.proxy", "serve a study database to many workers through Optuna's gRPC proxy"),
    "make-preset": (
        "trainer.verl_engine.preset",
        "write a tiny offline job (model, tokenizer, data, reward) for an engine: verl",
    ),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(ExitCode.USAGE, f"ppotune {self.prog.split()[-1]}: error: {message}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="ppotune", description="Tune the per-GPU knobs of FSDP PPO training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in _COMMANDS else None
    parser = build_parser(only=command)
    if command is None:
        if not argv or argv[0] in ("-h", "--help"):
            parser.print_help()
            return ExitCode.OK if argv else ExitCode.USAGE
        parser.error(f"unknown command {argv[0]!r} (choose from {', '.join(_COMMANDS)})")
    args = parser.parse_args(argv)
    module = importlib.import_module(_COMMANDS[command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
