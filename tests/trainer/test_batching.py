"""Micro-batch planning: token budgets are strict caps, balanced, count forced across ranks."""

import random

import pytest
import torch

from trainer.engine.batching import (
    fixed_micro_batches,
    min_num_micro_batches,
    pack,
    rank_rows,
    response_positions,
    token_budget_micro_batches,
)


def test_fixed():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("seed", range(20))
def test_token_budget_is_a_strict_cap_and_covers_everything(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 96) for _ in range(rng.randint(1, 40))]
    cap = rng.randint(96, 400)
    k = min_num_micro_batches(lengths, cap)
    for forced in (None, k, k + 3):
        bins = token_budget_micro_batches(lengths, cap, forced)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= cap for b in bins)
        assert len(bins) == (k if forced is None else forced)


def test_balanced():
    bins = token_budget_micro_batches([50, 50, 50, 50, 10, 10, 10, 10], 200, 2)
    loads = [sum([50, 50, 50, 50, 10, 10, 10, 10][i] for i in b) for b in bins]
    assert loads == [120, 120]


def test_too_long_a_sequence_is_refused():
    with pytest.raises(ValueError, match="exceeds the token budget"):
        min_num_micro_batches([10, 120], 100)


def test_rank_rows_split_each_mini_batch():
    assert rank_rows(8, 4, 2, 0) == [0, 1, 4, 5]
    assert rank_rows(8, 4, 2, 1) == [2, 3, 6, 7]
    assert rank_rows(8, 4, 1, 0) == list(range(8))


def test_pack_and_response_positions():
    # two rows, prompt width 3 (left-padded), response width 2 (right-padded)
    ids = torch.tensor([[0, 5, 6, 7, 8], [9, 9, 4, 3, 0]])
    attn = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    resp_mask = torch.tensor([[1, 1], [1, 0]])
    packed, packed_pos, _ = pack(ids, attn, pos)
    assert packed.tolist() == [[5, 6, 7, 8, 9, 9, 4, 3]]
    assert packed_pos.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    idx, mask = response_positions(attn, resp_mask, 3)
    # row 0: tokens 7, 8 are predicted by packed positions 1 (token 6) and 2 (token 7);
    # row 1: token 3 by position 6 (token 4)
    assert idx.tolist() == [1, 2, 6]
    assert mask.tolist() == [[True, True], [True, False]]
