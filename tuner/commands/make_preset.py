"""``ppotune make-preset verl --out DIR``: write the tiny offline verl job (:mod:`trainer.verl_engine.preset`).

The one command that needs torch and transformers (the preset's model and tokenizer): they are imported by the
preset's functions when the command runs, never by its parser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.config import DataConfig, SyntheticDataConfig, TinyModelConfig
from trainer.contracts import ExitCode
from trainer.verl_engine.preset import PRESETS, make_verl_preset
from tuner.commands.flags import deprecated

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    tiny, syn = TinyModelConfig(), SyntheticDataConfig()
    p.add_argument("preset", choices=PRESETS, help="which engine the preset is for")
    p.add_argument("dir", metavar="DIR", nargs="?", default=None, help=argparse.SUPPRESS)  # deprecated: --out DIR
    p.add_argument(
        "--out", metavar="DIR", help="output directory (created; must be empty unless --force; no default: required)"
    )
    p.add_argument("--hidden-size", type=int, default=tiny.hidden_size, help="model hidden size")
    p.add_argument("--layers", type=int, default=tiny.num_hidden_layers, help="decoder layers")
    p.add_argument("--heads", type=int, default=tiny.num_attention_heads, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=tiny.num_key_value_heads, help="key/value heads (GQA)")
    p.add_argument("--intermediate", type=int, default=tiny.intermediate_size, help="MLP intermediate size")
    p.add_argument("--num-prompts", type=int, default=256, help="training prompts")
    p.add_argument("--num-val-prompts", type=int, default=32, help="validation prompts")
    p.add_argument(
        "--max-response-length",
        type=int,
        default=DataConfig.max_response_length,
        help="data.max_response_length in the overrides",
    )
    p.add_argument("--seed", type=int, default=syn.seed, help="seed of the data and of the model's initial weights")
    p.add_argument("--force", action="store_true", help="write into a non-empty DIR (overwrites the preset's files)")


def run(args) -> int:
    if args.dir is not None and args.out is None:
        deprecated("make-preset", f"make-preset {args.preset} DIR", f"make-preset {args.preset} --out DIR")
        args.out = args.dir
    if args.out is None:
        print("ppotune make-preset: error: the following arguments are required: --out", file=sys.stderr)
        return ExitCode.USAGE
    args.dir = args.out
    tiny = TinyModelConfig(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
    )
    synthetic = SyntheticDataConfig(num_prompts=args.num_prompts, seed=args.seed)
    try:
        overrides = make_verl_preset(
            args.dir,
            tiny=tiny,
            synthetic=synthetic,
            num_val_prompts=args.num_val_prompts,
            max_response_length=args.max_response_length,
            force=args.force,
        )
    except ValueError as e:
        print(f"ppotune make-preset: error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    out = Path(args.dir).expanduser().resolve()
    print(f"wrote the verl preset to {out} (overrides in {out / 'preset.yaml'}):")
    for o in overrides:
        print(f"  {o}")
    return ExitCode.OK
