"""Dynamic-bsz packing as verl 0.9.1 does it, over plain sequence lengths (no torch).

Which of a rank's sequences form each micro-batch under a per-GPU token budget
(``ppo_max_token_len_per_gpu``, ``log_prob_max_token_len_per_gpu``, ...), and in what order the micro-batches
run: ``verl/utils/seqlen_balancing.py:rearrange_micro_batches`` with the arguments verl 0.9.1's FSDP engine
passes it (``workers/engine/fsdp/transformer_impl.py`` -> ``workers/engine/utils.py:prepare_micro_batches``:
``same_micro_num_in_dp=True``, no ``min_num_micro_batch``, ``use_dynamic_bsz_balance=True``, one sequence per
group). Our engine packs with it (:mod:`trainer.engine.batching`), the tuner's memory model sizes micro-batches
with it (:mod:`tuner.memory_model.workload`); ``tests/trainer/test_packing_verl.py`` checks it against verl's
own function, micro-batch by micro-batch.

For each row set (a rank's rows of one pass, or of one mini-batch of an update):

1. count: ``k = min(rows, ceil(sum(lengths) / budget))``, at least ``min_num_micro_batch``; the MAX over the
   ranks (and the longest sequence and the fewest rows, agreed before any rank can refuse).
2. contents: Karmarkar-Karp (largest differencing) over each sequence's workload ``24576 * L + L**2``,
   ``k`` parts, each part's indices ascending.
3. the budget is a strict cap (verl PR #7553, released in 0.9.1; up to 0.9.0 a part could hold more): when a
   part holds more tokens than the budget on any rank, every rank tries again with ``k + 1``; ``k`` beyond the
   fewest rows any rank holds is refused.
4. order: the parts by workload, heaviest first, then every other one reversed ahead of the rest
   (``parts[::2][::-1] + parts[1::2]``): the lightest micro-batches at both ends.

The ranks agree through ``all_max`` (a list of ints -> their element-wise MAX over the ranks; the engine passes a
``torch.distributed`` all-reduce, the tuner none: one rank). Every rank calls it the same number of times.
"""

from __future__ import annotations

import heapq
from typing import Callable, Optional, Sequence

__all__ = [
    "ATTENTION_WEIGHT",
    "AllMax",
    "workload",
    "karmarkar_karp",
    "balanced_parts",
    "pipeline_order",
    "dynamic_micro_batches",
    "token_budget_micro_batches",
]

#: verl's ``calculate_workload``: ``24576 * L + L**2`` (12 h^2 L + 2 h L^2 FLOPs at h = 4096, over 2 h)
ATTENTION_WEIGHT = 24576

#: element-wise MAX of a list of ints over the ranks (a collective: every rank calls it alike)
AllMax = Callable[[list[int]], list[int]]


def workload(length: int) -> int:
    """verl's per-sequence workload estimate (``calculate_workload``): linear layers + attention."""
    return ATTENTION_WEIGHT * length + length * length


def _one_rank(values: list[int]) -> list[int]:
    return list(values)


# --------------------------------------------------------------------------- Karmarkar-Karp, as verl runs it
class _Part:
    """One part of a partial partition: its (index, value) items and their sum; ordered as verl's ``Set``."""

    __slots__ = ("sum", "items")

    def __init__(self) -> None:
        self.sum = 0
        self.items: list[tuple[int, int]] = []

    def add(self, idx: int, value: int) -> None:
        self.items.append((idx, value))
        self.sum += value

    def __lt__(self, other: "_Part") -> bool:
        if self.sum != other.sum:
            return self.sum < other.sum
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    """``k`` parts, largest first; the heap pops the state of the widest spread first (verl's ``State``)."""

    __slots__ = ("k", "parts")

    def __init__(self, idx: int, value: int, k: int) -> None:
        self.k = k
        self.parts = [_Part() for _ in range(k)]
        self.parts[0].add(idx, value)
        self.parts.sort(reverse=True)

    def merge(self, other: "_State") -> None:
        """The largest part of one with the smallest of the other, and so on."""
        for i in range(self.k):
            for idx, value in other.parts[self.k - 1 - i].items:
                self.parts[i].add(idx, value)
        self.parts.sort(reverse=True)

    @property
    def spread(self) -> int:
        return self.parts[0].sum - self.parts[-1].sum

    def __lt__(self, other: "_State") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return other.parts[0] < self.parts[0]


