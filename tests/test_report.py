"""``ppotune report`` on a study laid out exactly as docs/contracts.md §3 says.

Two studies: one built here through Optuna's public API (every status, an 80 GB GPU,
constraints, a baseline, a trial still running) and, when the tuner's ``search``
exists, a real small search on CPU (module fixture ``real_search``).
"""
from __future__ import annotations

import base64
import csv
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution

from trainer.config import config_to_dict, load_config

ROOT = Path(__file__).resolve().parents[1]

optuna.logging.set_verbosity(optuna.logging.WARNING)

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
    ("oom", (4, "fsdp2", False, False, 8, 4), None, 80.6, 41.0, {"error": "CUDA out of memory. Tried to allocate 2.00 GiB"}),
    ("inferred_oom", (4, "fsdp", False, False, 8, 4), None, None, 0.0, {"inferred_from": 1}),
    ("ok", (4, "fsdp2", False, True, 4, 2), 2100.0, 61.0, 52.0, {}),
    ("ok", (4, "fsdp2", False, True, 8, 4), 2400.0, 74.5, 55.0, {}),
    ("ok", (1, "fsdp", False, True, 2, 1), 900.0, 31.0, 61.0, {}),
    ("ok", (1, "fsdp", True, True, 2, 1), 905.0, 31.2, 63.0,
     {"notes": ["critic.fsdp.param_offload: no effect on CPU"]}),
    ("hang", (2, "fsdp", False, False, 4, 4), None, 55.0, 600.0, {"error": "timeout after 600 s", "log_tail": "..."}),
    ("crash", (2, "fsdp2", False, True, 4, 2), None, None, 12.0,
     {"error": "rank 1 exited with signal 9", "log_tail": "torch.distributed.elastic...SIGKILL"}),
    ("invalid", (2, "fsdp2", True, False, 2, 1), None, None, 3.0,
     {"error": "config: actor_rollout_ref.actor.fsdp_config.offload_policy: offload_policy is an FSDP2 option"}),
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


def make_demo_study(storage, study_name: str = "demo", *, device_gb=DEVICE_GB, memory_limit_gb=None,
                    extra_overrides=None):
    """A finished-but-one study of 13 trials, written the way the tuner writes (contracts.md §3)."""
    base = config_to_dict(load_config(ROOT / "configs" / "tiny_cpu.yaml"))
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
            "timing_s": {} if not thr else {
                "gen": 0.45 * 768 / thr, "ref": 0.08 * 768 / thr, "old_log_prob": 0.08 * 768 / thr,
                "values": 0.07 * 768 / thr, "adv": 0.01 * 768 / thr, "update_actor": 0.19 * 768 / thr,
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
            trial.set_constraint("oom", -1.0)
            study.tell(trial, [thr, peak])
        elif status in ("oom", "inferred_oom", "hang"):
            trial.set_constraint("oom", 1.0)
            study.tell(trial, [0.0, PENALTY_GB])
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return study


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory) -> Path:
    """A search out dir holding the hand-built study in study.db."""
    d = tmp_path_factory.mktemp("demo_out")
    make_demo_study(f"sqlite:///{d / 'study.db'}")
    return d


@pytest.fixture(scope="module")
def demo_report(demo_out) -> Path:
    from tuner.cli import main

    assert main(["report", "--out", str(demo_out)]) == 0
    return demo_out / "report"


# --------------------------------------------------------------------------- checks shared by both studies
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


# --------------------------------------------------------------------------- the hand-built study
def demo_statuses() -> dict[int, str]:
    return {i: t[0] for i, t in enumerate(DEMO_TRIALS)}


def test_report_files(demo_report):
    check_report_dir(demo_report, len(DEMO_TRIALS), demo_statuses())


def test_report_content(demo_report):
    text = (demo_report / "report.html").read_text()
    assert "still running" in text  # trial 13 is RUNNING
    assert "same config as #10 (not re-run)" in text
    assert "NVIDIA H100 80GB HBM3 memory 80.0 GB" in text
    # baseline #0 (1500) vs best under 10% headroom: #11 (2150; #4 at 74.5 GB is over 72 GB)
    assert "1.43x" in text
    assert "best under headroom" in text and "#11" in text
    # cost: all trial durations; inferred OOM saved = mean OOM duration (41 s) x 1
    assert "saved by OOM inference" in text and "≈41.0 s" in text
    # param_offload differs alone between #5 and #6, within noise -> no effect; the note flags the critic's
    assert re.search(r"fsdp_config\.param_offload</th><td class='small'><span class='noeffect'>no effect", text)
    assert re.search(r"critic\.fsdp\.param_offload</th><td class='small'><span class='noeffect'>no effect", text)
    summary = (demo_report / "summary.md").read_text()
    assert "1.43x throughput" in summary and "trial #11" in summary


