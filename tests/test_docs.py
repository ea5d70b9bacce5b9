"""The docs name real code: every ppotune function docs/verl_parity.md cites exists, and so does every
verl 0.9.1 function (checked against verl's source when it is on disk); every module, name and path
docs/architecture.md names exists."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from support import REPO

PARITY = REPO / "docs" / "verl_parity.md"
# `trainer/engine/parallel.py:move_params` or `transformer_impl.py:FSDPEngine._build_fsdp_module`
REF = re.compile(r"`([\w/]+\.py):([\w.]+)`")
VERL_SHORT = {"transformer_impl.py": "workers/engine/fsdp/transformer_impl.py"}


def defined_names(path: Path) -> set[str]:
    """Top-level functions/classes and Class.method names defined in a Python file."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}.{n.name}" for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
    return names


def rows() -> list[str]:
    return [line for line in PARITY.read_text().splitlines() if line.startswith("| ") and not line.startswith("|---")]


def references() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(ppotune refs, verl refs) from the table rows: column 3 is ppotune's, column 2 verl's."""
    ours, theirs = [], []
    for line in rows()[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 5 or cells[0] == "behaviour":
            continue
        theirs += REF.findall(cells[1])
        ours += REF.findall(cells[2])
    return ours, theirs


def test_every_row_says_same_or_different_with_a_consequence():
    for line in rows():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "behaviour":
            continue
        assert len(cells) == 5, line
        verdict, consequence = cells[3], cells[4]
        assert verdict.startswith(("same", "different")), line
        if verdict.startswith("different"):
            assert consequence not in ("", "—"), f"a difference without its consequence: {line}"


def test_every_ppotune_function_named_exists():
    ours, _ = references()
    assert len(ours) > 30
    missing = [f"{f}:{n}" for f, n in ours if n not in defined_names(REPO / f)]
    assert not missing, missing


def test_every_verl_function_named_exists():
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl's source is not installed (scripts/install_test_deps.sh puts it there)")
    root = Path(next(iter(spec.submodule_search_locations)))
    _, theirs = references()
    assert len(theirs) > 15
    missing = []
    for f, n in theirs:
        path = root / VERL_SHORT.get(f, f)
        if not path.is_file() or n not in defined_names(path):
            missing.append(f"{f}:{n}")
    assert not missing, missing


ARCHITECTURE = REPO / "docs" / "architecture.md"
DOTTED = re.compile(r"`((?:trainer|tuner)(?:\.\w+)+)")  # `tuner.search.loop.Search.ask` (a call's arguments aside)
PATH = re.compile(r"`((?:trainer|tuner|tests|docs|search_spaces|configs)/[\w/.]+)`")


def _module_file(dotted: str) -> tuple[Path, list[str]] | None:
    """The longest prefix of ``dotted`` that is one of our modules: (its file, the names after it)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f, parts[i:]
    return None


def _defined_anywhere(path: Path, name: str) -> bool:
    """A function, class, method or assigned name anywhere in the file (a nested helper included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def test_the_architecture_page_names_real_modules_names_and_paths():
    text = ARCHITECTURE.read_text()
    dotted, paths = DOTTED.findall(text), PATH.findall(text)
    assert len(dotted) > 20 and len(paths) > 5
    missing = []
    for name in dotted:
        found = _module_file(name)
        if found is None or not all(_defined_anywhere(found[0], n) for n in found[1]):
            missing.append(name)
    missing += [p for p in paths if not (REPO / p).exists()]
    assert missing == []
