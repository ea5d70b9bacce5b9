"""notebooks/pareto_report.ipynb executes top to bottom (nbclient) on a study, so it never rots."""

from __future__ import annotations

import pytest

from support import DEMO_TRIALS, REPO, make_demo_study

ROOT = REPO
NOTEBOOK = ROOT / "notebooks" / "pareto_report.ipynb"


def _execute(monkeypatch, storage: str, study: str = ""):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("PPOTUNE_STORAGE", storage)
    monkeypatch.setenv("PPOTUNE_STUDY", study)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    )
    client.execute()  # raises CellExecutionError naming the cell if any cell fails
    return nb


def _outputs(nb) -> str:
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", ""))
            text.extend(str(v) for k, v in out.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(text)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def test_notebook_executes_on_a_study(tmp_path, monkeypatch):
    make_demo_study(f"sqlite:///{tmp_path / 'study.db'}")
    nb = _execute(monkeypatch, str(tmp_path))
    out = _outputs(nb)
    assert f"study 'demo': {len(DEMO_TRIALS)} trials" in out
    assert "Trial #11" in out and "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4" in out
    assert _images(nb) >= 2  # the Pareto plot and the importances


def test_notebook_on_a_journal_study_by_name(tmp_path, monkeypatch):
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    log = tmp_path / "s.log"
    storage = JournalStorage(JournalFileBackend(str(log)))
    make_demo_study(storage, "a")
    make_demo_study(storage, "b", memory_limit_gb=60.0)
    nb = _execute(monkeypatch, f"journal:{log}", "b")
    out = _outputs(nb)
    assert "study 'b'" in out and "memory cap 60 GB" in out and "Trial #10" in out


@pytest.mark.slow
def test_notebook_on_real_search(real_search, monkeypatch):
    nb = _execute(monkeypatch, str(real_search))
    assert "trials |" in _outputs(nb)
