"""verl's Hydra overrides, both ways: a key read from ``key=value`` text, a Python value written as Hydra reads
it back (torch-free; the verl adapter, the tuner's verl runner and export use them)."""

from __future__ import annotations

import math
import re
from typing import Any

from trainer.config import flatten, verl_override_key

__all__ = ["override_key", "hydra_value", "verl_overrides"]


def override_key(override: str) -> str:
    """``++a.b=1`` / ``+a.b=1`` / ``a.b=1`` -> ``a.b``."""
    return override.split("=", 1)[0].lstrip("+~")


_BARE = re.compile(r"[A-Za-z_~/][A-Za-z0-9_\-./~]*")
_RESERVED = {"true", "false", "null", "none", "inf", "nan", "yes", "no", "on", "off"}


def hydra_value(v: Any) -> str:
    """A Python value as Hydra's override grammar reads it back (true/false, null, numbers, quoted text)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        if _BARE.fullmatch(v) and v.lower() not in _RESERVED:
            return v
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot format {type(v).__name__} {v!r} for Hydra")


def verl_overrides(overrides: dict[str, Any]) -> list[str]:
    """``key=value`` lines for verl: flattened, sorted, never a ``ppotune.`` key."""
    flat = {}
    for k, v in overrides.items():
        if isinstance(v, dict) and v:
            flat.update({f"{k}.{kk}": vv for kk, vv in flatten(v).items()})
        else:
            flat[k] = v
    return [f"{verl_override_key(k)}={hydra_value(v)}" for k, v in sorted(flat.items()) if not k.startswith("ppotune.")]
