"""verl's RL parquet format, as both engines read it: which columns a file must have, and a file checked from its
footer alone (schema and row count), so a bad file is found before any rank starts.

``trainer.engine.data`` reads the rows with these columns; ``trainer.launch.preflight`` checks the files of a
config (ours or a verl run's) with :func:`check_parquet` before anything is launched. Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from trainer.config import ConfigError

__all__ = ["REWARD_COLUMN", "required_columns", "missing_columns", "split_files", "check_parquet"]

#: verl's reward column: a struct whose ``ground_truth`` the rule-based reward compares with
REWARD_COLUMN = "reward_model"


def required_columns(prompt_key: str = "prompt") -> tuple[str, ...]:
    """The columns every verl RL parquet needs: the chat messages (``data.prompt_key``) and the reward's."""
    return (prompt_key, REWARD_COLUMN)


def missing_columns(columns: Iterable[str], prompt_key: str = "prompt") -> list[str]:
    """The required columns (:func:`required_columns`) not among ``columns``, in order."""
    have = set(columns)
    return [c for c in required_columns(prompt_key) if c not in have]


def split_files(value: Any) -> list[str]:
    """A ``data.train_files`` value as a list of paths: ``a.parquet,b.parquet`` (ours), a YAML list, or Hydra's
    ``[a.parquet,'b.parquet']`` (a verl run file's override text)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    return [f.strip().strip("'\"") for f in text.split(",") if f.strip().strip("'\"")]


def check_parquet(path: str, *, prompt_key: str = "prompt", key: str = "data.train_files") -> None:
    """Refuse (:class:`ConfigError` naming the file and ``key``) a file that is missing, not parquet, lacks a
    required column or holds no rows. Reads the footer only (no rows)."""
    import pyarrow.parquet as pq

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(key, "file not found", source=str(path))
    try:
        meta = pq.ParquetFile(p).metadata
        names = meta.schema.to_arrow_schema().names
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise ConfigError(key, f"not a parquet file ({type(e).__name__}: {str(e)[:200]})", source=str(p)) from None
    missing = missing_columns(names, prompt_key)
    if missing:
        raise ConfigError(
            key,
            f"missing column {missing[0]!r} (verl's RL format needs {' and '.join(required_columns(prompt_key))}; "
            f"the file has {', '.join(names) or 'no columns'})",
            source=str(p),
        )
    if meta.num_rows == 0:
        raise ConfigError(key, "no rows", source=str(p))
