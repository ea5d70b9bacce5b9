"""trainer.packing against verl 0.9.1's own ``rearrange_micro_batches`` (run in verl's venv, one subprocess for
every case): the same micro-batches, with the same sequences, in the same order, for random length sets (skewed,
uniform, all equal, near the budget) and budgets, on one rank and on three ranks that agree on the count, with
``min_num_micro_batch``; the same refusals. Without the verl venv the test is skipped and says why."""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from support import REPO
from tests.trainer.test_packing import on_ranks

VERL_PY = REPO / ".venv-verl" / "bin" / "python"
WORKER = REPO / "tests" / "trainer" / "verl_packing_worker.py"
RANKS = 3


def _lengths(rng: random.Random, n: int, longest: int) -> list[int]:
    shape = rng.choice(("skewed", "uniform", "equal", "two", "near"))
    if shape == "skewed":  # Pareto, as RL response lengths are
        return [min(longest, int(8 * rng.paretovariate(1.1))) for _ in range(n)]
    if shape == "uniform":
        return [rng.randint(1, longest) for _ in range(n)]
    if shape == "equal":  # every workload ties: Karmarkar-Karp's tie-breaking decides
        return [longest] * n
    if shape == "two":
        a, b = rng.randint(1, longest), rng.randint(1, longest)
        return [rng.choice((a, b)) for _ in range(n)]
    return [rng.randint(longest * 3 // 4, longest) for _ in range(n)]  # near the budget: step 3's repartition


def _case(rng: random.Random, ranks: int) -> dict:
    longest = rng.choice((16, 96, 512, 4096))
    rows = [rng.randint(1, 48)] * ranks  # every rank holds as many rows (a mini-batch split evenly), mostly
    if rng.random() < 0.2:
        rows = [rng.randint(1, 48) for _ in range(ranks)]
    lengths = [_lengths(rng, n, longest) for n in rows]
    top = max(max(ls) for ls in lengths)
    budget = rng.choice((top, top + rng.randint(0, top), top * rng.randint(2, 8), top * rng.randint(8, 40)))
    if rng.random() < 0.03:
        budget = top - 1  # refused by both
    floor = rng.choice((None,) * 6 + (rng.randint(1, 8),))
    return {"lengths": lengths, "budget": budget, "min_num_micro_batch": floor}


def _cases(seed: int, count: int, ranks: int) -> list[dict]:
    rng = random.Random(seed)
    cases = [_case(rng, ranks) for _ in range(count)]
    # verl PR #7553's own example: ceil(56 / 8) = 7 micro-batches cannot hold 8 sequences of 7 under 8 tokens
    return cases + [{"lengths": [[7] * 8] * ranks, "budget": 8, "min_num_micro_batch": None}]


def _ours_on_ranks(case: dict) -> list:
    return on_ranks(case["lengths"], case["budget"], case["min_num_micro_batch"])


def _same(ours: list, theirs: list) -> bool:
    refused = [isinstance(x, dict) for x in ours], [isinstance(x, dict) for x in theirs]
    return refused[0] == refused[1] and (any(refused[0]) or ours == theirs)


def test_our_packing_is_verls(tmp_path):
    if not VERL_PY.exists():
        reason = f"verl venv not installed ({VERL_PY} is missing: scripts/install_test_deps.sh)"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    one = _cases(seed=7553, count=300, ranks=1)
    many = _cases(seed=91, count=40, ranks=RANKS)
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps({"one_rank": one, "ranks": RANKS, "many_ranks": many}))
    env = {"PYTHONPATH": str(REPO), "VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "trainer.verl_engine.cpu"}
    proc = subprocess.run(
        [str(VERL_PY), str(WORKER), str(spec)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = {name: [_ours_on_ranks(c) for c in cases] for name, cases in (("one_rank", one), ("many_ranks", many))}
    for name, cases in (("one_rank", one), ("many_ranks", many)):
        assert len(theirs[name]) == len(cases)
        differ = [(c, t) for c, o, t in zip(cases, ours[name], theirs[name]) if not _same(o, t)]
        assert not differ, f"{name}: {len(differ)} of {len(cases)} differ, first {differ[0][0]}: verl {differ[0][1]}"
    # the cases reached every branch: refusals, several micro-batches, the repartition of step 3 on one rank
    # and on three (the count rises on every rank when one rank's part is over the budget)
    flat = [t for ts in theirs["one_rank"] + theirs["many_ranks"] for t in ts]
    assert any(isinstance(t, dict) for t in flat)
    assert sum(isinstance(t, list) and len(t) > 1 for t in flat) > 100
    for name, cases in (("one_rank", one), ("many_ranks", many)):
        assert sum(_repartitioned(c, o) for c, o in zip(cases, ours[name])) >= 5, name


def _repartitioned(case: dict, got: list) -> bool:
    """Did step 3 add micro-batches (more than step 1's agreed count)?"""
    if isinstance(got[0], dict) or case["min_num_micro_batch"] is not None:
        return False
    first = max(min(len(ls), -(-sum(ls) // case["budget"])) for ls in case["lengths"])
    return len(got[0]) > first
