"""How many tokens the largest micro-batch of a phase holds: the sequence lengths a trial saw (or the worst
case) run through the trainer's own batching rules (``trainer/engine/batching.py``, ``trainer/engine/step.py``).

* Fixed micro-batches (``*_micro_batch_size_per_gpu = b``): consecutive chunks of ``b`` of a rank's
  sequences, in the data's order. The largest chunk a trial meets over its steps is taken as the longest
  sequence plus ``b - 1`` average ones (a sum of ``b`` draws is dominated by its largest when ``b`` is
  small and tends to ``b`` x the mean when it is large).
* Token budget (``use_dynamic_bsz``, ``*_max_token_len_per_gpu = M``): the micro-batches verl 0.9.1's packing
  makes (:mod:`trainer.packing`, which our engine runs too): Karmarkar-Karp over the sequences' workloads, as
  few parts as hold at most ``M`` valid tokens each; run here on a deterministic sample of the lengths, and the
  largest part's actual tokens taken, not the budget.
* Remove-padding (``use_remove_padding``) packs the valid tokens of a micro-batch into one row: the model
  sees their sum. Without it every row is ``max_prompt_length + max_response_length`` wide (prompts are
  left-padded to ``max_prompt_length``, responses right-padded to ``max_response_length``), so the model
  sees ``rows x width`` tokens whatever their lengths.

Lengths are token-length percentiles (``TrialRecord.lengths``: ``{"prompt": {"p10", "p50", "p90", "max"},
"response": {...}}``). The worst case puts every prompt at ``max_prompt_length`` and every response at
``max_response_length`` (what the worst-case probe runs) and packs them as the engines do: a budget of
``M`` tokens holds ``ceil(rows / k)`` whole sequences, ``k`` the first count whose parts fit, so its largest
micro-batch is at most ``M`` and often less (the memory model takes the larger of this and the typical
batch). Pure Python, no torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping, Optional

from trainer.packing import token_budget_micro_batches

__all__ = ["Lengths", "Plan", "MicroBatch", "largest_micro_batch", "length_sample", "packed_micro_batches"]

_KNOTS = (0.0, 0.1, 0.5, 0.9, 1.0)
_KEYS = ("p10", "p10", "p50", "p90", "max")  # flat below p10: the record has no lower percentile


@dataclass(frozen=True)
class Lengths:
    """Token-length percentiles of prompts and responses (each ``{"p10", "p50", "p90", "max"}``)."""

    prompt: Mapping[str, float]
    response: Mapping[str, float]
    worst: bool = False  # every sequence at its maximum, token budgets filled to the cap

    @classmethod
    def from_record(cls, lengths: Optional[Mapping]) -> Optional["Lengths"]:
        """From ``TrialRecord.lengths``; None when a part or a percentile is missing."""
        if not lengths:
            return None
        parts = [lengths.get("prompt") or {}, lengths.get("response") or {}]
        if not all(all(k in p for k in ("p10", "p50", "p90", "max")) for p in parts):
            return None
        return cls(*({k: float(p[k]) for k in ("p10", "p50", "p90", "max")} for p in parts))

    @classmethod
    def worst_case(cls, max_prompt_length: int, max_response_length: int) -> "Lengths":
        full = lambda n: {k: float(n) for k in ("p10", "p50", "p90", "max")}  # noqa: E731
        return cls(full(max_prompt_length), full(max_response_length), worst=True)

    def to_dict(self) -> dict:
        return {"prompt": dict(self.prompt), "response": dict(self.response), "worst": self.worst}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Lengths":
        return cls(dict(d["prompt"]), dict(d["response"]), bool(d.get("worst", False)))


@dataclass(frozen=True)
class Plan:
    """How a phase splits its sequences (``trainer.engine.roles.MicroBatching``)."""

    dynamic: bool
    micro_batch_size: Optional[int]
    max_token_len: int


@dataclass(frozen=True)
class MicroBatch:
    """The largest micro-batch of a phase on one GPU."""

    tokens: float  # tokens through the model (packed valid tokens, or rows x padded width)
    response_tokens: float  # rows whose logits are read: response tokens (packed) or rows x max_response_length
    rows: float  # sequences in it


def _quantile(q: float, pct: Mapping[str, float]) -> float:
    """Piecewise-linear quantile function through the recorded percentiles."""
    for (q0, k0), (q1, k1) in zip(zip(_KNOTS, _KEYS), zip(_KNOTS[1:], _KEYS[1:])):
        if q <= q1:
            return pct[k0] + (pct[k1] - pct[k0]) * (q - q0) / (q1 - q0)
    return pct["max"]


def length_sample(pct: Mapping[str, float], n: int, cap: int) -> list[float]:
    """``n`` lengths at the quantile midpoints ``(j + 0.5) / n``: a deterministic sample of the distribution."""
    return [min(float(cap), _quantile((j + 0.5) / n, pct)) for j in range(n)]


def packed_micro_batches(lengths: list[float], max_tokens: float) -> list[list[int]]:
    """The micro-batches (index lists) the engines pack ``lengths`` into under ``max_tokens`` tokens each: verl
    0.9.1's packing on whole tokens (:func:`trainer.packing.token_budget_micro_batches`); a length over the budget
    (a config the trainer refuses) is taken at the budget. Cached: a search asks for the same few many times."""
    budget = int(max_tokens)
    return [list(b) for b in _packed(tuple(min(budget, max(1, round(x))) for x in lengths), budget)]


@functools.lru_cache(maxsize=4096)
def _packed(lengths: tuple[int, ...], budget: int) -> tuple[tuple[int, ...], ...]:
    if not lengths:
        return ((),)
    return tuple(tuple(b) for b in token_budget_micro_batches(list(lengths), budget))


def largest_micro_batch(
    lengths: Lengths,
    plan: Plan,
    *,
    num_rows: int,
    max_prompt_length: int,
    max_response_length: int,
    remove_padding: bool,
    pad_multiple: Optional[int] = None,
) -> MicroBatch:
    """The largest micro-batch when ``num_rows`` sequences (a per-GPU mini-batch, or a rank's whole batch for
    a forward-only phase) are split by ``plan``. ``pad_multiple``: verl's ``pad_to_length`` (packed rows
    padded to a multiple of it)."""
    width = max_prompt_length + max_response_length
    num_rows = max(1, int(num_rows))
    prompts = length_sample(lengths.prompt, num_rows, max_prompt_length)
    responses = length_sample(lengths.response, num_rows, max_response_length)
    seqs = [p + r for p, r in zip(prompts, responses)]
    longest = min(lengths.prompt["max"], max_prompt_length) + min(lengths.response["max"], max_response_length)
    longest_response = min(lengths.response["max"], max_response_length)
    if plan.dynamic:
        if lengths.worst:  # every sequence at its maximum: whole sequences of the padded width
            seqs, responses = [float(width)] * num_rows, [float(max_response_length)] * num_rows
        bins = packed_micro_batches(seqs, plan.max_token_len)
        if remove_padding:
            big = max(bins, key=lambda b: (sum(seqs[i] for i in b), len(b)))
            got = MicroBatch(sum(seqs[i] for i in big), sum(responses[i] for i in big), len(big))
            return _padded(got, pad_multiple, remove_padding)
        rows = max(len(b) for b in bins)  # padded: memory goes by rows, not by valid tokens
        return MicroBatch(rows * width, rows * max_response_length, rows)
    b = min(int(plan.micro_batch_size or 1), num_rows)
    if not remove_padding:
        return MicroBatch(b * width, b * max_response_length, b)
    mean = sum(seqs) / len(seqs)
    mean_response = sum(responses) / len(responses)
    top = sorted(seqs, reverse=True)[:b]
    tokens = min(longest + (b - 1) * mean, max(sum(top), longest))
    response_tokens = min(longest_response + (b - 1) * mean_response, b * max_response_length)
    return _padded(MicroBatch(tokens, response_tokens, b), pad_multiple, remove_padding)


def _padded(mb: MicroBatch, multiple: Optional[int], remove_padding: bool) -> MicroBatch:
    if not multiple or not remove_padding:
        return mb
    return MicroBatch(math.ceil(mb.tokens / multiple) * multiple, mb.response_tokens, mb.rows)
