"""Run inside verl's venv (tests/trainer/test_packing_verl.py): verl 0.9.1's own ``rearrange_micro_batches`` over
the length sets of a JSON file, as its FSDP engine calls it; prints one JSON line of what it returned.

``{"one_rank": [case, ...], "ranks": R, "many_ranks": [case, ...]}``, a case ``{"lengths": [[...] per rank],
"budget": B, "min_num_micro_batch": m or null}``. One-rank cases run here, without a process group; many-rank
cases first, on R processes forked from this one (gloo, verl's CPU platform from ppotune's shim), every case on every
rank, ``dp_group`` the world as verl's FSDP engine passes it. Each answer: per rank, verl's micro-batch index
lists, or ``{"error": <exception class>}``."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils.seqlen_balancing import rearrange_micro_batches


def _batch(lengths: list[int], width: int) -> TensorDict:
    """A padded batch whose row i holds ``lengths[i]`` valid tokens (verl reads attention_mask's row sums)."""
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=[len(lengths)])


def _verl(lengths: list[int], width: int, case: dict, group) -> object:
    try:
        _, idx = rearrange_micro_batches(
            _batch(lengths, width),
            max_token_len=case["budget"],
            dp_group=group,
            same_micro_num_in_dp=True,
            min_num_micro_batch=case["min_num_micro_batch"],
        )
    except (AssertionError, ValueError) as e:
        return {"error": type(e).__name__}
    return [[int(i) for i in part] for part in idx]


def _width(case: dict) -> int:
    """The padded width every rank's batch has: the longest sequence of the case (verl asserts budget >= it)."""
    return max(max(ls, default=1) for ls in case["lengths"])


def _rank(rank: int, world: int, store: str, cases: list[dict], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    got = [_verl(case["lengths"][rank], _width(case), case, dist.group.WORLD) for case in cases]
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(got, f)


def main(path: str) -> None:
    spec = json.load(open(path))
    world, cases = spec["ranks"], spec["many_ranks"]
    many: list[list] = []
    if cases:
        with tempfile.TemporaryDirectory() as d:
            ctx = mp.get_context("fork")  # verl already imported: the ranks start in a blink
            outs = [os.path.join(d, f"rank{r}.json") for r in range(world)]
            procs = [
                ctx.Process(target=_rank, args=(r, world, os.path.join(d, "store"), cases, outs[r]))
                for r in range(world)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join(300)
                assert p.exitcode == 0, f"a rank ended {p.exitcode}"
            per_rank = [json.load(open(o)) for o in outs]
        many = [[per_rank[r][c] for r in range(world)] for c in range(len(cases))]
    # after the fork: a child forked from a process whose OpenMP pool already ran can hang in its first kernel
    one = [[_verl(case["lengths"][0], _width(case), case, None)] for case in spec["one_rank"]]
    print(json.dumps({"one_rank": one, "many_ranks": many}))


if __name__ == "__main__":
    main(sys.argv[1])
