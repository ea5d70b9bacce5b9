"""What can be checked without training, checked before any rank starts: the data files (present, parquet, verl's
columns, rows), the model directory (an HF config, weights) and its tokenizer (its files, a chat template), the
rollout a GPU run needs (vLLM where the config names none).

``ppotune train`` and ``ppotune check`` run :func:`preflight` on a validated config, ``ppotune search`` once on its
trial base config, and :func:`preflight_verl` on a verl run's overrides (``--engine verl``): a bad input is one
line naming the file and the key, exit 2, before anything is launched or written. Reads files' headers and
small JSON files only: no torch, no tokenizer library, nothing downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Callable, Optional

from trainer.config import ConfigError, PPOConfig, config_to_dict, flatten, resolve_follows, rollout_name
from trainer.datafiles import check_parquet, split_files

__all__ = ["preflight", "preflight_verl", "check_model_dir"]

EMBEDDED_MODEL = "tiny"  # trainer.config's default model path: the model built in code, with its own tokenizer
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _json_object(path: Path, key: str, source: Optional[str]) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(key, f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})", source=source) from None
    if not isinstance(data, dict):
        raise ConfigError(key, f"{path}: not a JSON object", source=source)
    return data


def check_model_dir(path: str, *, key: str, source: Optional[str] = None, chat_template: bool = True) -> None:
    """A local Hugging Face checkpoint directory: ``config.json`` (a JSON object with a ``model_type``), weights,
    and a tokenizer (its files parse; with ``chat_template``, the template the prompts go through)."""
    if path == EMBEDDED_MODEL:
        return
    d = Path(path).expanduser()
    if not d.is_dir():
        raise ConfigError(key, f"not a local HF checkpoint directory: {path} (nothing is downloaded)", source=source)
    if not (d / "config.json").is_file():
        raise ConfigError(key, f"{d}: no config.json (not a Hugging Face checkpoint)", source=source)
    if "model_type" not in _json_object(d / "config.json", key, source):
        raise ConfigError(key, f"{d / 'config.json'}: no model_type", source=source)
    if not any((d / w).is_file() for w in _WEIGHTS):
        raise ConfigError(key, f"{d}: no weights ({' or '.join(_WEIGHTS[::2])})", source=source)
    if not any((d / t).is_file() for t in _TOKENIZER):
        raise ConfigError(key, f"{d}: no tokenizer ({', '.join(_TOKENIZER)})", source=source)
    tok_cfg: dict = {}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (d / name).is_file():
            data = _json_object(d / name, key, source)
            tok_cfg = data if name == "tokenizer_config.json" else tok_cfg
    if chat_template and not tok_cfg.get("chat_template") and not any((d / f).is_file() for f in _CHAT_TEMPLATE_FILES):
        raise ConfigError(
            key,
            f"{d}: the tokenizer has no chat template (tokenizer_config.json chat_template or chat_template.jinja): "
            "the prompts are chat messages",
            source=source,
        )


def preflight(cfg: PPOConfig, *, source: Optional[str] = None) -> None:
    """Check a validated config's inputs (ConfigError naming the file and the key): every ``data.train_files``
    file, the actor's model directory and tokenizer, the critic's model directory when it is another, and that the
    rollout a GPU run takes when none is named (vLLM) imports here."""
    from trainer.launch.device import detect_device  # NVML only, no torch

    vllm = importlib.util.find_spec("vllm") is not None  # found, not imported: no CUDA set-up here
    rollout = cfg.actor_rollout_ref.rollout.name
    rollout_name(rollout, device_type=detect_device(cfg.ppotune.device), vllm_importable=vllm, source=source)
    eff = resolve_follows(flatten(config_to_dict(cfg)))
    for f in split_files(eff["data.train_files"]):
        check_parquet(f, prompt_key=eff["data.prompt_key"], key="data.train_files")
    actor = eff["actor_rollout_ref.model.path"]
    check_model_dir(actor, key="actor_rollout_ref.model.path", source=source)
    critic = eff["critic.model.path"]
    if critic != actor:
        check_model_dir(critic, key="critic.model.path", source=source, chat_template=False)


def preflight_verl(get: Callable[[str], Optional[str]], *, source: Optional[str] = None) -> None:
    """The same checks on a verl run's overrides (``get(key)``: the value an override gives, as written): the
    train and validation files (verl loads both at start-up) and the model directories. A key the overrides do
    not set is verl's default, not checked here."""
    prompt_key = _unquote(get("data.prompt_key")) or "prompt"
    for key in ("data.train_files", "data.val_files"):
        for f in split_files(get(key)):
            check_parquet(f, prompt_key=prompt_key, key=key)
    actor = _unquote(get("actor_rollout_ref.model.path"))
    if actor:
        check_model_dir(actor, key="actor_rollout_ref.model.path", source=source)
    critic = _unquote(get("critic.model.path"))
    if critic and critic != actor:
        check_model_dir(critic, key="critic.model.path", source=source, chat_template=False)


def _unquote(value: Any) -> Optional[str]:
    if value is None:
        return None
    text = str(value).strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
