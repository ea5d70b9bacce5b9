"""A verl run's result JSON (``trainer/result_schema.json``), as ppotune's own trainer writes it: verl's per-step
rows, their summary, the actor's shape (read from the model's ``config.json``, for the memory model), and for an
in-run sweep one entry per setting (its own rows, summary and status). ``phase_windows``: each phase's wall-clock
windows per step (the passes, the rollout's generation and weight sync: trainer.verl_engine.plugin), in which the
tuner reads what the trial held from its memory timeline. Torch-free."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from trainer.contracts import RESULT_SCHEMA_VERSION, SHAPE_KEYS
from trainer.summary import summarize_steps
from trainer.verl_engine.metrics import lengths_of, windows_of

__all__ = ["verl_result", "actor_shape"]


def actor_shape(model_path: Optional[str]) -> Optional[dict]:
    """The actor's shape from its checkpoint's ``config.json`` (no weights read), or None when there is none here."""
    if not model_path:
        return None
    try:
        cfg = json.loads((Path(model_path.strip("'\"")).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg  # a multimodal checkpoint nests its language model's
    return {k: cfg[k] for k in (*SHAPE_KEYS, "head_dim") if cfg.get(k) is not None} or None


def _summary(rows: list[dict], device: str, stopped: Optional[str] = None) -> dict:
    summary = summarize_steps(rows, device_type=device)
    summary["lengths"] = lengths_of([r for r in rows if not r["warmup"]] or rows)
    if stopped:
        summary["stopped_early"] = stopped
    return summary


def _settings(spec, rows: list[dict], device: str, status: str, error: Optional[str]) -> list[dict]:
    """One entry per setting of an in-run sweep: ``ok`` with its rows and summary once all its steps finished; the
    setting the run failed in gets the run's status (an ``oom`` ends the run); the ones after it ``not_run``."""
    out, failed = [], False
    for i, setting in enumerate(spec.schedule.settings):
        mine = [r for r in rows if r.get("setting") == i]
        done = len(mine) >= setting.warmup + setting.steps and any(not r["warmup"] for r in mine)
        entry = {"knobs": setting.knobs, "steps": mine, "summary": _summary(mine, device)}
        if done:
            entry.update(status="ok", error=None)
        elif not failed:
            failed = True
            entry.update(status=status if status != "ok" else "error", error=error or "the run ended before it")
        else:
            entry.update(status="not_run", error=None)
        out.append(entry)
    return out


def verl_result(
    spec,
    *,
    device: str,
    version: Optional[str],
    config: dict,
    status: str,
    error: Optional[str],
    rows: list[dict],
    tail: Optional[str],
    t0: float,
    stopped: Optional[str] = None,
) -> dict:
    """The run's result JSON; ``spec``: its :class:`trainer.verl_engine.run_file.RunSpec`."""
    windows = windows_of(rows)
    result = {
        "schema_version": RESULT_SCHEMA_VERSION,
        "status": status,
        "error": error,
        "oom_rank": None,
        "oom_phase": None,
        "config": config,
        "model": actor_shape(spec.get("actor_rollout_ref.model.path")),
        "steps": rows,
        "summary": _summary(rows, device, stopped),
        "environment": {
            "device": device,
            "world_size": spec.nproc,
            "backend": "nccl" if device == "cuda" else "gloo",
            "python": spec.python,
            "verl": version,
        },
        "notes": [f"engine: verl {version} ({spec.python})", *spec.notes],
        "log_tail": tail,
        "wall_s": time.time() - t0,
    }
    if windows:
        result["phase_windows"] = windows
    if spec.sweep:
        result["settings"] = _settings(spec, rows, device, status, error)
    return result
