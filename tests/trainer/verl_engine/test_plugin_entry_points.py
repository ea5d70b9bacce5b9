"""The plugin's start-up check (trainer.verl_engine.plugin.entry_points): every verl function its hooks wrap is in
verl's source with the parameters they pass, else one line refuses verl, naming its version and what it lacks.

Read from verl 0.9.1's unpacked source (scripts/install_test_deps.sh), whole and with one piece taken out.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from trainer.verl_engine.adapter import classify_failure
from trainer.verl_engine.plugin import entry_points
from trainer.verl_engine.schedule import LOG_ENV

REPO = Path(__file__).resolve().parents[3]
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"


@pytest.fixture(scope="module")
def verl_091() -> Path:
    root = Path(os.environ.get("PPOTUNE_VERL_ROOT") or REPO / ".test_deps" / "verl" / "verl")
    if not (root / "workers" / "engine_workers.py").is_file():
        pytest.skip(f"verl 0.9.1's source not unpacked ({root}): scripts/install_test_deps.sh")
    assert (root / "version" / "version").read_text().strip() == "0.9.1"
    return root


@pytest.fixture
def verl_copy(verl_091, tmp_path) -> Path:
    """A copy of verl 0.9.1's package to break, as ``<tmp>/verl``."""
    return Path(shutil.copytree(verl_091, tmp_path / "verl", ignore=shutil.ignore_patterns("__pycache__")))


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_verl_091_has_every_entry_point(verl_091):
    assert entry_points.entry_point_gaps(verl_091) == []
    assert entry_points.refusal(verl_091) is None


def test_entry_points_are_what_the_hooks_patch():
    """One list: the modules checked are the modules the worker's and the driver's PATCHES name."""
    pytest.importorskip("torch")
    from trainer.verl_engine.plugin import driver, worker

    assert {ep.module for ep in entry_points.ENTRY_POINTS} == {*worker.PATCHES, *driver.PATCHES}


def test_docs_name_the_tested_versions():
    text = (REPO / "docs" / "verl.md").read_text()
    for version in entry_points.TESTED_VERSIONS:
        assert re.search(rf"tested with verl[^.\n]*{re.escape(version)}", text), version


def test_a_missing_method_is_refused_in_one_line_naming_it_and_the_version(verl_copy):
    _edit(verl_copy / "workers" / "engine_workers.py", "def infer_batch(self,", "def infer_batch_v2(self,")
    (verl_copy / "version" / "version").write_text("0.10.0.dev0\n")
    line = entry_points.refusal(verl_copy)
    assert line is not None and "\n" not in line
    assert "verl 0.10.0.dev0" in line and "tested with verl 0.9.1" in line
    assert "verl.workers.engine_workers.TrainingWorker has no method infer_batch" in line
    assert "train_mini_batch" not in line  # only what is missing


def test_a_function_imported_by_name_is_followed_to_its_definition(verl_copy):
    """transformer_impl binds prepare_micro_batches with ``from ..utils import``: gone from utils, it is missing."""
    _edit(verl_copy / "workers" / "engine" / "utils.py", "def prepare_micro_batches(", "def prepare_micro_batches_v2(")
    assert entry_points.entry_point_gaps(verl_copy) == [
        "verl.workers.engine.utils has no prepare_micro_batches "
        "(verl.workers.engine.fsdp.transformer_impl.prepare_micro_batches)"
    ]


def test_a_changed_signature_is_refused(verl_copy):
    """The sampler's wrapper calls ``create_rl_sampler(data_config, dataset)``: a third required parameter breaks it,
    in the module that defines it and in each that imports it."""
    _edit(
        verl_copy / "trainer" / "ppo" / "utils.py",
        "def create_rl_sampler(data_config, dataset):",
        "def create_rl_sampler(data_config, dataset, processor):",
    )
    gaps = entry_points.entry_point_gaps(verl_copy)
    assert len(gaps) == 4 and all("the plugin passes (data_config, dataset)" in g for g in gaps)
    assert gaps[0] == (
        "verl.trainer.ppo.utils.create_rl_sampler takes (data_config, dataset, processor), "
        "the plugin passes (data_config, dataset)"
    )


def test_a_verl_lacking_much_is_refused_in_a_line_the_trial_keeps_whole(verl_copy):
    """classify_failure keeps a line's last 300 characters: the pieces that do not fit are counted, not cut."""
    for part in ("engine_workers.py", "engine/fsdp/transformer_impl.py", "engine/utils.py"):
        (verl_copy / "workers" / part).unlink()
    for part in ("utils/tracking.py", "single_controller/ray/base.py", "trainer/ppo/utils.py"):
        (verl_copy / part).unlink()
    gaps = entry_points.entry_point_gaps(verl_copy)
    line = entry_points.refusal(verl_copy)
    assert len(line) <= 300 and line.startswith("ppotune verl plugin error: verl 0.9.1 (") and gaps[0] in line
    shown = re.search(r"; and (\d+) more$", line)
    assert shown and line.count("; ") + int(shown.group(1)) == len(gaps)


def test_a_missing_module_is_refused(verl_copy):
    (verl_copy / "utils" / "tracking.py").unlink()
    assert entry_points.entry_point_gaps(verl_copy) == ["verl.utils.tracking is missing"]


def test_verl_with_the_plugin_exits_with_the_line_the_trial_records(verl_copy):
    """verl's own ``__init__`` imports the plugin (VERL_USE_EXTERNAL_MODULES); the plugin refuses the broken copy
    before anything else runs: exit 1, one line on stderr, and that line is the trial's error (classify_failure)."""
    if not VERL_PYTHON.exists():
        pytest.skip(f"verl venv not installed ({VERL_PYTHON})")
    _edit(verl_copy / "utils" / "tracking.py", "    def log(self, data, step, backend=None):", "    def log(self, x):")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(verl_copy.parent), str(REPO)]),  # the copy shadows the venv's verl
        "VERL_USE_EXTERNAL_MODULES": "trainer.verl_engine.plugin",
        LOG_ENV: str(verl_copy.parent / "phases.jsonl"),
    }
    r = subprocess.run(
        [str(VERL_PYTHON), "-c", "import verl; print('imported')"], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1 and "imported" not in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("ppotune verl plugin error: verl 0.9.1 (") and "Traceback" not in r.stderr
    assert lines[-1].endswith(
        "verl.utils.tracking.Tracking.log takes (self, x), the plugin passes (self, data, step, ...)"
    )
    assert classify_failure(r.returncode, r.stderr) == ("error", lines[-1][-300:])
    assert len(lines[-1]) <= 300, "classify_failure keeps a line's last 300 characters"


def test_the_plugin_loads_into_an_intact_verl(verl_091):
    """The same import of verl 0.9.1 with the plugin goes through."""
    if not VERL_PYTHON.exists():
        pytest.skip(f"verl venv not installed ({VERL_PYTHON})")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(verl_091.parent), str(REPO)]),
        "VERL_USE_EXTERNAL_MODULES": "trainer.verl_engine.plugin",
        LOG_ENV: os.devnull,
    }
    code = "import sys, verl; print('verl.workers.engine_workers' in sys.modules)"
    r = subprocess.run([str(VERL_PYTHON), "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False"  # the check read verl's workers, it did not import them
