"""Plain helpers shared by several test files (no fixtures: those live in conftest.py).

Importable as ``support`` from every test directory (tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

import base64
import csv
import os
import re
import time
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.distributions import CategoricalDistribution

from trainer.config import config_to_dict, load_config
from trainer.contracts import CONSTRAINT_KEY

REPO = Path(__file__).resolve().parent.parent
TINY_BASE = REPO / "configs" / "tiny_cpu.yaml"


def verl_root_or_skip() -> Path:
    """verl's package directory (its config files and source, read, never imported: ``tuner.results.verl_validate``),
    or skip saying why there is none (scripts/install_test_deps.sh unpacks it into .test_deps/verl)."""
    from tuner.results.verl_validate import VERL_ROOT_ENV, verl_root

    root = verl_root()
    if root is None:
        status = REPO / ".test_deps" / "verl-configs.status"
        why = status.read_text().strip() if status.is_file() else "scripts/install_test_deps.sh was not run"
        pytest.skip(f"verl's config files not found (${VERL_ROOT_ENV}, or verl importable here): {why}")
    return root


# --------------------------------------------------------------------------- processes
def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose command line mentions ``marker``."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if marker in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


def verl_preset_run(cli, out_dir: Path, python: Path) -> Path:
    """The tiny verl preset (``ppotune make-preset verl``: sized for a 1-rank CPU run) as a run file in ``out_dir``."""
    import yaml

    r = cli("make-preset", "verl", "--out", out_dir / "preset", timeout=300)
    assert r.returncode == 0, r.stderr
    overrides = yaml.safe_load((out_dir / "preset" / "preset.yaml").read_text())["overrides"]
    run = out_dir / "run.yaml"
    run.write_text(yaml.safe_dump({"overrides": overrides, "ppotune": {"python": str(python)}}))
    return run


def wait_until(pred, timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


# --------------------------------------------------------------------------- the hand-built study
KNOBS = {
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": CategoricalDistribution([1, 2, 4]),
    "actor_rollout_ref.actor.strategy": CategoricalDistribution(["fsdp", "fsdp2"]),
    "actor_rollout_ref.actor.fsdp_config.param_offload": CategoricalDistribution([False, True]),
    "actor_rollout_ref.model.enable_gradient_checkpointing": CategoricalDistribution([False, True]),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": CategoricalDistribution([2, 4, 8]),
    "critic.ppo_micro_batch_size_per_gpu": CategoricalDistribution([1, 2, 4]),
}
_K = list(KNOBS)

# (status, knob values in KNOBS order, throughput, peak GB, duration s, extra user attrs)
DEMO_TRIALS = [
    ("ok", (2, "fsdp", False, False, 4, 2), 1500.0, 52.0, 48.0, {"baseline": True}),
    (
        "oom",
        (4, "fsdp2", False, False, 8, 4),
        None,
        80.6,
        41.0,
        {"error": "CUDA out of memory. Tried to allocate 2.00 GiB"},
    ),
    ("inferred_oom", (4, "fsdp", False, False, 8, 4), None, None, 0.0, {"inferred_from": 1}),
    ("ok", (4, "fsdp2", False, True, 4, 2), 2100.0, 61.0, 52.0, {}),
    ("ok", (4, "fsdp2", False, True, 8, 4), 2400.0, 74.5, 55.0, {}),
    ("ok", (1, "fsdp", False, True, 2, 1), 900.0, 31.0, 61.0, {}),
    (
        "ok",
        (1, "fsdp", True, True, 2, 1),
        905.0,
        31.2,
        63.0,
        {"notes": ["critic.fsdp.param_offload: no effect on CPU"]},
    ),
    ("hang", (2, "fsdp", False, False, 4, 4), None, 55.0, 600.0, {"error": "timeout after 600 s", "log_tail": "..."}),
    (
        "crash",
        (2, "fsdp2", False, True, 4, 2),
        None,
        None,
        12.0,
        {"error": "rank 1 exited with signal 9", "log_tail": "torch.distributed.elastic...SIGKILL"},
    ),
    (
        "invalid",
        (2, "fsdp2", True, False, 2, 1),
        None,
        None,
        3.0,
        {"error": "config: actor_rollout_ref.actor.fsdp_config.offload_policy: offload_policy is an FSDP2 option"},
    ),
    ("ok", (2, "fsdp2", False, True, 8, 2), 1900.0, 47.0, 50.0, {}),
    ("ok", (4, "fsdp2", False, True, 8, 2), 2150.0, 63.0, 53.0, {}),
    # the tuner's dedupe: TPE re-sampled #10's config; recorded as FAIL, not re-run (not in contracts.md §3 yet)
    ("duplicate", (2, "fsdp2", False, True, 8, 2), None, None, 0.0, {"duplicate_of": 10}),
    ("running", (1, "fsdp2", False, False, 2, 2), None, None, None, {}),
]
PENALTY_GB = 160.0
DEVICE_GB = 80.0


def _overrides(params: dict) -> dict:
    over = dict(params)
    # a derived key, as the space would add it: the critic's forward micro-batch follows its train one
    over["critic.forward_micro_batch_size_per_gpu"] = params["critic.ppo_micro_batch_size_per_gpu"]
    return over


def make_demo_study(
    storage, study_name: str = "demo", *, device_gb=DEVICE_GB, memory_limit_gb=None, extra_overrides=None
):
    """A finished-but-one study of 13 trials, written the way the tuner writes (contracts.md §3)."""
    base = config_to_dict(load_config(TINY_BASE))
    study = optuna.create_study(storage=storage, study_name=study_name, directions=["maximize", "minimize"])
    for k, v in {
        "ppotune_schema": 1,
        "base_config": base,
        "base_config_path": "configs/tiny_cpu.yaml",
        "space_path": "search_spaces/tiny_cpu.yaml",
        "space": {"knobs": {k: {"choices": list(d.choices)} for k, d in KNOBS.items()}},
        "nproc": 2,
        "steps": 3,
        "warmup": 1,
        "device": {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "memory_total_gb": device_gb},
        "memory_limit_gb": memory_limit_gb,
    }.items():
        study.set_user_attr(k, v)
    for status, vals, thr, peak, dur, extra in DEMO_TRIALS:
        params = dict(zip(_K, vals))
        study.enqueue_trial(params)
        trial = study.ask(KNOBS)
        assert trial.params == params
        if status == "running":
            continue  # the study is still going: this one has no result yet
        ua = {
            "status": status,
            "baseline": False,
            "overrides": {**_overrides(params), **(extra_overrides or {}).get(trial.number, {})},
            "throughput": thr,
            "throughput_cv": 0.02 if thr else None,
            "step_s": (8 * 96 / thr) if thr else None,
            "peak_memory_gb": peak,
            "memory_source": "nvml",
            "memory": {
                "external_peak_gb": peak,
                "external_source": "nvml",
                "device_used_peak_gb": peak,
                "allocated_peak_gb": None if peak is None else round(peak * 0.78, 2),
                "reserved_peak_gb": None if peak is None else round(peak * 0.9, 2),
                "rss_peak_gb": 3.1 if peak is not None else None,
            },
            "timing_s": {}
            if not thr
            else {
                "gen": 0.45 * 768 / thr,
                "ref": 0.08 * 768 / thr,
                "old_log_prob": 0.08 * 768 / thr,
                "values": 0.07 * 768 / thr,
                "adv": 0.01 * 768 / thr,
                "update_actor": 0.19 * 768 / thr,
                "update_critic": 0.12 * 768 / thr,
            },
            "notes": [],
            "error": None,
            "log_tail": None,
            "log_path": f"runs/trial_{trial.number}/log.txt",
            "result_path": f"runs/trial_{trial.number}/result.json",
            "config_path": f"runs/trial_{trial.number}/config.yaml",
            "duration_s": dur,
        }
        ua.update(extra)
        for k, v in ua.items():
            trial.set_user_attr(k, v)
        if status == "duplicate":
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        elif status == "ok":
            trial.set_constraint(CONSTRAINT_KEY, -1.0)
            study.tell(trial, [thr, peak])
        elif status in ("oom", "inferred_oom", "hang"):
            trial.set_constraint(CONSTRAINT_KEY, 1.0)
            study.tell(trial, [0.0, PENALTY_GB])
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return study


# --------------------------------------------------------------------------- a written report
def check_report_dir(report_dir: Path, n_trials: int, statuses: dict[int, str]) -> None:
    page = report_dir / "report.html"
    assert page.is_file()
    text = page.read_text(encoding="utf-8")
    # self-contained: nothing fetched from anywhere
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", text, re.I)
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I)
    assert not re.search(r"<link[^>]*stylesheet", text, re.I)
    assert "http://" not in text and "https://" not in text
    for n in statuses:
        assert re.search(rf"#{n}\b", text), f"trial #{n} missing from report.html"
    # the embedded images decode as PNG
    blobs = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)
    assert len(blobs) >= 3
    for b in blobs:
        assert base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n"

    import matplotlib.image as mpimg

    for name in ("pareto.png", "importances.png", "phases.png"):
        p = report_dir / name
        assert p.is_file() and p.stat().st_size > 8_000, f"{name} is missing or trivial"
        img = mpimg.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 400
        assert img.std() > 0.01, f"{name} is a blank canvas"

    with open(report_dir / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == n_trials
    assert {int(r["number"]): r["status"] for r in rows} == statuses
    assert any(c.startswith("params.") for c in rows[0])
    for col in ("state", "status", "throughput", "peak_memory_gb", "memory_source", "duration_s"):
        assert col in rows[0]

    summary = (report_dir / "summary.md").read_text()
    assert summary.startswith("# ppotune report")


def tiny_setup(space_yaml: str) -> tuple:
    """(space, trial base, flat trial base) of ``space_yaml`` on the tiny demo with 2 processes, 2 steps."""
    import yaml

    from trainer.config import apply_overrides, config_from_dict, flatten
    from tuner.space import base_flat_config, space_from_dict

    space = space_from_dict(yaml.safe_load(space_yaml), source="space.yaml")
    nested, _ = base_flat_config(TINY_BASE, nproc=2)
    trial_base = config_to_dict(
        config_from_dict(apply_overrides(nested, {"trainer.total_training_steps": 2, "ppotune.warmup_steps": 1}))
    )
    return space, trial_base, flatten(trial_base)


def search_over(setup: tuple, study, storage, runner, *, observer=None, **options):
    """``tuner.search.loop.Search`` over ``setup`` (:func:`tiny_setup`) with ``runner``, seed 0, the in-process lock
    only; ``options``: the rest of ``SearchOptions`` (``trials`` at least)."""
    from tuner.search.loop import Search, SearchOptions
    from tuner.search.session import TrialSession
    from tuner.study import lifecycle as st

    space, trial_base, flat = setup
    return Search(
        options=SearchOptions(seed=0, **options),
        session=TrialSession(
            study=study,
            storage=storage,
            lock=st.StudyLock(None),
            space=space,
            trial_base=trial_base,
            trial_flat=flat,
            runner=runner,
            penalty_gb=64.0,
            observer=observer,
        ),
    )
