"""docs/verl_parity.md names real code: every ppotune function it cites exists, and so does every
verl 0.9.1 function (checked against verl's source when it is on disk)."""

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
