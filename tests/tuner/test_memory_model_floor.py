"""tuner.memory_model.floor with no process: the models' states a rank holds in every phase, counted by hand for the
embedded model, the one line a cap below them gets, and a cap just above them let through."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tuner.memory_model import ModelShape, flat_config, param_counts
from tuner.memory_model.floor import GIB, TINY_VOCAB_SIZE, below_floor, memory_floor, tiny_shape

TINY_CPU = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def tiny_cpu(**overrides) -> dict:
    return flat_config({**flat_config(yaml.safe_load(TINY_CPU.read_text())), **overrides})


def test_tiny_cpu_floor_by_hand():
    """The embedded Qwen2 (h 64, i 128, 2 layers, 2 heads of 32, 1 KV head, vocabulary 104, untied, q/k/v bias):
    actor 87,616 parameters, critic 81,025 (a value head of h + 1 instead of the LM head). On a CPU every state is
    in the memory the cap counts: the actor and the critic hold fp32 parameters and two Adam moments (12 B each),
    the reference model its fp32 parameters (4 B), all sharded over the 2 ranks."""
    shape = tiny_shape(tiny_cpu())
    counts = param_counts(shape)
    embedding, block = 104 * 64, (64 * 64 * 2 + 2 * 64 * 32 + 64 + 2 * 32) + 3 * 64 * 128 + 2 * 64
    assert counts.actor == 2 * embedding + 2 * block + 64 == 87_616
    assert counts.critic == embedding + 2 * block + 64 + 65 == 81_025
    floor = memory_floor(tiny_cpu(), [shape], on_gpu=False)
    assert floor.bytes_per_rank == (87_616 * 12 + 81_025 * 12 + 87_616 * 4) / 2 == 1_187_078
    assert floor.what == "the actor's, the reference's and the critic's fp32 states sharded over 2 ranks"
    assert floor.shown() == "0.0012 GiB"  # rounded up: a cap at the figure shown passes


def test_floor_scales_with_the_world_and_drops_roles_not_built():
    shape = tiny_shape(tiny_cpu())
    two = memory_floor(tiny_cpu(), [shape], on_gpu=False).bytes_per_rank
    assert memory_floor(tiny_cpu(**{"trainer.n_gpus_per_node": 4}), [shape], on_gpu=False).bytes_per_rank == two / 2
    no_kl = tiny_cpu(**{"algorithm.use_kl_in_reward": False})  # no reference model
    floor = memory_floor(no_kl, [shape], on_gpu=False)
    assert floor.bytes_per_rank == two - 87_616 * 4 / 2
    assert floor.what == "the actor's and the critic's fp32 states sharded over 2 ranks"


def test_gpu_floor_is_what_offload_leaves_on_the_device():
    """On a GPU the reference model lives in host memory; with every offload flag a role holds nothing on the device
    in the phases it does not run, so the floor is 0 and no cap is refused for it."""
    shape = tiny_shape(tiny_cpu())
    plain = memory_floor(tiny_cpu(), [shape], on_gpu=True)
    assert plain.bytes_per_rank == (87_616 * 12 + 81_025 * 12) / 2
    assert plain.what == "the actor's and the critic's fp32 states on the GPU sharded over 2 ranks"
    off = {
        f"{s}.{k}": True
        for s in ("actor_rollout_ref.actor.fsdp_config", "critic.fsdp")
        for k in ("param_offload", "optimizer_offload")
    }
    assert memory_floor(tiny_cpu(**off), [shape], on_gpu=True).bytes_per_rank == 0
    assert below_floor(1e-9, memory_floor(tiny_cpu(**off), [shape], on_gpu=True), cap="c", source="s") is None


def test_the_smallest_shape_bounds_a_critic_of_another_model():
    small = tiny_shape(tiny_cpu())
    big = ModelShape(**{**small.to_dict(), "hidden_size": 128, "head_dim": 64})
    both = memory_floor(tiny_cpu(), [big, small], on_gpu=False)
    assert both.bytes_per_rank == memory_floor(tiny_cpu(), [small], on_gpu=False).bytes_per_rank


def test_a_cap_below_the_floor_gets_one_line_and_one_just_above_passes():
    floor = memory_floor(tiny_cpu(), [tiny_shape(tiny_cpu())], on_gpu=False)
    line = below_floor(0.001, floor, cap="--memory-limit-gb 0.001", source="configs/tiny_cpu.yaml")
    assert line == (
        "--memory-limit-gb 0.001 is below what a rank holds from its first step on: 0.0012 GiB (the actor's, the "
        "reference's and the critic's fp32 states sharded over 2 ranks; configs/tiny_cpu.yaml)"
    )
    assert "\n" not in line
    just_above = floor.bytes_per_rank / GIB * (1 + 1e-6)
    assert below_floor(just_above, floor, cap="c", source="s") is None
    assert below_floor(0.0012, floor, cap="c", source="s") is None  # the figure the line shows
    assert below_floor(floor.bytes_per_rank / GIB * (1 - 1e-6), floor, cap="c", source="s") is not None


def test_a_checkpoint_is_not_the_tiny_model():
    assert tiny_shape(tiny_cpu(**{"actor_rollout_ref.model.path": "/ckpt/qwen"})) is None


def test_tiny_vocabulary_is_the_engines():
    """The tuner does not import the engine: its copy of the embedded model's vocabulary is checked here."""
    pytest.importorskip("transformers")
    from trainer.config import TinyModelConfig
    from trainer.engine.models import build_tokenizer, tiny_qwen2_config

    assert tiny_qwen2_config(TinyModelConfig(), len(build_tokenizer()), 128).vocab_size == TINY_VOCAB_SIZE
