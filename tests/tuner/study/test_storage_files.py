"""A storage that is not a study, or cannot be opened: one line saying so, and nothing left behind.

Real files (random bytes, text, a damaged SQLite file, another program's SQLite database, a text file as a journal)
and the real commands (``ppotune search``, ``report``, ``export``): a file that is not a study is never touched
(Optuna would have written its tables into someone else's database), and a search whose storage cannot be opened
leaves no output directory, lock file or warm job behind."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import optuna
import pytest

from support import TINY_BASE
from trainer.contracts import StorageError, parse_storage
from tuner.study.storage import open_storage


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _not_studies(d: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the refusal says): files that are not studies."""
    (d / "random.db").write_bytes(bytes(range(256)) * 20)
    (d / "text.db").write_text("hello, not a database\n")
    conn = sqlite3.connect(d / "foreign.db")
    conn.execute("CREATE TABLE invoices (id INTEGER, total REAL)")
    conn.commit()
    conn.close()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    optuna.create_study(storage=f"sqlite:///{d / 'real.db'}", study_name="s")
    data = (d / "real.db").read_bytes()
    (d / "damaged.db").write_bytes(data[:100] + b"\x00" * 200 + data[300 : len(data) // 2])
    (d / "notes.log").write_text("these are my notes, not a journal\n")
    return {
        "random": (d / "random.db", "not a study database (not an SQLite file)"),
        "text": (d / "text.db", "not a study database (not an SQLite file)"),
        "foreign": (
            d / "foreign.db",
            "not a study database (an SQLite file without Optuna's tables; it holds invoices)",
        ),
        "damaged": (d / "damaged.db", "not a study database (a damaged SQLite file"),
        "journal": (d / "notes.log", "not a study journal"),
    }


@pytest.mark.parametrize("read_only", [False, True], ids=["write", "read"])
@pytest.mark.parametrize("kind", ["random", "text", "foreign", "damaged", "journal"])
def test_a_file_that_is_not_a_study_says_so_and_is_not_touched(tmp_path, kind, read_only):
    path, says = _not_studies(tmp_path)[kind]
    before = _sha(path)
    with pytest.raises(StorageError) as e:
        open_storage(parse_storage(str(path)), read_only=read_only)
    assert str(e.value).startswith(f"{path}: {says}"), str(e.value)
    assert "\n" not in str(e.value) and "StorageInternalError" not in str(e.value)
    assert _sha(path) == before  # never Optuna's tables in someone else's database


def test_a_real_study_and_an_empty_file_still_open(tmp_path):
    _not_studies(tmp_path)
    for path in (tmp_path / "real.db", tmp_path / "empty.db"):
        path.touch()
        storage = open_storage(parse_storage(str(path)))
        assert isinstance(storage.get_all_studies(), list)


def test_the_commands_say_it_in_one_line(tmp_path, cli):
    files = _not_studies(tmp_path)
    for kind in ("random", "foreign", "journal"):
        path, says = files[kind]
        for command in (["report", "--storage", path], ["export", "--storage", path, "--out", tmp_path / "x"]):
            r = cli(*command)
            assert r.returncode == 2, r.stderr
            assert r.stderr.strip().startswith(f"ppotune {command[0]}: error: {path}: {says}"), r.stderr
            assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        assert not (tmp_path / "x").exists()


def test_a_search_on_a_file_that_is_not_a_study_creates_nothing(tmp_path, cli):
    path, says = _not_studies(tmp_path)["foreign"]
    before = _sha(path)
    out = tmp_path / "new" / "out"
    r = cli(*_search(out), "--storage", path, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == f"ppotune search: error: {path}: {says}", r.stderr
    assert not (tmp_path / "new").exists() and _sha(path) == before


def _search(out: Path) -> list:
    return [
        *("search", TINY_BASE, "--space", "search_spaces/tiny_cpu.yaml", "--trials", 1, "--nproc", 1),
        *("--steps", 1, "--warmup", 0, "--out", out),
    ]


def test_a_storage_that_cannot_be_opened_leaves_nothing_behind(tmp_path, cli, no_processes_left):
    """The output dir, its trials/ and jobs/ dirs, the warm job started ahead while the study opens, and the
    directories created on the way: all gone when the database is unreachable."""
    out = tmp_path / "a" / "b" / "out"
    r = cli(*_search(out), "--storage", "postgresql://nobody@127.0.0.1:1/none", timeout=180)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("ppotune search: error: cannot open storage postgresql://nobody@127.0.0.1:1/none:"), line
    assert not (tmp_path / "a").exists(), sorted(p.name for p in tmp_path.rglob("*"))
    assert no_processes_left(str(out)) == []


def test_a_storage_in_a_new_directory_that_cannot_be_created_leaves_nothing(tmp_path, cli):
    """A SQLite path under a plain file: the open fails; the output dir made for it is removed again."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "out"
    r = cli(*_search(out), "--storage", f"sqlite:///{tmp_path / 'afile' / 'study.db'}", timeout=180)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and (tmp_path / "afile").read_text() == "x"


def test_leftovers_removes_only_what_was_not_there(tmp_path):
    from tuner.study.storage import Leftovers

    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "mine.txt").write_text("mine")
    left = Leftovers(keep, keep / "new.db", tmp_path / "x" / "y" / "z.db", tmp_path / "newdir")
    (keep / "new.db").write_text("db")
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "z.db").write_text("z")
    (tmp_path / "newdir" / "sub").mkdir(parents=True)
    left.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"] and (keep / "mine.txt").read_text() == "mine"
    assert not (keep / "new.db").exists()
