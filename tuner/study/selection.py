"""What a study recommends, chosen once: the memory headroom and the pick (``ppotune search --memory-headroom F
--pick P``). The search confirms and probes what they select and records them in the study attribute
``selection``; report and export take them as their defaults. The single trials' order per pick
(:func:`rank_trials`) is here too, so the search's worst-case stage probes what export would take first.

The attribute is data read back from a storage: :func:`selection_of` takes it only as checked
(:mod:`tuner.study.schema`), else the defaults.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from trainer.contracts import DEFAULT_HEADROOM

if TYPE_CHECKING:  # rank_trials takes the results' frame; the search, which only reads the selection, loads no pandas
    import pandas as pd

__all__ = ["PICKS", "DEFAULT_PICK", "SELECTION_ATTR", "Selection", "selection_of", "rank_trials", "headroom_problem"]

PICKS = ("max-throughput", "min-memory", "knee")
DEFAULT_PICK = "max-throughput"
#: study attribute: ``{"pick": P, "memory_headroom": F}``, what the search confirmed and probed for
SELECTION_ATTR = "selection"


def headroom_problem(value: Any) -> str | None:
    """Why ``value`` is no memory headroom (a fraction in [0, 1)), or None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0
    return None if ok else f"--memory-headroom must be in [0, 1), got {value!r}"


@dataclasses.dataclass(frozen=True)
class Selection:
    """A pick under a headroom; ``recorded``: read from the study (else the defaults)."""

    pick: str = DEFAULT_PICK
    headroom: float = DEFAULT_HEADROOM
    recorded: bool = False

    def __post_init__(self) -> None:
        if self.pick not in PICKS:
            raise ValueError(f"--pick must be one of {', '.join(PICKS)}, got {self.pick!r}")
        why = headroom_problem(self.headroom)
        if why:
            raise ValueError(why)

    def to_attr(self) -> dict:
        return {"pick": self.pick, "memory_headroom": float(self.headroom)}

    def flags(self) -> str:
        """``--pick P --memory-headroom F``: the command-line spelling."""
        return f"--pick {self.pick} --memory-headroom {self.headroom:g}"

    def same(self, other: "Selection") -> bool:
        return self.pick == other.pick and abs(self.headroom - other.headroom) < 1e-9


def selection_of(attrs: Mapping[str, Any]) -> Selection:
    """The study's recorded selection (``attrs``: its attributes as checked by :mod:`tuner.study.schema`), or
    the defaults for a study that has none (written before it existed) or a bad one."""
    rec = attrs.get(SELECTION_ATTR)
    if not isinstance(rec, dict):
        return Selection()
    try:
        return Selection(pick=rec["pick"], headroom=float(rec["memory_headroom"]), recorded=True)
    except (KeyError, TypeError, ValueError):
        return Selection()


def rank_trials(df: pd.DataFrame, under: pd.Series, front_mask: pd.Series, pick: str) -> list[int]:
    """The single trials under the limit (``under``), best first by ``pick``:

    - ``max-throughput``: the fastest (ties: less memory);
    - ``min-memory``: the smallest peak (ties: faster);
    - ``knee``: the Pareto point (``front_mask``) furthest above the chord joining the front's ends, both
      objectives scaled to [0, 1] over the front."""
    cand = df.loc[under, ["number", "throughput", "peak_memory_gb"]].copy()
    if pick == "max-throughput":
        cand = cand.sort_values(["throughput", "peak_memory_gb", "number"], ascending=[False, True, True])
    elif pick == "min-memory":
        cand = cand.sort_values(["peak_memory_gb", "throughput", "number"], ascending=[True, False, True])
    else:
        front = df.loc[front_mask]
        t_lo, t_hi = front["throughput"].min(), front["throughput"].max()
        m_lo, m_hi = front["peak_memory_gb"].min(), front["peak_memory_gb"].max()
        t_span, m_span = (t_hi - t_lo) or 1.0, (m_hi - m_lo) or 1.0
        # height above the chord joining the front's two ends, both objectives scaled to [0, 1]:
        # the knee buys the most throughput per GB relative to the straight trade-off
        cand["score"] = (cand["throughput"] - t_lo) / t_span - (cand["peak_memory_gb"] - m_lo) / m_span
        cand = cand.sort_values(["score", "throughput", "number"], ascending=[False, False, True])
    return [int(n) for n in cand["number"]]
