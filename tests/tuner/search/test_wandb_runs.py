"""``--wandb``: offline without credentials, one run per trial, grouped by study."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support import REPO


def _run(code: str, home, extra_env=None) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_credentials_detection(tmp_path):
    code = "from tuner.search.wandb_runs import has_credentials; print(has_credentials())"
    assert _run(code, tmp_path).stdout.strip() == "False"
    assert _run(code, tmp_path, {"WANDB_API_KEY": "x" * 40}).stdout.strip() == "True"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _run(code, tmp_path).stdout.strip() == "True"


def test_offline_run_per_trial(tmp_path):
    r = _run(
        f"""
        import os
        from pathlib import Path
        from tuner.search.wandb_runs import TrialTracker
        t = TrialTracker(project="ppotune-test", group="study-x", out_dir=Path({str(tmp_path / "out")!r}))
        print("MODE", os.environ["WANDB_MODE"])
        rid = t.log_trial(3, status="ok", params={{"a.b": 2}}, overrides={{"a.b": 2}},
                          attrs={{"throughput": 10.0, "peak_memory_gb": 1.0, "timing_s": {{"gen": 0.1}},
                                 "memory": {{"external_peak_gb": 1.0}}}}, values=(10.0, 1.0))
        print("RUN", rid)
    """,
        tmp_path,
    )
    assert "MODE offline" in r.stdout, r.stdout + r.stderr
    run_id = r.stdout.split("RUN ")[1].strip()
    assert run_id != "None"
    runs = list((tmp_path / "out" / "wandb" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert runs, list((tmp_path / "out" / "wandb").rglob("*"))[:20]
