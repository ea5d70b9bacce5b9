"""``ppotune fit``'s and ``ppotune search --from-fit``'s command lines: bad input is one line and exit 2, before
anything is written; a search from a fit is bounded by it (``--dry-run``: nothing launched)."""

from __future__ import annotations

import json

import pytest

from support import REPO
from trainer.contracts import ExitCode

GRID = REPO / "benchmarks" / "data" / "grid_base.yaml"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["{missing}"], "{missing}: config: file not found"),
        (["{grid}", "-o", "actor_rollout_ref.actor.not_a_knob=1"], "actor_rollout_ref.actor.not_a_knob: unknown key"),
        (["{grid}", "--memory-headroom", "1.5"], "--memory-headroom must be in [0, 1), got 1.5"),
        (["{grid}", "--memory-limit-gb", "0"], "--memory-limit-gb must be > 0"),
        (["{grid}", "--nproc", "3"], "the trial world cannot exceed the target's"),
        (["{grid}", "--engine", "verl", "-o", "data.max_prompt_length=8"], "-o: --engine verl takes its settings"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cli, tmp_path, args, needle):
    fill = {"missing": tmp_path / "nope.yaml", "grid": GRID}
    r = cli("fit", *[a.format(**fill) for a in args], "--out", tmp_path / "out", timeout=120)
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and needle.format(**fill) in r.stderr, r.stderr
    assert r.stderr.startswith("ppotune fit: error: ")
    assert not (tmp_path / "out").exists()  # nothing launched, nothing written


def test_a_search_from_a_fit_is_bounded_by_it(cli, tmp_path):
    (tmp_path / "fit.json").write_text(
        json.dumps({"values": {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16}})
    )
    space = REPO / "benchmarks" / "data" / "grid_space.yaml"
    args = ("search", GRID, "--space", space, "--trials", 5, "--dry-run", "--out", tmp_path / "s")
    plain, bounded = cli(*args, timeout=120), cli(*args, "--from-fit", tmp_path, timeout=120)
    assert plain.returncode == bounded.returncode == 0, bounded.stderr
    assert "104 configs after conditions" in plain.stdout and "96 configs after conditions" in bounded.stdout
    r = cli(*args, "--from-fit", tmp_path / "nowhere", timeout=120)
    assert r.returncode == ExitCode.USAGE and "nowhere/fit.json: --from-fit:" in r.stderr
