"""The result JSON of a run (``trainer/result_schema.json``): built from the ranks' status files, or an error
result; what ``ppotune train`` prints about it and its exit code. Torch-free: the verl adapter writes the same."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.contracts import RESULT_SCHEMA_VERSION, ExitCode
from trainer.summary import summarize_steps

__all__ = ["error_result", "build_result", "outcome_lines", "exit_code", "read_rank_files"]


def error_result(message: str, *, config: dict | None = None, wall_s: float = 0.0, log_tail: str | None = None) -> dict:
    return {
        "schema_version": RESULT_SCHEMA_VERSION,
        "status": "error",
        "error": message,
        "oom_rank": None,
        "oom_phase": None,
        "config": config or {},
        "steps": [],
        "summary": summarize_steps([], device_type="cpu"),
        "environment": {"device": "cpu", "world_size": 0, "backend": "gloo"},
        "notes": [],
        "log_tail": log_tail,
        "wall_s": wall_s,
    }


def build_result(
    rank_files: dict[int, dict], *, config: dict, nproc: int, returncode: int, wall_s: float, log_tail: str
) -> dict:
    """Combine per-rank status files into the result: an OOM on any rank makes the run ``oom``."""
    lead = rank_files.get(0, {})
    ooms = sorted(r for r, f in rank_files.items() if f.get("status") == "oom")
    errors = sorted(r for r, f in rank_files.items() if f.get("status") == "error")
    all_ok = len(rank_files) == nproc and all(f.get("status") == "ok" for f in rank_files.values())
    if ooms:
        status, first = "oom", rank_files[ooms[0]]
        error = f"rank {ooms[0]} out of memory in phase {first.get('phase')}: {first.get('error')}"
    elif all_ok and returncode == 0:
        status, error = "ok", None
    else:
        status = "error"
        missing = sorted(set(range(nproc)) - set(rank_files))
        parts = []
        if missing:  # the root cause: a rank that died without writing (a signal); peers only saw broken links
            parts.append(
                f"rank(s) {missing} exited without a status (killed by a signal?); ranks' exit code {returncode}"
            )
        if errors:
            first = rank_files[errors[0]]
            parts.append(f"rank {errors[0]} failed in phase {first.get('phase')}: {first.get('error')}")
        error = "; ".join(parts) or f"ranks' exit code {returncode}"
    env = lead.get("environment") or next((f["environment"] for f in rank_files.values() if f.get("environment")), None)
    notes = list(
        dict.fromkeys(lead.get("notes") or next((f["notes"] for f in rank_files.values() if f.get("notes")), []))
    )
    return {
        "schema_version": RESULT_SCHEMA_VERSION,
        "status": status,
        "error": error,
        "oom_rank": ooms[0] if ooms else None,
        "oom_phase": rank_files[ooms[0]].get("phase") if ooms else None,
        "config": config,
        "model": lead.get("model") or next((f["model"] for f in rank_files.values() if f.get("model")), None),
        "per_gpu": lead.get("per_gpu"),
        "steps": lead.get("steps", []),
        "summary": lead.get("summary") or summarize_steps([], device_type="cpu"),
        "environment": env or {"device": "cpu", "world_size": nproc, "backend": "gloo"},
        "notes": notes,
        "log_tail": None if status == "ok" else log_tail,
        "wall_s": wall_s,
    }


def outcome_lines(result: dict) -> tuple[list[str], list[str]]:
    """What ``ppotune train`` says about a finished run: (stdout lines, stderr lines)."""
    s = result["summary"]
    if result["status"] != "ok":
        return [], [f"ppotune train: {result['status']}: {result['error']}"]
    thr = s.get("throughput")
    head = (
        f"ppotune train: ok | throughput {thr:.1f} tokens/s/GPU | step {s.get('step_s'):.2f} s | "
        f"peak memory {s.get('peak_memory_gb'):.2f} GB ({s.get('memory_source')})"
        if thr is not None
        else "ppotune train: ok"
    )
    return [head, *(f"note: {note}" for note in result["notes"])], []


def exit_code(result: dict) -> int:
    return {"ok": ExitCode.OK, "oom": ExitCode.OOM}.get(result["status"], ExitCode.ERROR)


def read_rank_files(rank_dir: Path, nproc: int) -> dict[int, dict]:
    rank_files = {}
    for r in range(nproc):
        f = rank_dir / f"rank{r}.json"
        if f.is_file():
            try:
                rank_files[r] = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                pass
    return rank_files
