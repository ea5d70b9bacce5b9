"""The memory floor: the model states a rank holds in every phase of a step, whatever its batch.

A cap (``--memory-limit-gb``, ``ppotune.memory_limit_gb``) below this cannot run one step: the rank dies in its
set-up or its first step, and how it dies (an allocation refused in C code, a signal, an OOM in a later phase) varies
from run to run and with the load on the machine. The commands compare a cap with the floor before anything is
launched, so the same config gets the same answer every time (exit 2, one line).

The floor is the smallest ``states`` term of any phase (:func:`tuner.memory_model.terms.phase_terms`: one definition
of what the models' states are). On a CPU that is every built model's parameters plus the trained roles' Adam
moments, sharded by FSDP; on a GPU what offload leaves on the device (the reference model's parameters live in host
memory there). Batch-dependent terms (activations, logits, buffers) are left out: the floor must not refuse a cap that
a smaller batch would fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from trainer.config.keys import absent_role
from tuner.memory_model.fit import GB
from tuner.memory_model.shape import ModelShape, shape_of_config
from tuner.memory_model.terms import flat_config, phase_terms, world_of
from tuner.memory_model.workload import Lengths

__all__ = ["MemoryFloor", "memory_floor", "below_floor", "tiny_shape", "TINY_VOCAB_SIZE"]

GIB = GB  # the memory model's one GiB (tuner.memory_model.fit.GB)
#: The embedded model's vocabulary: its character-level tokenizer's, rounded up to a multiple of 8
#: (``trainer.engine.models.tiny_qwen2_config``; the tuner does not import the engine: a test checks they agree).
TINY_VOCAB_SIZE = 104
_TINY = ModelShape(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=0,  # the other fields come from the config's ppotune.tiny.* (shape_of_config)
    intermediate_size=0,
    num_hidden_layers=0,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=0,
    tie_word_embeddings=False,
    model_type="qwen2",
)


@dataclass(frozen=True)
class MemoryFloor:
    """What every rank holds in every phase of a step, in bytes, and what that is, in words."""

    bytes_per_rank: float
    what: str

    @property
    def gib(self) -> float:
        return self.bytes_per_rank / GIB

    def shown(self) -> str:
        """The figure with enough digits that a cap below it does not read as equal to it."""
        return f"{_round_up(self.gib):g} GiB"


def _round_up(gib: float) -> float:
    """Up to two significant digits, rounded up: a cap at the figure shown passes the check."""
    if gib <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(gib)) - 1)
    return math.ceil(gib / scale - 1e-9) * scale


def tiny_shape(config: Mapping[str, Any]) -> Optional[ModelShape]:
    """The embedded model's shape when ``config`` (nested or flat) builds it (``actor_rollout_ref.model.path:
    tiny``), from its ``ppotune.tiny.*`` keys; None for a checkpoint (its ``config.json`` has the shape)."""
    flat = flat_config(config)
    if flat.get("actor_rollout_ref.model.path") != "tiny":
        return None
    return shape_of_config(flat, _TINY)


def memory_floor(config: Mapping[str, Any], shapes: Sequence[ModelShape], *, on_gpu: bool) -> MemoryFloor:
    """The floor of ``config`` (nested or flat) on a GPU or a CPU. ``shapes``: the actor's, and the critic's when it
    is another model; the memory terms give every role one backbone, so the smallest of them is taken for all (a
    floor must not be above what the run holds)."""
    flat = flat_config(config)
    lengths = Lengths.worst_case(int(flat["data.max_prompt_length"]), int(flat["data.max_response_length"]))
    held = min(min(t["states"] for t in phase_terms(flat, s, lengths, on_gpu=on_gpu).values()) for s in shapes)
    return MemoryFloor(bytes_per_rank=held, what=_what(flat, on_gpu))


def _what(flat: Mapping[str, Any], on_gpu: bool) -> str:
    """``the actor's, the reference's and the critic's fp32 states sharded over 2 ranks``."""
    roles = ["the actor's"]
    if not on_gpu and absent_role(flat, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu") is None:
        roles.append("the reference's")
    if absent_role(flat, "critic.ppo_micro_batch_size_per_gpu") is None:
        roles.append("the critic's")
    named = roles[0] if len(roles) == 1 else f"{', '.join(roles[:-1])} and {roles[-1]}"
    dtype = flat["actor_rollout_ref.actor.fsdp_config.model_dtype"]
    size = int(flat["actor_rollout_ref.actor.fsdp_config.fsdp_size"])
    shard = size if size not in (-1, 0) else world_of(flat)
    where = " on the GPU" if on_gpu else ""
    return f"{named} {dtype} states{where} sharded over {shard} rank{'s' if shard != 1 else ''}"


#: what every refusal below the floor says: a search reads a trial refused so as out of memory at that cap
#: (tuner.trials.launch.classify), not as a config the user got wrong
BELOW_FLOOR = "is below what a rank holds from its first step on"


def below_floor(limit_gb: float, floor: MemoryFloor, *, cap: str, source: str) -> Optional[str]:
    """The one line a cap of ``limit_gb`` GiB below the floor gets, or None when it is not below. ``cap`` names the
    key and its value (``--memory-limit-gb 0.001``), ``source`` the config file."""
    if limit_gb * GIB >= floor.bytes_per_rank:
        return None
    return f"{cap} {BELOW_FLOOR}: {floor.shown()} ({floor.what}; {source})"
