"""The shared vocabulary (trainer/contracts.py): storage grammar, statuses, the trial record."""

from __future__ import annotations

import json
import os
from pathlib import Path

import optuna
import pytest

from trainer.contracts import (
    MEASUREMENT_FIELDS,
    PHASES,
    ExitCode,
    Status,
    StorageError,
    TrialRecord,
    mask_url,
    oom_kind,
    parse_storage,
    short_knob,
)
from tuner.study.storage import open_storage, resolve_read_spec


# --------------------------------------------------------------------------- storage grammar
def _abs(p: str) -> str:
    return str(Path(p).resolve())


@pytest.mark.parametrize(
    "text,kind,url",
    [
        # no --storage: search's default under --out
        (None, "sqlite", "sqlite:///{cwd}/out/study.db"),
        # explicit SQLite; a relative path is relative to the current directory (as SQLAlchemy reads it)
        ("sqlite:///rel.db", "sqlite", "sqlite:///{cwd}/rel.db"),
        ("sqlite:////abs/x.db", "sqlite", "sqlite:////abs/x.db"),
        ("sqlite:///:memory:", "sqlite", "sqlite:///:memory:"),
        ("x/study.db", "sqlite", "sqlite:///{cwd}/x/study.db"),
        ("x/study.sqlite3", "sqlite", "sqlite:///{cwd}/x/study.sqlite3"),
        # journal files: the journal: prefix, file:// URLs and the .log/.journal suffixes
        ("journal:study.log", "journal", "journal:{cwd}/study.log"),
        ("journal:///abs/j.log", "journal", "journal:/abs/j.log"),
        ("journal:noext", "journal", "journal:{cwd}/noext"),
        ("file:///abs/x.log", "journal", "journal:/abs/x.log"),
        ("file:rel.log", "journal", "journal:{cwd}/rel.log"),
        ("x/study.log", "journal", "journal:{cwd}/x/study.log"),
        ("x/study.journal", "journal", "journal:{cwd}/x/study.journal"),
        # servers
        ("postgresql://u:p@host:5432/db", "rdb", "postgresql://u:p@host:5432/db"),
        ("mysql+pymysql://u@host/db", "rdb", "mysql+pymysql://u@host/db"),
        ("grpc://head-node:13000", "grpc", "grpc://head-node:13000"),
    ],
)
def test_parse_storage_table(tmp_path, monkeypatch, text, kind, url):
    monkeypatch.chdir(tmp_path)
    spec = parse_storage(text, default_dir=Path("out"))
    cwd = str(Path(os.getcwd()).resolve())
    assert spec.kind == kind
    assert spec.url == url.format(cwd=cwd)
    if spec.path is not None:
        assert spec.path.is_absolute() and spec.lock_path == spec.path.with_name(spec.path.name + ".ppotune-lock")
    else:
        assert spec.lock_path is None


@pytest.mark.parametrize(
    "text,match",
    [
        ("study.txt", "not an Optuna URL"),  # a suffix-less or unknown-suffix path is refused, not guessed
        ("noext", "spell it journal:PATH or sqlite:///PATH"),
        ("journal:", "no file after the scheme"),
        ("grpc://host", "grpc://HOST:PORT"),
    ],
)
def test_parse_storage_refuses(tmp_path, monkeypatch, text, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError, match=match):
        parse_storage(text)


