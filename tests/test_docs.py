"""The docs name real code: every ppotune function docs/verl_parity.md cites exists, and so does every
verl 0.9.1 function (checked against verl's source when it is on disk); every module, name and path
docs/architecture.md names exists; every ``ppotune`` command in a bash block of the README and docs/ parses with
the real CLI parser; docs/cli.md's options are what the parsers say; every page is reachable from the README."""

import ast
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

from support import REPO, verl_root_or_skip

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
    """The behaviour tables' rows (the generated knob table has its own test:
    tests/trainer/verl_engine/test_knob_reads.py)."""
    text = PARITY.read_text()
    start, end = text.find("<!-- BEGIN knob table"), text.find("<!-- END knob table -->")
    if start >= 0 and end > start:
        text = text[:start] + text[end:]
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]


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
    root = verl_root_or_skip()
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


# --------------------------------------------------------------------------- commands in the docs
#: Pages whose ```bash blocks are parsed. A synopsis with placeholders goes in a ```text block instead.
PAGES = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    REPO / "benchmarks" / "README.md",
    *sorted(REPO.glob("docs/*.md")),
]
_ENV = re.compile(r"^[A-Za-z_]\w*=")  # FOO=bar ppotune ...
_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}


def bash_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv after ``ppotune``) for every ``ppotune`` command in the page's ```bash blocks: ``\\``
    continuations joined, comments dropped, ``&&``/``;``/``|`` chains split, leading ``VAR=value`` skipped."""
    out, block, start = [], None, 0
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if block is None:
            if line.strip().startswith("```bash"):
                block, start = [], i + 1
            continue
        if line.strip().startswith("```"):
            joined = "\n".join(block).replace("\\\n", " ")
            for k, cmd in enumerate(joined.split("\n")):
                out += [(start + k, argv) for argv in _ppotune_argvs(cmd)]
            block = None
            continue
        block.append(line)
    return out


def _ppotune_argvs(line: str) -> list[list[str]]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, "#"
    tokens, segments = list(lex), [[]]
    for t in tokens:
        if t in _OPERATORS:
            segments.append([])
        else:
            segments[-1].append(t)
    out = []
    for seg in segments:
        while seg and _ENV.match(seg[0]):
            seg = seg[1:]
        if seg and seg[0] == "ppotune":
            out.append(seg[1:])
    return out


def _parse_error(argv: list[str]) -> str | None:
    from tuner.cli import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            if e.code not in (0, None):  # --help exits 0
                return err.getvalue().strip() or f"exit {e.code}"
    return None


def test_the_command_reader_joins_splits_and_skips():
    text = "```bash\nA=1 ppotune x --y 2 && pip install z  # ppotune q\nppotune a \\\n  --b c | tee d\n```\n"
    assert bash_commands(text) == [(2, ["x", "--y", "2"]), (3, ["a", "--b", "c"])]


def test_every_ppotune_command_in_the_docs_parses():
    found, bad = 0, []
    for page in PAGES:
        if not page.is_file():
            continue
        for line, argv in bash_commands(page.read_text()):
            found += 1
            err = _parse_error(argv)
            if err:
                bad.append(f"{page.relative_to(REPO)}:{line}: ppotune {shlex.join(argv)}\n    {err}")
    assert found >= 20, f"only {found} ppotune commands found in the docs' bash blocks"
    assert not bad, "\n".join(bad)


def test_a_command_with_an_unknown_flag_fails():
    assert _parse_error(["search", "c.yaml", "--space", "s.yaml", "--trials", "3", "--no-such-flag"])
    assert _parse_error(["report", "--storage", "x.db"]) is None


def test_cli_md_options_are_the_parsers():
    """docs/cli.md's generated part is what scripts/gen_cli_docs.py writes from the parsers now."""
    spec = importlib.util.spec_from_file_location("gen_cli_docs", REPO / "scripts" / "gen_cli_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.CLI_MD.read_text()
    assert gen.updated(text) == text, "docs/cli.md is out of date: run python scripts/gen_cli_docs.py"


def test_architecture_layers_are_the_contracts():
    """docs/architecture.md's layers and "may import" column are what pyproject.toml's import contracts say now."""
    spec = importlib.util.spec_from_file_location("gen_layers_doc", REPO / "scripts" / "gen_layers_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.ARCHITECTURE_MD.read_text()
    assert gen.updated(text) == text, "docs/architecture.md is out of date: run python scripts/gen_layers_doc.py"


# --------------------------------------------------------------------------- links
_LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def _links(page: Path) -> set[Path]:
    return {target for target, _ in _targets(page)}


def _targets(page: Path) -> set[tuple[Path, str]]:
    """(file, anchor) of every relative link in the page (a bare ``#anchor`` is the page itself)."""
    return {
        ((page.parent / target).resolve() if target else page, anchor)
        for target, anchor in _LINK.findall(page.read_text())
        if "://" not in target and not target.startswith("mailto:")
    }


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        if not page.is_file():
            continue
        for target, anchor in _targets(page):
            shown = f"{page.relative_to(REPO)} -> {target.relative_to(REPO) if target.is_relative_to(REPO) else target}"
            if not target.exists():
                broken.append(shown)
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{shown}#{anchor}")
    assert not broken, broken


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.is_file():
            continue
        seen.add(page)
        todo += _links(page)
    wanted = {
        *REPO.glob("docs/*.md"),
        REPO / "benchmarks" / "README.md",
        REPO / "CHANGELOG.md",
        REPO / "CONTRIBUTING.md",
    }
    assert sorted(p.relative_to(REPO) for p in wanted - seen) == []