def karmarkar_karp(values: Sequence[int], k: int) -> list[list[int]]:
    """``k`` parts of the indices of ``values`` with balanced sums, by the largest differencing method: verl's
    ``karmarkar_karp(..., equal_size=False)`` step for step (the same heap, the same ties), so the same parts in
    the same order. An index list per part, in the order items joined it."""
    heap: list[_State] = []
    for value, idx in sorted((v, i) for i, v in enumerate(values)):  # pushed one by one, in verl's order
        heapq.heappush(heap, _State(idx, value, k))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    return [[idx for idx, _ in part.items] for part in heap[0].parts]


def balanced_parts(values: Sequence[int], k: int) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions(values, k, equal_size=False)``: Karmarkar-Karp, each part's indices
    ascending; every part holds something."""
    if len(values) < k:
        raise ValueError(f"{len(values)} sequences cannot fill {k} micro-batches")
    parts = [sorted(p) for p in karmarkar_karp(values, k)]
    if not all(parts):
        raise ValueError(f"balancing {len(values)} sequences into {k} micro-batches left one empty")
    return parts


def pipeline_order(parts: list[list[int]], workloads: Sequence[int]) -> list[list[int]]:
    """verl's ``use_dynamic_bsz_balance`` order: heaviest first, then the lightest moved to both ends."""
    ranked = sorted(parts, key=lambda p: (sum(workloads[i] for i in p), p[0] if p else 0), reverse=True)
    return ranked[::2][::-1] + ranked[1::2]


# --------------------------------------------------------------------------- the packing
def _agree(
    sets: list[list[int]], max_token_len: int, min_num_micro_batch: Optional[int], all_max: AllMax
) -> tuple[list[int], list[int]]:
    """Step 1 for every row set: (the agreed counts, the fewest rows any rank holds); one collective. A sequence
    longer than the budget, on any rank, is refused on every rank."""
    n = len(sets)
    counts = [min(len(ls), -(-sum(ls) // max_token_len)) for ls in sets]
    if min_num_micro_batch is not None:
        counts = [max(min_num_micro_batch, c) for c in counts]
    agreed = all_max(counts + [-len(ls) for ls in sets] + [max(ls, default=0) for ls in sets])
    longest = max(agreed[2 * n :], default=0)
    if longest > max_token_len:
        raise ValueError(f"a sequence of {longest} tokens exceeds the token budget {max_token_len}")
    return list(agreed[:n]), [-f for f in agreed[n : 2 * n]]


def dynamic_micro_batches(
    length_sets: Sequence[Sequence[int]],
    max_token_len: int,
    *,
    min_num_micro_batch: Optional[int] = None,
    all_max: Optional[AllMax] = None,
) -> list[list[list[int]]]:
    """Each row set's micro-batches (index lists into its lengths, in the order they run), under ``max_token_len``
    tokens each: verl 0.9.1's ``rearrange_micro_batches`` (module docstring), for several row sets of one pass at
    once (the agreement's collectives batched: one for the counts, one per round of step 3).

    ``length_sets``: this rank's valid-token length of every sequence of each row set; ``all_max``: the MAX over
    the ranks (None: this rank alone). Raises ValueError where verl raises (a sequence over the budget, more
    micro-batches needed than a rank has rows)."""
    sets = [[int(x) for x in ls] for ls in length_sets]
    all_max = all_max or _one_rank
    counts, fewest = _agree(sets, max_token_len, min_num_micro_batch, all_max)
    workloads = [[workload(x) for x in ls] for ls in sets]
    parts: list[list[list[int]]] = [[] for _ in sets]
    pending = [i for i, k in enumerate(counts) if k > 0]
    while pending:
        over = []
        for i in pending:
            if counts[i] > fewest[i]:
                raise ValueError(
                    f"{counts[i]} micro-batches of at most {max_token_len} tokens are needed, "
                    f"but a rank holds only {fewest[i]} sequences"
                )
            parts[i] = balanced_parts(workloads[i], counts[i])
            over.append(int(any(sum(sets[i][j] for j in p) > max_token_len for p in parts[i])))
        over = all_max(over)
        for i, again in zip(pending, over):
            counts[i] += again
        pending = [i for i, again in zip(pending, over) if again]
    return [pipeline_order(p, w) for p, w in zip(parts, workloads)]


def token_budget_micro_batches(
    lengths: Sequence[int], max_token_len: int, *, min_num_micro_batch: Optional[int] = None
) -> list[list[int]]:
    """One row set's micro-batches on a rank alone (every rank holding lengths like these packs them alike)."""
    return dynamic_micro_batches([lengths], max_token_len, min_num_micro_batch=min_num_micro_batch)[0]
