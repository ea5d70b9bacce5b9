"""A search started from a fit (``ppotune search --from-fit DIR``): the fitted sizes are the space's upper bounds
and the first config tried after the baseline.

A knob of the space that the fit fitted, and whose memory grows with its value (``memory: increasing``), keeps only
the values at or below the fitted one (a larger one's worst case does not fit: a search would spend trials on it and
export would have to refuse it); the fitted values of the space's knobs are the search's second trial, right after
the baseline. Knobs the fit did not fit, or that the space does not vary, are left as they are.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional

from tuner.space import Space, space_from_dict

__all__ = ["FIT_JSON", "read_fit", "bounded_space", "fitted_params"]

#: the file of a fit's output dir that a search reads (tuner.results.fit_files writes it)
FIT_JSON = "fit.json"


def read_fit(directory: str | Path) -> dict:
    """``{key: value}`` of the fit in ``directory`` (its ``fit.json``); ValueError naming the file and the key."""
    path = Path(directory) / FIT_JSON
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: --from-fit: {e.strerror or e} (ppotune fit --out DIR writes it)") from None
    except ValueError as e:
        raise ValueError(f"{path}: --from-fit: not JSON: {e}") from None
    values = data.get("values") if isinstance(data, dict) else None
    if not isinstance(values, dict) or not values:
        raise ValueError(f"{path}: values: missing (not a complete fit)")
    for key, v in values.items():
        if not isinstance(key, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{path}: values.{key}: {v!r} is not a size")
    return dict(values)


def _capped(spec: dict, value: Any) -> Optional[dict]:
    """``spec`` with its values above ``value`` removed (its smallest kept, if every one is above), or None when
    nothing changes."""
    out = dict(spec)
    kind = spec.get("type")
    if kind in ("int", "pow2", "float") and isinstance(spec.get("high"), (int, float)):
        low, high = spec.get("low", value), spec["high"]
        if high <= value:
            return None
        step = spec.get("step")
        if kind == "pow2":
            top = 1 << (max(1, int(value)).bit_length() - 1)  # the largest power of two at or below it
        else:
            top = value if not step else low + int((value - low) // step) * step
        out["high"] = type(high)(max(low, top))
        return out
    if kind == "categorical":
        numeric = [c for c in spec.get("choices") or [] if isinstance(c, (int, float)) and not isinstance(c, bool)]
        keep = [c for c in numeric if c <= value] or sorted(numeric)[:1]
        if len(keep) == len(spec["choices"]):
            return None
        out["choices"] = keep
        if "order" in spec:
            out["order"] = [c for c in spec["order"] if c in keep]
        return out
    return None


def bounded_space(space: Space, fitted: dict) -> tuple[Space, list[str]]:
    """(``space`` with each fitted, memory-increasing knob capped at its fitted value, one line per knob capped)."""
    raw = copy.deepcopy(space.raw)
    notes = []
    for knob in space.knobs:
        if knob.key not in fitted or knob.memory != "increasing":
            continue
        capped = _capped(raw["knobs"][knob.key], fitted[knob.key])
        if capped is not None:
            raw["knobs"][knob.key] = capped
            notes.append(f"{knob.key} <= {fitted[knob.key]} (the fit's)")
    return (space_from_dict(raw, source=space.source) if notes else space), notes


def fitted_params(space: Space, fitted: dict, base_flat: dict) -> dict:
    """The fitted values of the space's knobs active with them, as Optuna params (what the search enqueues after its
    baseline); empty when none of its knobs was fitted."""
    eff = {**base_flat, **fitted}
    mine = {k.key: fitted[k.key] for k in space.knobs if k.key in fitted and space.active(k, eff)}
    mine = {k: v for k, v in mine.items() if space.knob(k).contains(v)}
    return space.to_params({**space.baseline_values(base_flat), **mine}) if mine else {}
