"""A cap below the models' states (tuner/memory_model/floor.py) is refused by every command that launches ranks, before
anything is launched or written: exit 2 and the same one line on every run, idle or under load. Before the check,
``fit --memory-limit-gb 0.001`` ran for minutes, crashed or gave up depending on the run, and ``search`` reported its
crashed trials as done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import TINY_BASE

BASE = TINY_BASE.relative_to(TINY_BASE.parents[1]).as_posix()  # configs/tiny_cpu.yaml, as a user types it
SPACE = "search_spaces/tiny_cpu.yaml"
LINE = (
    "{cap} is below what a rank holds from its first step on: 0.0012 GiB (the actor's, the reference's and the "
    f"critic's fp32 states sharded over 2 ranks; {BASE})"
)
COMMANDS = {
    "train": ["train", BASE, "--nproc", "2", "--memory-limit-gb", "0.001"],
    "probe": ["probe", BASE, "--nproc", "2", "--memory-limit-gb", "0.001"],
    "fit": ["fit", BASE, "--nproc", "2", "--memory-limit-gb", "0.001"],
    "search": ["search", BASE, "--space", SPACE, "--trials", "3", "--nproc", "2", "--memory-limit-gb", "0.001"],
}


def _refused(cli, command: str, out: Path) -> str:
    r = cli(*COMMANDS[command], "--out", out, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout == ""
    if command == "train":  # the one file a refused run writes: the result a trial's tuner reads (``config:``)
        assert [p.name for p in out.iterdir()] == ["result.json"]
        assert (
            json.loads((out / "result.json").read_text())["error"] == f"config: {r.stderr.split('error: ', 1)[1]}"[:-1]
        )
    else:
        assert not out.exists()  # nothing written: no study, no trial directory, no probe directory
    return r.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_cap_below_the_floor_is_refused_the_same_way_every_run(cli, tmp_path, command):
    said = {_refused(cli, command, tmp_path / f"out{i}") for i in range(3)}
    assert said == {f"ppotune {command}: error: {LINE.format(cap='--memory-limit-gb 0.001')}\n"}


def test_the_same_answer_under_load(cli, tmp_path, cpu_hog):
    for command in sorted(COMMANDS):
        said = _refused(cli, command, tmp_path / command)
        assert said == f"ppotune {command}: error: {LINE.format(cap='--memory-limit-gb 0.001')}\n"


def test_the_config_key_is_named_when_the_config_sets_the_cap(cli, tmp_path):
    r = cli("train", BASE, "-o", "ppotune.memory_limit_gb=0.001", "--out", tmp_path / "out", timeout=120)
    assert r.returncode == 2
    assert r.stderr == f"ppotune train: error: {LINE.format(cap='ppotune.memory_limit_gb: 0.001')}\n"


def test_fit_names_the_headroom_that_took_the_cap_below(cli, tmp_path):
    r = cli(*COMMANDS["fit"][:-1], "0.0012", "--memory-headroom", "0.2", "--out", tmp_path / "out", timeout=120)
    assert r.returncode == 2
    cap = "--memory-limit-gb 0.0012 less --memory-headroom 0.2 (0.00096 GiB)"
    assert r.stderr == f"ppotune fit: error: {LINE.format(cap=cap)}\n"


def test_a_cap_just_above_the_floor_passes_the_check(cli, tmp_path):
    """A dry run checks everything a search checks, launches nothing: the floor lets 0.0012 GiB through."""
    r = cli(*COMMANDS["search"][:-1], "0.0012", "--dry-run", "--out", tmp_path / "out", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "below what a rank holds" not in r.stdout + r.stderr
