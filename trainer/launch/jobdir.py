"""A warm job's protocol: the files through which the tuner, ``ppotune train --serve`` and the ranks talk, and
which configs may share a job (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainer.config import rollout_name

__all__ = ["JobDir", "serve_layout", "warm_refusal"]


@dataclass(frozen=True)
class JobDir:
    """The files through which a warm job (``ppotune train CONFIG --serve JOBDIR``) is driven, named once
    for its three parties: the tuner (``tuner.trials.warm.WarmRunner``), this launcher and the ranks
    (trainer/rank/serve.py).

    The tuner writes request ``n`` (``{config, result, log}``: the trial's complete config, where its result
    JSON and its log go), one at a time, or ``stop``. The launcher validates it (a refused config is
    answered at once and never reaches the ranks), writes the trial's config beside the ranks' status files
    in ``trial_dir(k)`` and hands it to the ranks as their next task ``k`` (``{config, rank_dir}``, or
    ``{stop: true}``); once every rank's status file says ``done`` (or the job ended), it writes the
    trial's result JSON where the request said and takes the next request.
    """

    root: Path
    #: how often the launcher and the ranks look for their next file (seconds)
    POLL_S = 0.02

    def request(self, seq: int) -> Path:
        return self.root / "requests" / f"{seq:06d}.json"

    def task(self, seq: int) -> Path:
        return self.root / "tasks" / f"{seq:06d}.json"

    def trial_dir(self, seq: int) -> Path:
        return self.root / f"trial{seq:06d}"

    @property
    def stop(self) -> Path:
        """Touched by the tuner: end the job once the trial in flight (if any) is done."""
        return self.root / "stop"

    @property
    def setup_dir(self) -> Path:
        """The ranks' status files when the job fails before its first trial (process group, device)."""
        return self.root / "setup"

    def make(self) -> "JobDir":
        for d in (self.root / "requests", self.root / "tasks", self.setup_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self


def serve_layout(config: dict) -> dict:
    """What a warm job's processes fix for all of its trials (a complete nested config -> the keys): a trial
    whose layout differs needs other processes, so it runs in another job."""
    return {
        "nproc": config["trainer"]["n_gpus_per_node"],
        "nnodes": config["trainer"]["nnodes"],
        "device": config["ppotune"]["device"],
        "dist_timeout_s": config["ppotune"]["dist_timeout_s"],
    }


def warm_refusal(config: dict) -> Optional[str]:
    """Why this (complete, nested) config cannot run as a trial of a warm job, or None."""
    from trainer.launch.device import detect_device  # NVML only, no torch

    # an unnamed rollout is vLLM on a GPU (trainer.config.rollout_name; preflight refused it where vLLM is missing)
    device = detect_device(config["ppotune"]["device"])
    if rollout_name(config["actor_rollout_ref"]["rollout"]["name"], device_type=device, vllm_importable=True) == "vllm":
        return (
            "actor_rollout_ref.rollout.name=vllm: a process keeps its in-process vLLM engine alive on purpose "
            "(trainer/engine/vllm_rollout.py), so each vLLM trial gets fresh processes"
        )
    if config["trainer"]["nnodes"] != 1:
        return "trainer.nnodes > 1: a warm job is one node's processes"
    return None
