"""trainer.packing (verl 0.9.1's dynamic-bsz packing, torch-free) by hand: Karmarkar-Karp's parts, the strict
budget and its repartition, the order micro-batches run in, the ranks' agreement, the refusals. Against verl's own
function: tests/trainer/test_packing_verl.py."""

from __future__ import annotations

import random
import threading

import pytest

from trainer.packing import dynamic_micro_batches, karmarkar_karp, pipeline_order, token_budget_micro_batches, workload


def on_ranks(lengths: list[list[int]], budget: int, floor=None) -> list:
    """The packing on every rank at once: a thread per rank, agreeing through a real MAX over them; a rank's
    refusal as ``{"error": "refused"}``."""
    world = len(lengths)
    slots: list = [None] * world
    barrier = threading.Barrier(world, timeout=30)
    out: list = [None] * world

    def rank(r: int) -> None:
        def all_max(values: list[int]) -> list[int]:
            slots[r] = values
            barrier.wait()
            agreed = [max(column) for column in zip(*slots)]
            barrier.wait()
            return agreed

        try:
            out[r] = dynamic_micro_batches(
                [lengths[r]], budget, min_num_micro_batch=floor, all_max=all_max if world > 1 else None
            )[0]
        except ValueError:
            out[r] = {"error": "refused"}

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_karmarkar_karp_by_hand():
    # pairs: (8|7) and (6|5) spread 1 each; 4 meets (8|7) first (the larger largest part): {4,7} | {8}; then
    # with (6|5): {4,7,5} = 16 | {8,6} = 14 (longest-first greedy would give 17 | 13)
    assert karmarkar_karp([8, 7, 6, 5, 4], 2) == [[4, 1, 3], [0, 2]]


def test_pipeline_order_puts_the_lightest_at_both_ends():
    parts = [[0], [1], [2], [3], [4]]
    assert pipeline_order(parts, [5, 4, 3, 2, 1]) == [[4], [2], [0], [1], [3]]


def test_workload_is_verls():
    assert workload(1000) == 24576 * 1000 + 1000**2


@pytest.mark.parametrize("seed", range(10))
def test_the_budget_is_a_strict_cap_and_every_sequence_runs_once(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 96) for _ in range(rng.randint(1, 40))]
    budget = rng.randint(96, 400)
    bins = token_budget_micro_batches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b == sorted(b) and sum(lengths[i] for i in b) <= budget for b in bins)
    assert len(bins) >= -(-sum(lengths) // budget)
    floor = len(bins) + 2
    if floor <= len(lengths):
        assert len(token_budget_micro_batches(lengths, budget, min_num_micro_batch=floor)) == floor


def test_an_overfull_part_adds_a_micro_batch():
    # verl PR #7553's example: ceil(56 / 8) = 7 micro-batches cannot hold 8 sequences of 7 tokens
    assert sorted(map(len, token_budget_micro_batches([7] * 8, 8))) == [1] * 8


def test_the_ranks_agree_on_the_count():
    # alone, rank 0 packs into 1 micro-batch and rank 1 into 3 (ceil(3 * 60 / 100) = 2 parts cannot hold 3 x 60)
    assert len(token_budget_micro_batches([10, 10, 10], 100)) == 1
    assert len(token_budget_micro_batches([60, 60, 60], 100)) == 3
    together = on_ranks([[10, 10, 10], [60, 60, 60]], 100)
    assert [len(b) for b in together] == [3, 3]


def test_refusals():
    with pytest.raises(ValueError, match="exceeds the token budget"):
        token_budget_micro_batches([10, 120], 100)
    with pytest.raises(ValueError, match="holds only 2 sequences"):
        token_budget_micro_batches([10, 10], 100, min_num_micro_batch=3)
    # a rank with fewer rows than the count the others need: every rank refuses (none waits for the rest)
    assert on_ranks([[90, 90, 90], [10]], 100) == [{"error": "refused"}] * 2
    assert dynamic_micro_batches([[]], 100) == [[]]
