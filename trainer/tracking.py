"""Per-step logging: one console line per step on rank 0, and wandb when asked.

wandb runs offline when no credentials are configured, so a machine without network or
an API key still records the run (``wandb sync`` uploads it later).
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["StepLogger", "wandb_mode"]

_CONSOLE_KEYS = ("timing_s/step", "perf/throughput", "reward/mean", "actor/pg_loss", "actor/kl_coef",
                 "critic/vf_loss", "actor/grad_norm", "perf/peak_rss_gb", "perf/max_memory_reserved_gb")


def wandb_mode() -> str:
    """'online' only when credentials exist (env key or a netrc entry for the wandb host)."""
    if os.environ.get("WANDB_MODE"):  # an empty value counts as unset
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


class StepLogger:
    def __init__(self, cfg, *, rank: int, config_dict: dict):
        self.rank = rank
        self.run = None
        use_wandb = cfg.ppotune.wandb or "wandb" in cfg.trainer.logger
        if rank == 0 and use_wandb:
            import wandb

            self.run = wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.experiment_name,
                                  config=config_dict, mode=wandb_mode(), reinit=True)

    def log(self, row: dict) -> None:
        if self.rank != 0:
            return
        parts = [f"step {row['step']}{' (warm-up)' if row['warmup'] else ''}"]
        for k in _CONSOLE_KEYS:
            v = row.get(k)
            if v is not None:
                parts.append(f"{k}={v:.4g}")
        print(" | ".join(parts), flush=True)
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and v is not None}, step=row["step"])

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
