"""tuner.commands.flags' check of a cap against the models' states, with no process: the shape read from a checkpoint's
``config.json`` (no weights), a cap just above the floor let through, and a model whose shape is not readable here
said to be unchecked."""

from __future__ import annotations

import json
from pathlib import Path

from tuner.commands.flags import cap_below_floor, cap_text
from tuner.memory_model import ModelShape, flat_config, param_counts
from tuner.memory_model.floor import GIB

SHAPE = {
    "model_type": "qwen2",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


def _checkpoint(tmp_path: Path, **shape) -> str:
    d = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**SHAPE, **shape}))
    return str(d)


def _config(path: str, **flat) -> dict:
    base = {"actor_rollout_ref.model.path": path, "trainer.n_gpus_per_node": 2, "algorithm.use_kl_in_reward": True}
    return flat_config({**base, **flat})


def _floor_gib(shape: dict) -> float:
    """On a CPU: actor and critic 12 B a parameter (fp32 and two moments), the reference 4 B, over 2 ranks."""
    counts = param_counts(ModelShape.from_dict(shape))
    return (counts.actor * 16 + counts.critic * 12) / 2 / GIB


def test_a_checkpoints_shape_sets_the_floor(tmp_path):
    config = _config(_checkpoint(tmp_path))
    floor = _floor_gib(SHAPE)
    check = dict(cap="--memory-limit-gb X", source="base.yaml", on_gpu=False)
    line = cap_below_floor("fit", config, limit_gb=floor * 0.99, **check)
    assert line.startswith("--memory-limit-gb X is below what a rank holds from its first step on: ")
    assert line.endswith("(the actor's, the reference's and the critic's fp32 states sharded over 2 ranks; base.yaml)")
    assert cap_below_floor("fit", config, limit_gb=floor * 1.0001, **check) is None
    assert cap_below_floor("fit", config, limit_gb=None, **check) is None


def test_a_critic_of_another_model_bounds_the_floor_from_below(tmp_path):
    small = _checkpoint(tmp_path, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    config = _config(_checkpoint(tmp_path), **{"critic.model.path": small})
    check = dict(cap="c", source="s", on_gpu=False)
    small_floor = _floor_gib({**SHAPE, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1})
    assert cap_below_floor("fit", config, limit_gb=small_floor * 1.0001, **check) is None
    assert cap_below_floor("fit", config, limit_gb=small_floor * 0.99, **check) is not None


def test_a_shape_not_readable_here_is_said_to_be_unchecked(tmp_path, capsys):
    config = _config("Qwen/Qwen2.5-0.5B")  # a hub id (a verl run file's): nothing to read here
    assert (
        cap_below_floor("search", config, limit_gb=1e-6, cap="--memory-limit-gb 1e-06", source="s", on_gpu=False)
        is None
    )
    err = capsys.readouterr().err
    assert err.startswith("ppotune search: note: --memory-limit-gb 1e-06 not checked against the models' states: ")
    assert err.count("\n") == 1


def test_cap_text_names_the_flag_else_the_key():
    assert cap_text("--memory-limit-gb", 0.5, "ppotune.memory_limit_gb", 0.25) == "--memory-limit-gb 0.5"
    assert cap_text("--memory-limit-gb", None, "ppotune.memory_limit_gb", 0.25) == "ppotune.memory_limit_gb: 0.25"
