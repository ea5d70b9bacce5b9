"""Micro-batch planning: fixed micro-batches, rank rows, packing and layouts (token budgets: test_packing.py)."""

import pytest
import torch

from trainer.engine.batching import (
    build_layouts,
    fixed_micro_batches,
    host_masks,
    pack,
    pad_packed,
    pad_tail,
    rank_rows,
    response_positions,
    scatter_rows,
    unpack_response,
)


def test_fixed():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]


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


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pad_to", [None, 8])
def test_host_layouts_index_what_the_device_reference_indexes(seed, pad_to):
    """build_layouts (numpy on the host, one copy to the device) packs, predicts and unpacks exactly as the boolean
    masks of pack/response_positions/unpack_response do on the device, for every micro-batch of a batch."""
    g = torch.Generator().manual_seed(seed)
    B, P, R = 7, 6, 5
    plen = torch.randint(0, P + 1, (B,), generator=g)
    rlen = torch.randint(0, R + 1, (B,), generator=g)
    attn = torch.cat([torch.arange(P)[None] >= P - plen[:, None], torch.arange(R)[None] < rlen[:, None]], 1).long()
    ids = torch.randint(5, 50, (B, P + R), generator=g) * attn
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    batch = {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "response_mask": attn[:, P:]}
    groups = [[0, 1, 2], [3], [4, 5, 6], []]
    layouts = build_layouts(host_masks(batch), groups, pad_to_multiple=pad_to, device=torch.device("cpu"))
    for group, lay in zip(groups, layouts):
        rows = group or [0]
        assert lay.rows.tolist() == rows and lay.empty == (not group)
        a, r = attn[rows], attn[rows][:, P:]
        ref_ids, ref_pos, _ = pack(ids[rows], a, pos[rows])
        if pad_to:
            ref_ids, ref_pos = pad_packed(ref_ids, ref_pos, pad_to)
        got_ids = pad_tail(ids[rows].reshape(-1)[lay.token_index].unsqueeze(0), ref_pos[:, :0], lay.pad)[0]
        assert got_ids.tolist() == ref_ids.tolist()
        assert sum(lay.seq_lens) == ref_ids.shape[1] and 0 not in lay.seq_lens
        assert lay.cu_seq_lens.tolist() == [0, *torch.tensor(lay.seq_lens).cumsum(0).tolist()]
        assert lay.cu_seq_lens.dtype == torch.int32
        predictor, mask = response_positions(a, r, P)
        assert lay.predictor.tolist() == predictor.tolist()
        values = torch.randn(int(mask.sum()), generator=g)
        assert torch.equal(scatter_rows(values, lay.response_index, tuple(r.shape)), unpack_response(values, mask))


def test_layouts_without_masks_hold_the_rows_only():
    (lay,) = build_layouts(None, [[2, 5]], pad_to_multiple=None, device=torch.device("cpu"))
    assert lay.rows.tolist() == [2, 5] and lay.token_index.numel() == 0 and lay.seq_lens == ()