def test_report_pareto_and_memory_sources(demo_report):
    text = (demo_report / "report.html").read_text()
    pareto_section = text.split("<h2>Pareto configs</h2>")[1].split("<h2>")[0]
    for n in (4, 11, 3, 10, 6, 5):  # the front, fastest first
        assert f"<td>#{n}" in pareto_section
    assert "<td>#0" not in pareto_section.split("Knob values")[0]  # the baseline is dominated by #10
    assert "nvml" in pareto_section and "allocated" in pareto_section and "update_actor" in pareto_section


def test_trials_frame_matches_contract(demo_out):
    from tuner.results.view import load

    view = load(out=demo_out)
    df = view.trials.set_index("number")
    assert list(df.index) == list(range(len(DEMO_TRIALS)))
    assert df.loc[1, "state"] == "COMPLETE" and not df.loc[1, "feasible"]
    assert df.loc[1, "value_throughput"] == 0.0 and df.loc[1, "value_memory"] == PENALTY_GB
    assert df.loc[8, "state"] == "FAIL" and df.loc[13, "status"] == "running"
    assert df.loc[12, "state"] == "FAIL" and df.loc[12, "duplicate_of"] == 10
    assert df.loc[2, "inferred_from"] == 1
    assert set(df.index[df["pareto"]]) == {3, 4, 5, 6, 10, 11}
    assert df.loc[0, "baseline"] and df.loc[0, "time.gen"] > 0
    assert view.device_memory[0] == DEVICE_GB


def test_report_is_read_only(tmp_path):
    db = tmp_path / "study.db"
    make_demo_study(f"sqlite:///{db}")
    before = db.read_bytes()
    os.chmod(db, 0o444)
    os.chmod(tmp_path, 0o555)  # no journal file can be created either
    try:
        from tuner.results.report import write_report

        page = write_report(f"sqlite:///{db}", None, tmp_path.parent / f"{tmp_path.name}_report")
        assert page.is_file()
    finally:
        os.chmod(tmp_path, 0o755)
        os.chmod(db, 0o644)
    assert db.read_bytes() == before


def test_report_on_journal_storage(tmp_path):
    log = tmp_path / "study.log"
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    make_demo_study(JournalStorage(JournalFileBackend(str(log))))
    size = log.stat().st_size
    from tuner.cli import main

    assert main(["report", "--out", str(tmp_path), "--to", str(tmp_path / "r")]) == 0
    check_report_dir(tmp_path / "r", len(DEMO_TRIALS), demo_statuses())
    assert log.stat().st_size == size


def test_write_report_as_search_calls_it(tmp_path):
    """`ppotune search --report` calls write_report(storage url, study name, search out dir)."""
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    from tuner.results.report import write_report

    log = tmp_path / "study.log"
    make_demo_study(JournalStorage(JournalFileBackend(str(log))))
    page = write_report(f"journal:{log}", "demo", tmp_path)
    assert page == tmp_path / "report" / "report.html" and page.is_file()


def test_report_few_trials_and_unknown_device(tmp_path):
    """Two trials, no device memory: importances say why they are missing, no crash."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="small",
                                directions=["maximize", "minimize"])
    study.set_user_attr("device", {"kind": "cpu", "name": None, "memory_total_gb": None})
    study.set_user_attr("memory_limit_gb", None)
    for i, (status, thr, peak) in enumerate([("ok", 100.0, 1.2), ("oom", None, None)]):
        t = study.ask({"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": CategoricalDistribution([1, 2])})
        for k, v in {"status": status, "baseline": i == 0, "throughput": thr, "peak_memory_gb": peak,
                     "memory_source": "psutil", "duration_s": 9.0}.items():
            t.set_user_attr(k, v)
        t.set_constraint("oom", -1.0 if status == "ok" else 1.0)
        study.tell(t, [thr or 0.0, peak or 99.0])
    from tuner.cli import main

    assert main(["report", "--storage", f"sqlite:///{tmp_path / 'study.db'}", "--study", "small",
                 "--to", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.html").read_text()
    assert "not enough feasible trials to estimate importances (1; need 4)" in text
    assert "Device memory unknown" in text
    with open(tmp_path / "r" / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "oom"]


def test_report_errors_are_one_line(tmp_path, capsys):
    from tuner.cli import main

    assert main(["report", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ppotune report:") and "\n" not in err
    make_demo_study(f"sqlite:///{tmp_path / 'two.db'}", "a")
    make_demo_study(f"sqlite:///{tmp_path / 'two.db'}", "b")
    assert main(["report", "--storage", f"sqlite:///{tmp_path / 'two.db'}"]) == 2
    assert "2 studies (a, b)" in capsys.readouterr().err


def test_optuna_dashboard_reads_our_storage(demo_out):
    """optuna-dashboard's WSGI app over our storage answers its study API (no server started)."""
    optuna_dashboard = pytest.importorskip("optuna_dashboard")
    import json

    from tuner.storage import open_storage, resolve_read_spec

    app = optuna_dashboard.wsgi(open_storage(resolve_read_spec(out=demo_out), read_only=True))

    def get(path: str):
        status = {}
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "SERVER_NAME": "x",
                   "SERVER_PORT": "80", "wsgi.input": io.BytesIO(), "wsgi.errors": sys.stderr,
                   "wsgi.url_scheme": "http"}
        body = b"".join(app(environ, lambda s, h, *a: status.setdefault("s", s)))
        return status["s"], body

    status, body = get("/api/studies")
    assert status.startswith("200")
    studies = json.loads(body)["study_summaries"]
    assert [s["study_name"] for s in studies] == ["demo"]
    status, body = get(f"/api/studies/{studies[0]['study_id']}")
    assert status.startswith("200")
    assert len(json.loads(body)["trials"]) == len(DEMO_TRIALS)


