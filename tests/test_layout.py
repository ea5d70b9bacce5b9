"""The layout's rules: which side may import what and no import circles (import-linter's contracts in
pyproject.toml), small modules, one definition per word, one name per concept.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("trainer/**/*.py"), *REPO.glob("tuner/**/*.py"), *REPO.glob("benchmarks/*.py")])
PACKAGES = ("trainer", "tuner")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
LONG_MARK = re.compile(r"#\s*long:\s*\S")  # "# long: why" -- a long function or module that says why


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in [*REPO.glob("trainer/**/*.py"), *REPO.glob("tuner/**/*.py")]}


def test_import_contracts():
    """The layers, the torch-free side and "no circle between sub-packages" are import-linter contracts
    (pyproject.toml's ``[tool.importlinter]``): every import counted, lazy ones inside functions included."""
    r = subprocess.run(
        [sys.executable, "-m", "importlinter.cli", "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    if r.returncode != 0 and "No module named importlinter" in r.stderr:
        pytest.skip("import-linter is not installed (pip install -e .[dev])")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def _long_marked(lines: list[str], first: int, last: int) -> bool:
    return any(LONG_MARK.search(line) for line in lines[first:last])


def test_modules_and_functions_are_small_or_say_why():
    """No module over MAX_MODULE_LINES and no function over MAX_FUNCTION_LINES lines, unless a ``# long: why``
    comment says why (in a module's first 30 lines; in a function's first 5)."""
    bad = []
    for module, path in sorted(MODULES.items()):
        lines = path.read_text().splitlines()
        rel = path.relative_to(REPO)
        if len(lines) > MAX_MODULE_LINES and not _long_marked(lines, 0, 30):
            bad.append(f"{rel}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES and not _long_marked(lines, node.lineno - 1, node.lineno + 4):
                    bad.append(f"{rel}:{node.lineno}: {node.name} is {size} lines")
    assert bad == []


def test_tuner_never_imports_torch_at_run_time():
    modules = sorted(m for m in MODULES if m.startswith("tuner"))
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "from tuner.cli import _COMMANDS, build_parser\n"
        "for c in set(_COMMANDS) - {'make-preset'}: build_parser(only=c)\n"
        "assert not {'torch', 'transformers', 'vllm'} & set(sys.modules), 'torch was imported'\nprint('clean')"
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


#: public names defined more than once on purpose (starts empty: a second thing gets its own name)
ALLOWED_DUPLICATES: dict[str, set[str]] = {}
#: the command protocol: every ``ppotune`` subcommand's module defines these, and the CLI calls them by name
COMMAND_PROTOCOL = frozenset({"add_arguments", "run"})


def _public_definitions() -> dict[str, list[str]]:
    """``{name: [where, ...]}`` of every module-level public class and function in trainer/ and tuner/."""
    from tuner.cli import _COMMANDS

    commands = {module for module, _ in _COMMANDS.values()}
    defs: dict[str, list[str]] = {}
    for module, path in sorted(MODULES.items()):
        command = module in commands
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_") or (command and node.name in COMMAND_PROTOCOL):
                continue
            defs.setdefault(node.name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return defs


def test_one_name_per_concept():
    """No public class or function name is defined twice for two things (the command protocol aside)."""
    twice = {name: where for name, where in _public_definitions().items() if len(where) > 1}
    bad = {
        name: where for name, where in twice.items() if {w.split(":")[0] for w in where} != ALLOWED_DUPLICATES.get(name)
    }
    assert bad == {}, "\n".join(f"{name}: {', '.join(where)}" for name, where in sorted(bad.items()))
