"""How the tuner writes a memory figure: in GB, with enough digits to tell trials apart.

Two decimals hide what the knobs change in a small run (see docs/decisions.md#gb-digits): below 1 GB a figure
keeps three significant digits (``0.0341``, ``0.512``), from 1 GB on two
decimals (``12.34``)."""

from __future__ import annotations

from typing import Optional

__all__ = ["gb"]


def gb(value: Optional[float], width: int = 0) -> str:
    """``value`` GB as text (without the unit), right-aligned in ``width``; ``-`` for None."""
    if value is None:
        text = "-"
    elif abs(value) < 1:
        text = f"{value:#.3g}"
    else:
        text = f"{value:.2f}"
    return f"{text:>{width}}"
