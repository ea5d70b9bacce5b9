"""The knobs that transform a role's model, applied in one ordered place: :func:`parallelize` (torch).

The order is torchtitan's ``parallelize_*``, one named step each:

1. :func:`apply_checkpointing`: activation checkpointing of the transformer blocks (before wrapping: FSDP
   then shards the checkpointed blocks);
2. :func:`apply_compile`: the entropy head chunked, ``torch.compile``'d and checkpointed as verl builds it
   (the model itself is not compiled, as in verl's FSDP engine);
3. :func:`apply_fsdp`: each transformer block sharded, then the root (trainer/engine/parallel.py holds the FSDP1 /
   FSDP2 mechanics, compute-time offload among them);
4. :func:`apply_offload`: ``param_offload``'s shards to host memory from the start (as verl offloads them at
   init), ``enable_activation_offload``'s hooks on the layers (trainer/engine/offload.py), where verl's
   ``enable_activation_offloading`` puts them: after the wrapping, off below three layers, and with gradient
   checkpointing on, HF's checkpointing swapped for a reentrant checkpoint per layer inside the hooks.

What acts around each pass afterwards (the moves between phases, the offload context) is
trainer.engine.roles.resident's and trainer.engine.passes'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from trainer.engine.knob_notes import few_layers_offload_note
from trainer.engine.logits import entropy_stats, token_entropy
from trainer.engine.offload import (
    MIN_OFFLOAD_LAYERS,
    ActivationOffload,
    checkpoint_forward,
    move_params,
    offload_layers,
)
from trainer.engine.parallel import Sharded, ShardKnobs, shard_model

__all__ = [
    "ModelKnobs",
    "parallelize",
    "apply_checkpointing",
    "apply_compile",
    "apply_fsdp",
    "apply_offload",
    "make_entropy_fn",
    "compiled_entropy",
]


@dataclass(frozen=True)
class ModelKnobs:
    """Every knob that transforms one role's model, grouped by the step of :func:`parallelize` that applies it."""

    shard: ShardKnobs = field(default_factory=ShardKnobs)  # apply_fsdp
    gradient_checkpointing: bool = False  # apply_checkpointing
    # apply_compile: the entropy head (the actor's); chunk None = trainer.engine.logits' bounded share
    entropy_chunk_size: Optional[int] = None
    entropy_checkpointing: bool = False
    compile_entropy: bool = False
    # apply_offload
    param_offload: bool = False
    activation_offload: bool = False
    # the offload knobs run their mechanism on a CPU too (real copies, the hooks, FSDP2's policy unpinned)
    offload_on_cpu: bool = False


def parallelize(model: nn.Module, knobs: ModelKnobs, *, device: torch.device, name: str, notes: list[str]) -> Sharded:
    """``model`` transformed by ``knobs``, in order: checkpointing -> compile -> shard blocks then root -> offload.

    ``name`` is the config prefix of the FSDP knobs (e.g. ``actor_rollout_ref.actor.fsdp_config``), used in the
    ``notes`` that say which knob had no effect here."""
    apply_checkpointing(model, knobs)
    entropy_fn = apply_compile(knobs)
    sharded = apply_fsdp(model, knobs, device=device, name=name, notes=notes)
    sharded.entropy_fn = entropy_fn
    apply_offload(sharded, knobs, device, name=name, notes=notes)
    return sharded


