"""Micro-batching: fixed sizes, or dynamic batches under a per-GPU token budget; packing.

Which sequences form a token-budget micro-batch is verl 0.9.1's packing (:mod:`trainer.packing`, torch-free,
re-exported here): every FSDP rank must run the same number of forward/backward passes, so the ranks agree on
the count through :func:`all_ranks_max`, the one collective of this module; the rest are pure functions over
lengths and index lists.

A pass reads its batch's masks to the host ONCE (:func:`host_masks`, the pass's one device-to-host copy) and
builds every micro-batch's packing indices there (:func:`build_layouts`, numpy: no kernel, no sync), moved to
the device in one copy per pass: a micro-batch's forward and backward then never wait for the host (verl's
dp actor builds its packing indices once per batch too). :func:`pack`, :func:`response_positions` and
:func:`unpack_response` are the same indexing done on the device, with a sync each (boolean masks): the
reference the layouts are tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from trainer.packing import AllMax, dynamic_micro_batches, token_budget_micro_batches

__all__ = [
    "rank_rows",
    "mini_batch_group",
    "pad_packed",
    "pad_tail",
    "fixed_micro_batches",
    "dynamic_micro_batches",
    "token_budget_micro_batches",
    "all_ranks_max",
    "pack",
    "unpack_response",
    "HostMasks",
    "host_masks",
    "MicroBatchLayout",
    "build_layouts",
    "scatter_rows",
]


def fixed_micro_batches(n: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``micro_batch_size`` indices (the last may be shorter)."""
    return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]


def rank_rows(num_rows: int, mini_batch_rows: int, world_size: int, rank: int) -> list[int]:
    """The global rows a rank holds: each global mini-batch is split evenly across ranks.

    So the k-th optimizer step sees the same sequences whatever the world size, which is what
    makes an update independent of the number of GPUs (a per-GPU knob).
    """
    per = mini_batch_rows // world_size
    assert per * world_size == mini_batch_rows and num_rows % mini_batch_rows == 0
    return [m + rank * per + i for m in range(0, num_rows, mini_batch_rows) for i in range(per)]


def mini_batch_group(*mini_batch_rows: int) -> int:
    """The block :func:`rank_rows` splits across ranks when several updates slice the same batch.

    The actor's and the critic's mini-batches (in rows) can differ; splitting blocks of their gcd
    keeps every global mini-batch of either one a whole number of blocks, so each rank's local
    mini-batches of ``size / world`` rows are exactly its parts of the global ones, for both.
    """
    return math.gcd(*mini_batch_rows)


def all_ranks_max(device: torch.device) -> Optional[AllMax]:
    """The collective :func:`trainer.packing.dynamic_micro_batches` agrees through: an element-wise MAX over the
    ranks (one all-reduce and one read back per call); None on one rank (nothing to agree)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None

    def all_max(values: list[int]) -> list[int]:
        agreed = torch.tensor(values, dtype=torch.long, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return agreed.tolist()

    return all_max


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """Remove padding: (B, L) -> (1, T) with the valid tokens of each row back to back.

    Position ids restart at 0 for each sequence, which is how transformers builds a
    block-diagonal causal mask for packed rows (no attention across sequences).
    Returns packed ids, packed position ids and the flat indices of the valid tokens.
    """
    flat_idx = attention_mask.reshape(-1).nonzero(as_tuple=True)[0]
    ids = input_ids.reshape(-1)[flat_idx].unsqueeze(0)
    pos = position_ids.reshape(-1)[flat_idx].unsqueeze(0)
    return ids, pos, flat_idx


def pad_packed(ids: torch.Tensor, pos: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``pad_to_length``: a packed (1, T) row padded at its tail to a multiple of ``multiple``."""
    return pad_tail(ids, pos, -ids.shape[1] % multiple)


