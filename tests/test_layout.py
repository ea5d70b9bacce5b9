"""The layout's rules: which side may import what, no import circles, small modules, one definition per word.

The import graph is read from the source (AST), every import counted, lazy ones inside functions included: a
lazy import is still a dependency, only a later one.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("trainer/**/*.py"), *REPO.glob("tuner/**/*.py"), *REPO.glob("benchmarks/*.py")])
PACKAGES = ("trainer", "tuner")
#: libraries the torch-free side never imports (the tuner's process must stay light, and verl's stack is the
#: user's verl environment's, not ours)
HEAVY = frozenset({"torch", "transformers", "vllm", "verl", "ray", "flash_attn"})
#: the torch-free part of trainer/: what the tuner may import. Top-level modules are the shared vocabulary
#: (contracts, the typed config, the summary, step logging); trainer.launch is the process side of a run
#: (``ppotune train``, the rank group, the warm job's files); the verl adapter runs verl as a subprocess.
TORCH_FREE_TRAINER_PACKAGES = ("trainer.config", "trainer.launch")
TORCH_FREE_TRAINER_MODULES = frozenset(
    {
        "trainer.verl_engine",
        "trainer.verl_engine.adapter",
        "trainer.verl_engine.knob_reads",
        "trainer.verl_engine.metrics",
        "trainer.verl_engine.overrides",
        "trainer.verl_engine.result",
        "trainer.verl_engine.run_file",
        "trainer.verl_engine.schedule",
        "trainer.verl_engine.worst_case",
    }
)
#: code that launches trials: it never reads a study through results/ (the report's view of a finished study);
#: the commands (``tuner.search.command``, ``tuner.validate``) compose the two
LAUNCHING = (
    "tuner.trials",
    "tuner.stages",
    "tuner.fit",
    "tuner.search.loop",
    "tuner.search.policy",
    "tuner.search.session",
)
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
LONG_MARK = re.compile(r"#\s*long:\s*\S")  # "# long: why" -- a long function or module that says why


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in [*REPO.glob("trainer/**/*.py"), *REPO.glob("tuner/**/*.py")]}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _source(module: str) -> str:
    return MODULES[module].read_text()


@functools.lru_cache(maxsize=None)
def _imports(module: str) -> tuple[frozenset, frozenset]:
    """(top-level names of every library it imports, the project modules it imports)."""
    libs, ours = set(), set()
    for node in ast.walk(ast.parse(_source(module))):
        if isinstance(node, ast.Import):
            for a in node.names:
                libs.add(a.name.split(".")[0])
                ours |= {a.name} & MODULES.keys()
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            libs.add(target.split(".")[0])
            for a in node.names:
                name = f"{target}.{a.name}"
                ours.add(name if name in MODULES else target)
    return frozenset(libs - {""}), frozenset(m for m in ours if m in MODULES and m != module)


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        for d in _imports(m)[1]:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _torch_free(module: str) -> bool:
    if module.startswith("tuner"):
        return True
    if module.count(".") == 1 or module == "trainer":  # trainer/'s top level: the shared vocabulary
        return True
    return module in TORCH_FREE_TRAINER_MODULES or _within(module, TORCH_FREE_TRAINER_PACKAGES)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a path that closes."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(_imports(v)[1]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(MODULES):
        if m not in index:
            visit(m)
    return out


def _cycle_path(component: list[str]) -> str:
    """One closed path through a component: a -> b -> a (what the failure names)."""
    members, start = set(component), component[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(d for d in _imports(path[-1])[1] if d in members)
        back = [d for d in nxt if d in seen]
        if back:
            return " -> ".join(path[path.index(back[0]) :] + [back[0]])
        path.append(nxt[0])
        seen.add(nxt[0])


def test_no_import_cycle_among_project_modules():
    assert [_cycle_path(c) for c in _cycles()] == []


def test_a_cycle_is_found_and_named(monkeypatch):
    """The checker itself: a circle through a lazy import, in two made-up modules, is named as a closed path."""
    fake = {"trainer.a": "from trainer.b import x\n", "trainer.b": "def f():\n    from trainer import a\n"}
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {m: REPO / f"{m.replace('.', '/')}.py" for m in fake})
    monkeypatch.setattr(sys.modules[__name__], "_source", fake.__getitem__)
    _imports.cache_clear()
    try:
        assert [_cycle_path(c) for c in _cycles()] == ["trainer.a -> trainer.b -> trainer.a"]
    finally:
        _imports.cache_clear()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("trainer")))
def test_trainer_never_imports_tuner(module):
    assert "tuner" not in _imports(module)[0]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _torch_free(m)))
def test_torch_free_modules_import_no_torch(module):
    assert not _imports(module)[0] & HEAVY
    heavy_deps = sorted(m for m in _imports(module)[1] if not _torch_free(m))
    assert heavy_deps == [], f"{module} imports modules that import torch: {heavy_deps}"


def test_the_tuner_imports_only_torch_free_trainer_modules():
    bad = sorted(f"{m} -> {d}" for m in MODULES if m.startswith("tuner") for d in _imports(m)[1] if not _torch_free(d))
    assert bad == []


def test_the_verl_adapter_imports_nothing_of_our_engine():
    """verl's side (the adapter, its CPU shim and memory cap inside verl's processes) never runs our PPO engine
    or our ranks. The preset maker is the exception by design: it writes the embedded model's checkpoint."""
    verl_side = [m for m in MODULES if _within(m, ["trainer.verl_engine"]) and m != "trainer.verl_engine.preset"]
    assert verl_side
    bad = sorted(
        f"{m} -> {d}" for m in verl_side for d in _closure(m) if _within(d, ["trainer.engine", "trainer.rank"])
    )
    assert bad == []


def test_results_are_never_imported_by_the_code_that_launches_trials():
    launching = [m for m in MODULES if _within(m, LAUNCHING)]
    assert launching
    bad = sorted(f"{m} -> {d}" for m in launching for d in _closure(m) if _within(d, ["tuner.results"]))
    assert bad == []


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
    modules = sorted(m for m in MODULES if _torch_free(m))
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "from tuner.cli import build_parser\n"
        "for c in ('search', 'space', 'report', 'export', 'train', 'check'): build_parser(only=c)\n"
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