# --------------------------------------------------------------------------- a real search
def _has_command(name: str) -> bool:
    r = subprocess.run([sys.executable, "-m", "tuner.cli", name, "--help"], cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0


_REAL_SEARCH: dict[str, Path] = {}  # one real search per session, shared with test_export.py


@pytest.fixture(scope="module")
def real_search(tmp_path_factory) -> Path:
    """A real 4-trial search on CPU with the shipped tiny space (skipped until `search` exists)."""
    if "out" in _REAL_SEARCH:
        return _REAL_SEARCH["out"]
    if not _has_command("search"):
        pytest.skip("`ppotune search` is not available yet")
    if not (ROOT / "search_spaces" / "tiny_cpu.yaml").is_file():
        pytest.skip("search_spaces/tiny_cpu.yaml is not available yet")
    out = tmp_path_factory.mktemp("real_search")
    cmd = [sys.executable, "-m", "tuner.cli", "search", "configs/tiny_cpu.yaml", "--space", "search_spaces/tiny_cpu.yaml",
           "--trials", "4", "--nproc", "2", "--steps", "2", "--warmup", "1", "--out", str(out), "--report"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"search failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    _REAL_SEARCH["out"] = out
    return out


@pytest.mark.slow
def test_report_on_real_search(real_search, tmp_path):
    from tuner.results.view import load

    view = load(out=real_search)
    statuses = {int(r["number"]): r["status"] for _, r in view.trials.iterrows()}
    assert len(statuses) >= 4
    r = subprocess.run([sys.executable, "-m", "tuner.cli", "report", "--out", str(real_search), "--to", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    check_report_dir(tmp_path, len(statuses), statuses)
    # `search --report` wrote the same report next to the study
    check_report_dir(real_search / "report", len(statuses), statuses)
    # the tuner wrote the contract's study attributes
    for key in ("ppotune_schema", "base_config", "device", "nproc"):
        assert key in view.attrs, key
    assert view.trials["baseline"].any()


# --------------------------------------------------------------------------- the tuner's shared real study
try:  # the tuner's module fixture: baseline, real hang, OOM, inferred OOM, crash, duplicate, --confirm
    from test_tuner_search import shared  # noqa: F401
except Exception:  # not there yet, or it cannot be imported here
    shared = None


@pytest.mark.slow
@pytest.mark.skipif(shared is None, reason="tests/test_tuner_search.py::shared is not available")
def test_report_and_export_on_the_tuners_real_study(shared, tmp_path):  # noqa: F811
    """Every status of contracts.md §3 from REAL trials, read by report and export."""
    from tuner.cli import main
    from tuner.results.view import load

    view = load(storage=shared.storage)
    statuses = {int(r["number"]): r["status"] for _, r in view.trials.iterrows()}
    assert {"ok", "oom", "inferred_oom", "hang", "crash", "duplicate"} <= set(statuses.values())
    assert main(["report", "--storage", shared.storage, "--to", str(tmp_path / "r")]) == 0
    check_report_dir(tmp_path / "r", len(statuses), statuses)
    text = (tmp_path / "r" / "report.html").read_text()
    assert "confirms #" in text and "same config as #" in text
    assert main(["export", "--storage", shared.storage, "--to", str(tmp_path / "e")]) == 0
    why = (tmp_path / "e" / "why.md").read_text()
    assert "nearest out-of-memory config is trial #" in why
