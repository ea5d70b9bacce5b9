"""The knob table of docs/verl_parity.md (issue 34): generated from ``trainer/verl_engine/knob_reads.py`` and current;
every key a shipped space varies is in it, every verl function it names exists in verl 0.9.1, and every key it says
verl never reads is one ``--engine verl`` refuses."""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest

from support import REPO
from trainer.verl_engine.knob_reads import VERL_READS
from tuner.space.registry import VERL_NO_OPS

_spec = importlib.util.spec_from_file_location("gen_verl_knob_table", REPO / "scripts" / "gen_verl_knob_table.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def test_the_knob_table_is_current():
    text = gen.PAGE.read_text()
    assert gen.updated(text) == text, (
        "docs/verl_parity.md's knob table is out of date: python scripts/gen_verl_knob_table.py"
    )


def test_every_shipped_key_is_in_the_table_and_the_no_ops_are_refused():
    keys = gen.shipped_keys()
    assert set(keys) <= set(VERL_READS), sorted(set(keys) - set(VERL_READS))
    never = {k for k, r in VERL_READS.items() if r.paths == "none"}
    assert never <= set(VERL_NO_OPS), sorted(never - set(VERL_NO_OPS))
    # the shipped verl spaces vary only keys verl reads on the path its trials run (v1)
    for key, spaces in keys.items():
        if any(s.startswith("verl_") for s in spaces):
            assert "v1" in VERL_READS[key].paths and key not in VERL_NO_OPS, key


def _defined(path: Path, name: str) -> bool:
    """``name`` (``f`` or ``Class.method``) is defined in ``path``."""
    tree = ast.parse(path.read_text())
    cls, _, fn = name.rpartition(".")
    for node in ast.walk(tree):
        if cls and isinstance(node, ast.ClassDef) and node.name == cls:
            return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == fn for n in node.body)
        if not cls and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == fn:
            return True
    return False


def test_every_verl_function_named_exists():
    root = Path(os.environ.get("PPOTUNE_VERL_ROOT") or REPO / ".test_deps" / "verl" / "verl")
    if not (root / "trainer" / "config" / "ppo_trainer.yaml").is_file():
        root = root / "verl"
    if not (root / "trainer" / "config" / "ppo_trainer.yaml").is_file():
        pytest.skip(f"verl 0.9.1's source not unpacked ({root}): scripts/install_test_deps.sh")
    missing = []
    for read in VERL_READS.values():
        file, _, name = read.where.partition(":")
        if not (root / file).is_file() or not _defined(root / file, name):
            missing.append(read.where)
    assert not missing, sorted(set(missing))
