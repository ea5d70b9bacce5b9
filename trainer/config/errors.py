"""The one error a bad user config raises: :class:`ConfigError`, a ``ValueError`` naming the file and the key."""

from __future__ import annotations

from typing import Optional

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Bad user config. ``str()`` is one line naming the file (if any) and the key."""

    def __init__(self, key: str, message: str, *, source: Optional[str] = None):
        self.key = key
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {message}")
