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


# Evidence lives in docs/decisions.md and benchmarks/README.md (dated, with machine and command); a comment gives
# the reason in one line and points there, so that it cannot go stale when the code changes.
EVIDENCE_TREES = ("trainer", "tuner", "tests", "scripts", "benchmarks")
#: "path:line" of a comment or docstring allowed to hold a date or a measured figure, each with its reason
EVIDENCE_ALLOWED: dict[str, str] = {}
EVIDENCE_DATE = re.compile(r"\b20\d\d-\d\d(-\d\d)?\b")
#: words that report an observation (``measured: 3.2 s``, ``seen on an H200``), not ones that name a quantity
#: (``the measured peak``, ``its measured steps``)
EVIDENCE_WORD = re.compile(
    r"\bmeasured(\s*:|\s+(on|in|at|here|over|with|by)\b|\s+\d)|\bseen(\s*:|\s+(on|in)\b)|\d\s*\w*\s+seen\b"
    r"|\btook\b|\bon the CPU demo\b|\bon a CI run\b|\bon (an? |the first )?H200|2-core|CPU VM|recorded grid"
    r"|\bmedians? of \d+",
    re.IGNORECASE,
)
EVIDENCE_FIGURE = re.compile(
    r"\d(x|×)(?!\w)|\d+(\.\d+)?\s*(%|(s|ms|min|seconds?|GB|GiB|MB|MiB|tok/s|tokens/s)\b)", re.IGNORECASE
)
#: not evidence: text in double backticks (a format example) and a paper citation ("Schulman et al. 2017")
EVIDENCE_SKIP = re.compile(r"``.*?``|\bet al\.?,? \(?\d{4}\)?|\b\d+ ?% interval", re.DOTALL)


def _comment_texts(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each comment block (consecutive comment lines) and each string statement."""
    import io
    import tokenize

    blocks: list[tuple[int, str]] = []
    last = -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#:").strip()
        alone = tok.line.lstrip().startswith("#")  # a comment on its own line continues the block above it
        if alone and blocks and tok.start[0] == last + 1:
            blocks[-1] = (blocks[-1][0], blocks[-1][1] + "\n" + text)
        else:
            blocks.append((tok.start[0], text))
        last = tok.start[0] if alone else -1
    for node in ast.walk(ast.parse(source)):  # docstrings and the attribute docstrings under fields
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            blocks.append((node.lineno, node.value.value))
    return blocks


def _evidence(source: str) -> list[tuple[int, str]]:
    """(line, sentence) of each comment or docstring sentence holding a date, or a measured figure."""
    found = []
    for first, text in _comment_texts(source):
        text = EVIDENCE_SKIP.sub(lambda m: "\n" * m.group().count("\n"), text)  # keeps line numbers
        at = 0
        for sentence in re.split(r"(?<=[.;!?])\s+|\n\s*\n", text):
            line = first + text.count("\n", 0, text.find(sentence, at))
            at = text.find(sentence, at) + len(sentence)
            figure = EVIDENCE_WORD.search(sentence) and EVIDENCE_FIGURE.search(sentence)
            if EVIDENCE_DATE.search(sentence) or figure:
                found.append((line, " ".join(sentence.split())))
    return sorted(found)


def test_no_evidence_in_code_comments():
    """No date and no measured figure in a comment or docstring: see docs/decisions.md for where they go."""
    bad = []
    for tree in EVIDENCE_TREES:
        for p in sorted(REPO.glob(f"{tree}/**/*.py")):
            rel = p.relative_to(REPO)
            for line, sentence in _evidence(p.read_text()):
                if f"{rel}:{line}" not in EVIDENCE_ALLOWED:
                    bad.append(f"{rel}:{line}: {sentence[:140]}")
    assert bad == [], "move these to docs/decisions.md or benchmarks/README.md and point there:\n" + "\n".join(bad)


def test_evidence_in_a_comment_is_found():
    source = (
        '"""A module.\n\nChosen on 2026-12-01 after a sweep."""\n'
        "x = 1  # fine: the reason alone\n"
        "# one line of context,\n# measured: 3.2 s a step\n"
        "def f():\n    '''Doubles ``1.42x the baseline`` as Schulman et al. 2017 say.'''\n"
    )
    assert [line for line, _ in _evidence(source)] == [3, 5]


#: public names defined more than once on purpose (starts empty: a second thing gets its own name)
ALLOWED_DUPLICATES: dict[str, set[str]] = {}
#: the command protocol: every module under tuner/commands/ (one a subcommand) defines these, the CLI calls them
COMMAND_PROTOCOL = frozenset({"add_arguments", "run"})


def _public_definitions() -> dict[str, list[str]]:
    """``{name: [where, ...]}`` of every module-level public class and function in trainer/ and tuner/."""
    defs: dict[str, list[str]] = {}
    for module, path in sorted(MODULES.items()):
        command = module.startswith("tuner.commands.")
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


#: test files that test a package's behaviour through its top rather than one module (tests/<package path>/)
MIRROR_EXCEPTIONS = {
    "tests/trainer/engine/test_invariance.py": "one PPO update under every knob: the engine as a whole",
    "tests/trainer/engine/test_gpu.py": "the engine's GPU checks, run as a script by scripts/gpu_check.sh",
}


def _mirrors(test: Path) -> bool:
    """tests/<dir>/test_<name>.py (or test_<name>_<aspect>.py) mirrors <dir>/<name>.py or the package <dir>/<name>/."""
    where = REPO / test.parent.relative_to(REPO / "tests")
    parts = test.stem.removeprefix("test_").split("_")
    names = ("_".join(parts[:n]) for n in range(len(parts), 0, -1))
    return any((where / f"{name}.py").is_file() or (where / name / "__init__.py").is_file() for name in names)


def test_tests_mirror_the_packages():
    """tests/<path of a module> finds its tests: every test file under tests/tuner and tests/trainer mirrors a module
    or a package there (CONTRIBUTING, Tests)."""
    tests = sorted(p for top in ("tuner", "trainer") for p in (REPO / "tests" / top).rglob("test_*.py"))
    assert len(tests) > 40
    stray = [p.relative_to(REPO).as_posix() for p in tests if not _mirrors(p)]
    assert sorted(set(stray) - set(MIRROR_EXCEPTIONS)) == []
    assert sorted(set(MIRROR_EXCEPTIONS) - set(stray)) == []  # an exception that mirrors after all is dropped