def test_a_directory_is_a_search_output_dir(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(StorageError, match="neither study.db nor study.log"):
        parse_storage(str(tmp_path / "run"))
    (tmp_path / "run" / "study.log").write_text("")
    assert parse_storage(str(tmp_path / "run")).kind == "journal"
    optuna.create_study(storage=f"sqlite:///{tmp_path / 'run' / 'study.db'}")
    spec = parse_storage(str(tmp_path / "run"))  # study.db first, as the search writes it by default
    assert spec.kind == "sqlite" and spec == resolve_read_spec(out=tmp_path / "run")


def test_read_only_open_writes_nothing(tmp_path):
    with pytest.raises(StorageError, match="SQLite file not found"):
        open_storage(parse_storage(str(tmp_path / "none.db")), read_only=True)
    with pytest.raises(StorageError, match="journal file not found"):
        open_storage(parse_storage(str(tmp_path / "none.log")), read_only=True)
    assert not (tmp_path / "none.db").exists() and not (tmp_path / "none.log").exists()
    with pytest.raises(StorageError, match="give --storage or --out"):
        resolve_read_spec(storage="x.db", out=tmp_path)


def test_passwords_are_masked():
    spec = parse_storage("postgresql://tuner:s3cret@db:5432/ppotune")
    assert "s3cret" not in spec.display and "s3cret" not in str(spec)
    assert spec.display == "postgresql://tuner:***@db:5432/ppotune"
    assert mask_url("sqlite:////x.db") == "sqlite:////x.db"


def test_unreachable_server_is_one_line_with_the_password_masked():
    spec = parse_storage("postgresql://tuner:s3cret@127.0.0.1:1/none")
    with pytest.raises(StorageError) as e:
        open_storage(spec)
    assert "s3cret" not in str(e.value) and "\n" not in str(e.value) and "127.0.0.1" in str(e.value)


# --------------------------------------------------------------------------- statuses, exit codes, names
def test_status_sets():
    complete = {s for s in Status if s.complete}
    assert complete == {Status.OK, Status.OOM, Status.INFERRED_OOM, Status.PREDICTED_OOM, Status.HANG}
    assert {s for s in Status if s.feasible} == {Status.OK}
    assert {s for s in Status if not s.counted} == {
        Status.INTERRUPTED,
        Status.DUPLICATE,
        Status.OVER_BUDGET,
        Status.INFERRED_OOM,
        Status.PREDICTED_OOM,
    }
    assert {s for s in Status if s.measured} == {Status.OK, Status.OOM, Status.HANG}
    assert not Status.INFERRED_OOM.launched and not Status.DUPLICATE.launched and not Status.INVALID.launched
    assert not Status.PREDICTED_OOM.launched
    assert Status.OK == "ok" and f"{Status.INFERRED_OOM}" == "inferred_oom" and json.dumps(Status.HANG) == '"hang"'
    assert Status.parse("nope") is None and Status.parse(None) is None


def test_oom_kind_tells_host_ram_from_device_memory():
    cuda = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    host = "RuntimeError: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"
    assert oom_kind(cuda, "cuda") == "device" and oom_kind(host, "cuda") == "host"
    assert oom_kind(host, "cpu") == "device"  # on CPU the rank's memory is the capped one
    assert oom_kind(None, "cuda") == "device"


def test_exit_codes_and_names():
    assert (ExitCode.OK, ExitCode.ERROR, ExitCode.USAGE, ExitCode.OOM, ExitCode.INTERRUPTED) == (0, 1, 2, 3, 130)
    assert PHASES[:2] == ("update_weights", "gen") and PHASES[-1] == "update_actor" and len(set(PHASES)) == len(PHASES)
    assert short_knob("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") == "actor.ppo_micro_batch_size_per_gpu"
    assert short_knob("critic.ppo_micro_batch_size_per_gpu") == "critic.ppo_micro_batch_size_per_gpu"


def test_phases_are_the_order_the_step_runs():
    """PHASES is the step's order: every ``meter.phase(...)`` in trainer/engine/step.py, in file order."""
    import re

    text = (Path(__file__).resolve().parents[2] / "trainer" / "engine" / "step.py").read_text()
    assert tuple(re.findall(r'meter\.phase\("(\w+)"\)', text)) == PHASES


# --------------------------------------------------------------------------- the trial record
def test_trial_record_round_trip_and_forward_compatibility():
    rec = TrialRecord(
        status=Status.OOM,
        throughput=None,
        peak_memory_gb=3.5,
        notes=["x"],
        inferred_from=None,
        confirm_of=4,
        timing_s={"gen": 1.0},
    )
    attrs = rec.to_user_attrs()
    assert attrs["status"] == "oom" and type(attrs["status"]) is str
    json.dumps(attrs)  # storable as Optuna user attrs
    back = TrialRecord.from_user_attrs({**attrs, "a_newer_field": 1, "status": "oom"})
    assert back == rec
    assert TrialRecord.from_user_attrs({"status": "from-the-future"}).status is None
    assert set(MEASUREMENT_FIELDS) <= set(attrs)


@pytest.mark.parametrize(
    "attrs,counted",
    [
        ({}, True),  # RUNNING: no status yet
        ({"status": "ok"}, True),
        ({"status": "crash"}, True),
        ({"status": "interrupted"}, False),
        ({"status": "duplicate", "duplicate_of": 1}, False),
        ({"status": "ok", "confirm_of": 2}, False),
        ({"status": "inferred_oom", "inferred_from": 1, "duration_s": 0.0}, False),
        ({"status": "invalid", "duration_s": 0.0}, False),  # refused before launch
        ({"status": "invalid", "duration_s": 4.2, "returncode": 2}, True),  # launched, exit 2
    ],
)
def test_trial_record_counted(attrs, counted):
    assert TrialRecord.from_user_attrs(attrs).counted is counted
