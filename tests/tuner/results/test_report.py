"""``ppotune report`` on a study laid out exactly as docs/contracts.md §3 says.

Two studies: one built here through Optuna's public API (every status, an 80 GB GPU,
constraints, a baseline, a trial still running) and, when the tuner's ``search``
exists, a real small search on CPU (the session fixture ``real_search`` in conftest.py).
"""

from __future__ import annotations

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

from support import DEMO_TRIALS, DEVICE_GB, PENALTY_GB, REPO, check_report_dir, make_demo_study

ROOT = REPO

optuna.logging.set_verbosity(optuna.logging.WARNING)


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

    assert main(["report", "--storage", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
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
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="small", directions=["maximize", "minimize"]
    )
    study.set_user_attr("device", {"kind": "cpu", "name": None, "memory_total_gb": None})
    study.set_user_attr("memory_limit_gb", None)
    for i, (status, thr, peak) in enumerate([("ok", 100.0, 1.2), ("oom", None, None)]):
        t = study.ask({"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": CategoricalDistribution([1, 2])})
        for k, v in {
            "status": status,
            "baseline": i == 0,
            "throughput": thr,
            "peak_memory_gb": peak,
            "memory_source": "psutil",
            "duration_s": 9.0,
        }.items():
            t.set_user_attr(k, v)
        t.set_constraint("oom", -1.0 if status == "ok" else 1.0)
        study.tell(t, [thr or 0.0, peak or 99.0])
    from tuner.cli import main

    assert (
        main(
            [
                "report",
                "--storage",
                f"sqlite:///{tmp_path / 'study.db'}",
                "--study",
                "small",
                "--out",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    text = (tmp_path / "r" / "report.html").read_text()
    assert "not enough feasible trials to estimate importances (1; need 4)" in text
    assert "Device memory unknown" in text
    with open(tmp_path / "r" / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "oom"]


def test_report_shows_the_confirmation_intervals_and_lengths(tmp_path):
    """A study holding a --confirm confirmation (see test_export.add_confirmation): the report ranks by it
    and shows each figure with its interval, every re-run's own interval and the lengths the trials saw."""
    from tests.tuner.results.test_export import add_confirmation
    from tuner.cli import main

    add_confirmation(make_demo_study(f"sqlite:///{tmp_path / 'study.db'}"))
    assert main(["report", "--storage", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.html").read_text()
    # the card and the section: #3's paired ratios 1.467, 1.464, 1.483 (the single trials said 1.40x)
    assert "best vs baseline, confirmed" in text and ">1.47x<" in text
    # the interval's width follows the run-noise rule (tuner.rules.race): its digits are that rule's tests' to pin
    claim = r"1\.47x the baseline \(90% interval 1\.[34]\d–1\.[56]\d, 3 interleaved rounds\)"
    assert re.search(rf"runs at <b>{claim}</b>", text)
    section = text.split("<h2>Finalists confirmed side by side</h2>")[1].split("<h2>")[0]
    for n, ratio in ((11, "1.35"), (3, "1.47"), (10, "1.21"), (0, "1.00")):
        assert re.search(rf"<tr><td>#{n}( ★)?</td><td><b>{ratio}x</b>", section), n
    # every trial's own 90% interval where it has one (the re-runs here): #3's first re-run ran 2200 ± 3%
    assert "<td>2200.0</td><td>2134.0–2266.0</td>" in text
    assert "<th>90% interval</th>" in text.split("<h2>Pareto configs</h2>")[1]
    lengths = text.split("<h2>Sequence lengths the trials saw</h2>")[1].split("<h2>")[0]
    assert "median over 12 ok trials" in lengths
    assert "<th class='knob'>prompt</th><td>12</td><td>20</td><td>41</td><td>64</td>" in lengths
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert re.search(rf"- confirmed: {claim}", summary)
    assert "- prompt lengths (12 trials): p10 12, p50 20, p90 41, max 64" in summary


def test_report_without_confirmation_says_unconfirmed(demo_report):
    text = (demo_report / "report.html").read_text()
    assert "Unconfirmed: the study holds no confirmation" in text and "single trials, unconfirmed" in text
    assert "No trial recorded its sequence lengths." in text
    assert "Finalists confirmed side by side" not in text


def test_report_errors_are_one_line(tmp_path, capsys):
    from tuner.cli import main

    assert main(["report", "--storage", str(tmp_path)]) == 2
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

    from tuner.study.storage import open_storage, resolve_read_spec

    app = optuna_dashboard.wsgi(open_storage(resolve_read_spec(out=demo_out), read_only=True))

    def get(path: str):
        status = {}
        environ = {
            "REQUEST_METHOD": "GET",
            "PATH_INFO": path,
            "QUERY_STRING": "",
            "SERVER_NAME": "x",
            "SERVER_PORT": "80",
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": sys.stderr,
            "wsgi.url_scheme": "http",
        }
        body = b"".join(app(environ, lambda s, h, *a: status.setdefault("s", s)))
        return status["s"], body

    status, body = get("/api/studies")
    assert status.startswith("200")
    studies = json.loads(body)["study_summaries"]
    assert [s["study_name"] for s in studies] == ["demo"]
    status, body = get(f"/api/studies/{studies[0]['study_id']}")
    assert status.startswith("200")
    assert len(json.loads(body)["trials"]) == len(DEMO_TRIALS)


@pytest.mark.slow
def test_report_on_real_search(real_search, tmp_path):
    from tuner.results.view import load

    view = load(out=real_search)
    statuses = {int(r["number"]): r["status"] for _, r in view.trials.iterrows()}
    assert len(statuses) >= 4
    r = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "report", "--storage", str(real_search), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    check_report_dir(tmp_path, len(statuses), statuses)
    # `search --report` wrote the same report next to the study
    check_report_dir(real_search / "report", len(statuses), statuses)
    # the tuner wrote the contract's study attributes
    for key in ("ppotune_schema", "base_config", "device", "nproc"):
        assert key in view.attrs, key
    assert view.trials["baseline"].any()
