"""The layout's rules: which side may import what, and one definition per word."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("trainer/**/*.py"), *REPO.glob("tuner/**/*.py"), *REPO.glob("benchmarks/*.py")])


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("path", sorted(REPO.glob("trainer/**/*.py")), ids=lambda p: p.name)
def test_trainer_never_imports_tuner(path):
    assert "tuner" not in _imports(path)


@pytest.mark.parametrize("path", sorted(REPO.glob("tuner/**/*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_tuner_source_never_imports_torch(path):
    assert not _imports(path) & {"torch", "transformers", "vllm"}


def test_tuner_never_imports_torch_at_run_time():
    modules = sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts)
        for p in REPO.glob("tuner/**/*.py")
        if p.name != "__init__.py"
    )
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "from tuner.cli import build_parser\n"
        "for c in ('search', 'space', 'report', 'export', 'train', 'check'): build_parser(only=c)\n"
        "import trainer.contracts, trainer.config, trainer.launch.check, trainer.launch.train\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nprint('clean')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr


# Each word of the shared vocabulary has exactly one definition (trainer/contracts.py unless said).
ONE_DEFINITION = {
    r"^PHASES\s*[:=]": "trainer/contracts.py",
    r"^(\w+_)?STATUSES\s*[:=]": None,  # statuses are the Status enum: no tuple of strings anywhere
    r"^class Status\b": "trainer/contracts.py",
    r"^class ExitCode\b": "trainer/contracts.py",
    r"^\s*EXIT_\w+\s*[:=,]": None,  # exit codes are ExitCode members
    r"^DEFAULT_HEADROOM\s*[:=]": "trainer/contracts.py",
    r"^CONSTRAINT_KEY\s*[:=]": "trainer/contracts.py",
    r"^DIRECTIONS\s*[:=]": "trainer/contracts.py",
    r"^def short_(name|knob)\b": "trainer/contracts.py",
    r"^def (parse|resolve)_storage\b": "trainer/contracts.py",
    r"^def _classify\b": None,
    r"^def pareto_\w+\b": "tuner/study/frame.py",
    r"^def open_storage\b": "tuner/study/storage.py",
    r"^class TrialRecord\b": "trainer/contracts.py",
}


@pytest.mark.parametrize("pattern", list(ONE_DEFINITION))
def test_one_definition_per_word(pattern):
    where = [
        str(p.relative_to(REPO))
        for p in SOURCES
        if any(re.search(pattern, line) for line in p.read_text().splitlines())
    ]
    expected = ONE_DEFINITION[pattern]
    assert where == ([expected] if expected else []), where


def test_no_private_optuna_attributes():
    """No ``trial._trial_id``, ``study._storage`` or other private Optuna attribute in our code."""
    bad = []
    for p in SOURCES:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\._(trial_id|study_id|storage|cached_frozen_trial)\b", line):
                bad.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    assert bad == []


def test_status_strings_are_not_spelled_in_the_tuner():
    """Trial statuses are read through Status/TrialRecord, not as ``user_attrs.get("status")``."""
    bad = []
    for p in REPO.glob("tuner/**/*.py"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(
                r"""user_attrs(\.get\(|\[)["'](status|confirm_of|duplicate_of|inferred_from|baseline)""", line
            ):
                bad.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    assert bad == []
