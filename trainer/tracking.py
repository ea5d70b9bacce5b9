"""Per-step logging: one console line per step on rank 0, and wandb when asked.

wandb runs offline when no credentials are configured, so a machine without network or
an API key still records the run (``wandb sync`` uploads it later).
"""

from __future__ import annotations

import netrc
import os

__all__ = ["StepLogger", "wandb_mode", "has_credentials"]

_CONSOLE_KEYS = (
    "timing_s/step",
    "perf/throughput",
    "reward/mean",
    "actor/pg_loss",
    "actor/kl_coef",
    "critic/vf_loss",
    "actor/grad_norm",
    "perf/peak_rss_gb",
    "perf/max_memory_reserved_gb",
)


def has_credentials() -> bool:
    """An API key in the environment, or a ~/.netrc entry for the wandb host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        auth = netrc.netrc(os.path.expanduser("~/.netrc"))
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    return auth.authenticators(host) is not None


def wandb_mode() -> str:
    """WANDB_MODE if set (an empty value counts as unset), else online only with credentials."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if has_credentials() else "offline"


class StepLogger:
    def __init__(self, cfg, *, rank: int, config_dict: dict):
        self.rank = rank
        self.run = None
        use_wandb = cfg.ppotune.wandb or "wandb" in cfg.trainer.logger
        if rank == 0 and use_wandb:
            import wandb

            self.run = wandb.init(
                project=cfg.trainer.project_name,
                name=cfg.trainer.experiment_name,
                config=config_dict,
                mode=wandb_mode(),
                reinit=True,
            )

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
            self.run.log(
                {k: v for k, v in row.items() if isinstance(v, (int, float)) and v is not None}, step=row["step"]
            )

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