def apply_checkpointing(model: nn.Module, knobs: ModelKnobs) -> None:
    """``enable_gradient_checkpointing``: the blocks recompute their activations in backward (HF's own switch,
    non-reentrant as verl sets it). With activation offload acting too, :func:`apply_offload` swaps it for verl's
    reentrant checkpoint per layer once the model is wrapped, as verl does after its wrapping."""
    if knobs.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_compile(knobs: ModelKnobs) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The entropy head as the knobs build it (``use_torch_compile``, ``entropy_checkpointing``, chunking)."""
    return make_entropy_fn(
        chunk_size=knobs.entropy_chunk_size, checkpointing=knobs.entropy_checkpointing, compile=knobs.compile_entropy
    )


def apply_fsdp(model: nn.Module, knobs: ModelKnobs, *, device: torch.device, name: str, notes: list[str]) -> Sharded:
    """FSDP1 or FSDP2 over the default process group: every block a unit, then the root."""
    return shard_model(model, knobs.shard, device=device, name=name, notes=notes, offload_on_cpu=knobs.offload_on_cpu)


def apply_offload(
    sharded: Sharded, knobs: ModelKnobs, device: torch.device, *, name: str = "", notes: Optional[list[str]] = None
) -> None:
    """``param_offload``: the shards wait in host memory from the start (a colocated vLLM engine, built after the
    models, then sees the device without them). ``enable_activation_offload``: verl 0.9.1's
    ``utils/activation_offload.py::enable_activation_offloading`` after the wrapping: the layers it finds
    (trainer.engine.offload.offload_layers); fewer than three, and it turns the offload off (said in ``notes``);
    else the hooks that make each layer's saves a group (the offload itself runs inside a training forward), and
    with ``enable_gradient_checkpointing`` on, HF's checkpointing switched off and each layer's forward a reentrant
    checkpoint inside them (``offload.checkpoint_forward``), so each layer's input goes to host memory too. On a CPU
    neither acts unless ``offload_on_cpu``. ``name``: the FSDP knobs' config prefix, whose role the note names."""
    if knobs.param_offload and (device.type != "cpu" or knobs.offload_on_cpu):
        move_params(sharded, torch.device("cpu"), copy=knobs.offload_on_cpu)
    if not knobs.activation_offload or (device.type != "cuda" and not knobs.offload_on_cpu):
        return
    layers = offload_layers(sharded)
    if len(layers) < MIN_OFFLOAD_LAYERS:
        if notes is not None:
            notes.append(few_layers_offload_note("critic" if name.startswith("critic") else "actor", len(layers)))
        return
    if knobs.gradient_checkpointing:
        for module in sharded.module.modules():  # as verl: every module that has HF's switch
            if hasattr(module, "gradient_checkpointing_disable"):
                module.gradient_checkpointing_disable()
        for layer in layers:
            checkpoint_forward(layer)
    sharded.activation_offload = ActivationOffload(layers)


def make_entropy_fn(*, chunk_size: Optional[int], checkpointing: bool, compile: bool):
    """The actor's entropy function ``fn(logits (M, V), rows (N,)) -> (N,)`` as verl builds it: chunked over tokens
    (``chunk_size`` rows at a time; None: trainer.engine.logits' bounded share), torch.compile'd, and under autograd
    optionally checkpointed (the chunks recomputed in backward).

    Compiled once per process and shape family: :func:`compiled_entropy` is one graph for any chunk's row count
    (dynamic shapes), the chunks are its calls from Python. (verl compiles its chunked loop whole, which dynamo
    unrolls and recompiles for every new number of chunks, up to its recompile limit.) A warm job keeps it for its
    later trials (trainer/rank/serve.py does not reset dynamo)."""
    stats = compiled_entropy() if compile else entropy_stats
    fn = functools.partial(token_entropy, chunk_size=chunk_size, stats=stats)
    if not checkpointing:
        return fn

    def checkpointed(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return fn(logits, rows)
        return torch.utils.checkpoint.checkpoint(fn, logits, rows, use_reentrant=False)

    return checkpointed


_COMPILED: dict[str, Callable] = {}


def compiled_entropy() -> Callable[[torch.Tensor], torch.Tensor]:
    """``torch.compile(entropy_stats, dynamic=True)`` (a chunk's per-row log-sum-exp and entropy, fused), made once
    per process (compiled at its first call)."""
    if "entropy" not in _COMPILED:
        _COMPILED["entropy"] = torch.compile(entropy_stats, dynamic=True)
    return _COMPILED["entropy"]