def pad_tail(ids: torch.Tensor, pos: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed (1, T) row with ``extra`` tokens more at its tail.

    The padding is one extra sequence (positions restart at 0), so no real token attends to it; its
    outputs are never read, so its token ids do not matter (0).
    """
    if extra == 0:
        return ids, pos
    tail = torch.arange(extra, dtype=pos.dtype, device=pos.device).unsqueeze(0)
    return torch.cat([ids, torch.zeros_like(tail, dtype=ids.dtype)], dim=1), torch.cat([pos, tail], dim=1)


def response_positions(attention_mask: torch.Tensor, response_mask: torch.Tensor, prompt_width: int):
    """For packed rows: the packed index that PREDICTS each valid response token, in row-major order.

    (B, P+R), (B, R) -> (N,) indices into the packed sequence, and the (B, R) boolean mask they fill.
    The token at padded column P+j is predicted by the logits one position earlier.
    """
    valid = attention_mask.bool()
    packed_index = (
        torch.cumsum(valid.reshape(-1).long(), 0).reshape(valid.shape) - 1
    )  # (B, L) packed position of each valid token
    resp = response_mask.bool()
    predictor = packed_index[:, prompt_width - 1 : prompt_width - 1 + resp.shape[1]]
    return predictor[resp], resp


def unpack_response(values: torch.Tensor, resp_mask: torch.Tensor) -> torch.Tensor:
    """(N, ...) values of the valid response tokens -> (B, R, ...) zero-padded."""
    out = values.new_zeros(resp_mask.shape + values.shape[1:])
    out[resp_mask] = values
    return out


# --------------------------------------------------------------------------- layouts built on the host
@dataclass(frozen=True)
class HostMasks:
    """A batch's attention mask (B, P+R) and response mask (B, R) as host booleans, and the prompt width."""

    attention: np.ndarray
    response: np.ndarray
    prompt_width: int

    def lengths(self, rows: list[int]) -> list[int]:
        """Valid tokens of each of ``rows`` (what a token budget packs)."""
        return self.attention[rows].sum(-1).tolist()


def host_masks(batch: dict) -> HostMasks:
    """The batch's masks on the host: one device-to-host copy (on a GPU, the pass's one sync)."""
    attn, resp = batch["attention_mask"], batch["response_mask"]
    both = torch.cat([attn, resp], dim=1).bool().cpu().numpy()
    width = attn.shape[1]
    return HostMasks(both[:, :width], both[:, width:], width - resp.shape[1])


@dataclass(frozen=True)
class MicroBatchLayout:
    """One micro-batch's indices, built on the host (:func:`build_layouts`), on the device.

    ``rows`` (b,): the batch rows it holds (``[row]`` with ``empty`` for an agreed-on extra micro-batch of a
    rank with no rows left: it runs with weight 0 so FSDP's collectives line up across ranks).
    Packed (``use_remove_padding``): ``token_index`` (T,) the flat index into the (b, P+R) rows of every valid
    token, row-major; ``seq_lens`` the valid tokens of each sequence (host ints; the tail padding of
    ``pad_to_length`` one more sequence) and ``cu_seq_lens`` (num_seqs + 1,) int32 their running sums;
    ``predictor`` (N,) the packed index whose logits predict each valid response token; ``response_index`` (N,)
    the flat index into (b, R) of each valid response token, row-major; ``pad`` the tail padding's tokens;
    ``span`` (start, stop) when the rows are consecutive (a micro-batch is then a view of the batch, no gather).
    """

    rows: torch.Tensor
    empty: bool
    token_index: torch.Tensor
    seq_lens: tuple[int, ...]
    cu_seq_lens: torch.Tensor
    predictor: torch.Tensor
    response_index: torch.Tensor
    pad: int
    span: Optional[tuple[int, int]] = None


def _layout_arrays(masks: HostMasks, rows: list[int], pad_to_multiple: Optional[int]):
    """-> (int64 arrays [rows, token_index, predictor, response_index], cu_seq_lens, seq_lens, pad)."""
    attn, resp = masks.attention[rows], masks.response[rows]
    flat = np.flatnonzero(attn)
    pad = (-len(flat) % pad_to_multiple) if pad_to_multiple else 0
    seq_lens = tuple(int(n) for n in attn.sum(-1) if n > 0) + ((pad,) if pad else ())
    cu = np.concatenate([[0], np.cumsum(seq_lens, dtype=np.int64)])
    packed_index = (np.cumsum(attn.reshape(-1)) - 1).reshape(attn.shape)
    P, R = masks.prompt_width, resp.shape[1]
    predictor = packed_index[:, P - 1 : P - 1 + R][resp]  # the logits one position before each response token
    return [np.asarray(rows, dtype=np.int64), flat, predictor, np.flatnonzero(resp)], cu, seq_lens, pad


def build_layouts(
    masks: Optional[HostMasks], groups: list[list[int]], *, pad_to_multiple: Optional[int], device: torch.device
) -> list[MicroBatchLayout]:
    """Every micro-batch's :class:`MicroBatchLayout` (``groups``: row lists; ``[]`` an empty micro-batch, run on
    row 0), from host masks: numpy on the host, then one int64 and one int32 copy to ``device`` for them all.
    Without ``masks`` (padded rows) only the rows are filled in."""
    longs, ints, meta = [], [], []
    none = np.zeros(0, dtype=np.int64)
    for group in groups:
        rows = group or [0]
        if masks is None:
            arrays, cu, seq_lens, pad = [np.asarray(rows, dtype=np.int64), none, none, none], none, (), 0
        else:
            arrays, cu, seq_lens, pad = _layout_arrays(masks, rows, pad_to_multiple)
        longs += arrays
        ints.append(cu)
        meta.append((not group, seq_lens, pad))
    flat_longs = _to_device(np.concatenate(longs), torch.int64, device).split([len(a) for a in longs])
    flat_ints = _to_device(np.concatenate(ints), torch.int32, device).split([len(a) for a in ints])
    return [
        MicroBatchLayout(
            rows=flat_longs[4 * i],
            empty=empty,
            token_index=flat_longs[4 * i + 1],
            seq_lens=seq_lens,
            cu_seq_lens=flat_ints[i],
            predictor=flat_longs[4 * i + 2],
            response_index=flat_longs[4 * i + 3],
            pad=pad,
            span=_span(group),
        )
        for i, ((empty, seq_lens, pad), group) in enumerate(zip(meta, groups))
    ]


def _span(rows: list[int]) -> Optional[tuple[int, int]]:
    """(start, stop) of consecutive rows, else None."""
    if rows and rows == list(range(rows[0], rows[-1] + 1)):
        return rows[0], rows[-1] + 1
    return None


def _to_device(values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host indices to ``device``: on a GPU from pinned memory, asynchronously (no host wait)."""
    host = torch.from_numpy(values.astype(np.int64 if dtype == torch.int64 else np.int32, copy=False))
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=device.type == "cuda")


def scatter_rows(values: torch.Tensor, index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(N, ...) values of the valid response tokens -> ``shape`` (b, R) + (...) zero-padded, by a flat index into
    (b, R) (:attr:`MicroBatchLayout.response_index`): :func:`unpack_response` without its boolean mask."""
    out = values.new_zeros((shape[0] * shape[1],) + values.shape[1:]).index_copy(0, index, values)
    return out.view(shape + values.shape[1:])
