"""``ppotune search --wandb``: one wandb run per trial (config, metrics, status), grouped by study.

Without credentials (no ``WANDB_API_KEY`` and no ``api.wandb.ai`` entry in ``~/.netrc``)
runs are written offline (``WANDB_MODE=offline``) under ``<out>/wandb``; ``wandb sync``
uploads them later. wandb is imported only when ``--wandb`` is given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from trainer.tracking import has_credentials

__all__ = ["has_credentials", "TrialTracker"]


class TrialTracker:
    def __init__(self, *, project: str, group: str, out_dir: Path):
        if not os.environ.get("WANDB_MODE") and not has_credentials():
            os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")  # keep one line per trial readable
        self.mode = os.environ.get("WANDB_MODE", "online")
        self.project = project
        self.group = group
        self.dir = Path(out_dir) / "wandb"
        self.dir.mkdir(parents=True, exist_ok=True)
        where = f"runs under {self.dir}" + (
            f"; upload later with `wandb sync {self.dir}/wandb/offline-run-*`" if self.mode == "offline" else ""
        )
        print(f"ppotune search: wandb {self.mode} (project {project}, group {group}): {where}", flush=True)

    def log_trial(
        self,
        number: int,
        *,
        status: str,
        params: dict,
        overrides: dict,
        attrs: dict,
        values: Optional[tuple[float, float]],
    ) -> Optional[str]:
        """One short run; returns its id (or None if wandb failed: tracking never stops a search)."""
        try:
            import wandb

            run = wandb.init(
                project=self.project,
                group=self.group,
                name=f"{self.group}/trial-{number}",
                job_type="trial",
                dir=str(self.dir),
                config={"trial": number, **overrides},
                tags=[status],
                reinit="create_new",
            )
            summary = {
                "status": status,
                "trial": number,
                "duration_s": attrs.get("duration_s"),
                "throughput": attrs.get("throughput"),
                "throughput_cv": attrs.get("throughput_cv"),
                "step_s": attrs.get("step_s"),
                "peak_memory_gb": attrs.get("peak_memory_gb"),
                "memory_source": attrs.get("memory_source"),
            }
            for phase, s in (attrs.get("timing_s") or {}).items():
                summary[f"timing_s/{phase}"] = s
            for k, v in (attrs.get("memory") or {}).items():
                summary[f"memory/{k}"] = v
            if values is not None:
                summary["objective/throughput"], summary["objective/peak_memory_gb"] = values
            run.log({k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
            for k, v in summary.items():
                run.summary[k] = v
            if attrs.get("error"):
                run.summary["error"] = attrs["error"]
            run_id = run.id
            run.finish(exit_code=0 if status == "ok" else 1)
            return run_id
        except Exception as e:  # noqa: BLE001 - tracking is best effort
            print(f"ppotune search: wandb logging of trial {number} failed: {e}")
            return None
