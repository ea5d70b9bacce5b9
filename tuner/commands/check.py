"""``ppotune check``: validate a training config and its inputs without launching anything (no torch, no GPU).

Prints the derived per-GPU sizes a user usually works out by hand, or the one-line error: a refused config, or an
input that cannot work (a data file without verl's columns, a model directory without weights or tokenizer:
:mod:`trainer.launch.preflight`).
"""

from __future__ import annotations

import json
import sys

from trainer.config import ConfigError, effective_config, load_config, world_size
from trainer.contracts import ExitCode
from trainer.launch.preflight import preflight
from tuner.commands.flags import add_config_arguments, overrides_of

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    add_config_arguments(p)


def run(args) -> int:
    overrides = overrides_of(args)
    if args.nproc is not None:
        overrides.append(f"trainer.n_gpus_per_node={json.dumps(args.nproc)}")
    try:
        cfg = load_config(args.config, overrides)
        preflight(cfg, source=args.config)
    except ConfigError as e:
        print(f"ppotune check: error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    cfg = effective_config(cfg)
    a, c, n, ws = cfg.actor_rollout_ref.actor, cfg.critic, cfg.actor_rollout_ref.rollout.n, world_size(cfg)
    ref = cfg.actor_rollout_ref.ref

    def plan(dynamic: bool, micro, budget) -> str:
        return f"dynamic, <= {budget} tokens per micro-batch" if dynamic else f"{micro} sequences per micro-batch"

    print(f"ppotune check: ok: {args.config}")
    print(
        f"  world size {ws}; sequences per step {cfg.data.train_batch_size * n} "
        f"({cfg.data.train_batch_size} prompts x n={n}), "
        f"{cfg.data.train_batch_size * n // ws} per GPU"
    )
    print(
        f"  actor: {a.strategy}, mini-batch {a.ppo_mini_batch_size * n // ws} sequences per GPU, "
        f"{plan(a.use_dynamic_bsz, a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu)}"
    )
    print(
        f"  critic: {c.strategy}, mini-batch {c.ppo_mini_batch_size * n // ws} sequences per GPU, "
        f"{plan(c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu)}"
    )
    ref_plan = plan(
        ref.log_prob_use_dynamic_bsz, ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_max_token_len_per_gpu
    )
    print(f"  ref log-probs: {ref_plan}")
    print(f"  model: {cfg.actor_rollout_ref.model.path}; data: {cfg.data.train_files or 'embedded synthetic task'}")
    return 0
