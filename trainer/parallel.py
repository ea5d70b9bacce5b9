"""FSDP wrapping, one ordered apply step whose arguments are exactly the tuned knobs.

activation checkpointing -> shard each transformer block -> shard the root
(torchtitan's parallelize order). FSDP1 = ``FullyShardedDataParallel``; FSDP2 = ``fully_shard``.
Knobs that cannot act on the device at hand are not faked: they are reported in ``notes``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ShardKnobs",
    "shard_model",
    "full_params",
    "clip_grad_norm",
    "full_state_dict",
    "offload_optimizer_state",
    "activation_offload_context",
    "layer_classes",
    "clean_state_dict",
]


@dataclass(frozen=True)
class ShardKnobs:
    strategy: str = "fsdp"  # fsdp | fsdp2
    param_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    forward_prefetch: bool = False
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    wrap_min_num_params: int = 0


@dataclass
class Sharded:
    module: nn.Module
    strategy: str
    blocks: list = field(default_factory=list)
    reshard_after_forward: bool = True
    compute_dtype: str = "float32"


def layer_classes(model: nn.Module) -> set[type]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def shard_model(model: nn.Module, knobs: ShardKnobs, *, device: torch.device, name: str, notes: list[str]) -> Sharded:
    """Wrap ``model`` for data-parallel sharding over the default process group.

    ``name`` is the config prefix of these knobs (e.g. ``actor_rollout_ref.actor.fsdp_config``),
    used in the notes that say which knob had no effect here.
    """
    on_cpu = device.type == "cpu"
    offload = knobs.param_offload or knobs.offload_policy
    if offload and on_cpu:
        for k in ("param_offload", "offload_policy"):
            if getattr(knobs, k):
                notes.append(f"{name}.{k}: no effect on CPU (parameters already live in host memory)")
    if knobs.forward_prefetch and on_cpu:
        notes.append(
            f"{name}.forward_prefetch: applied, but no effect on CPU (gloo has no compute/communication overlap)"
        )
    if knobs.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = [m for m in model.modules() if type(m) in layer_classes(model)]
    if knobs.strategy == "fsdp2":
        return _shard_fsdp2(model, blocks, knobs, device=device, offload=offload and not on_cpu, name=name, notes=notes)
    return _shard_fsdp1(model, blocks, knobs, device=device, offload=offload and not on_cpu)


def _shard_fsdp1(model, blocks, knobs: ShardKnobs, *, device, offload: bool) -> Sharded:
    import functools

    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    if knobs.wrap_min_num_params > 0:
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=knobs.wrap_min_num_params)
    else:
        policy = ModuleWrapPolicy(layer_classes(model))
    mp = None
    if knobs.dtype != "float32":
        mp = MixedPrecision(param_dtype=_dtype(knobs.dtype), reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    wrapped = FSDP(
        model,
        auto_wrap_policy=policy,
        device_id=device if device.type == "cpu" else torch.cuda.current_device(),
        sharding_strategy=ShardingStrategy.FULL_SHARD
        if knobs.reshard_after_forward
        else ShardingStrategy.SHARD_GRAD_OP,
        cpu_offload=CPUOffload(offload_params=True) if offload else None,
        mixed_precision=mp,
        forward_prefetch=knobs.forward_prefetch,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        use_orig_params=True,  # needed to generate from summoned full parameters
        sync_module_states=False,  # every rank builds or loads the same weights
    )
    return Sharded(wrapped, "fsdp", blocks, knobs.reshard_after_forward, knobs.dtype)


def _shard_fsdp2(model, blocks, knobs: ShardKnobs, *, device, offload: bool, name: str, notes: list[str]) -> Sharded:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (
        MixedPrecisionPolicy(param_dtype=_dtype(knobs.dtype), reduce_dtype=torch.float32)
        if knobs.dtype != "float32"
        else MixedPrecisionPolicy()
    )
    policy = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
    if knobs.wrap_min_num_params > 0:
        notes.append(
            f"{name}.wrap_policy.min_num_params: FSDP2 shards per transformer block; size-based wrapping ignored"
        )
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=policy)
    for block in blocks:
        fully_shard(block, reshard_after_forward=knobs.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=knobs.reshard_after_forward, **kwargs)
    if knobs.forward_prefetch:
        # FSDP2's explicit prefetch: block i starts all-gathering block i+1 before its own forward ends.
        for cur, nxt in zip(blocks, blocks[1:]):
            cur.set_modules_to_forward_prefetch([nxt])
    return Sharded(model, "fsdp2", blocks, knobs.reshard_after_forward, knobs.dtype)


@contextlib.contextmanager
def full_params(sharded: Sharded):
    """Full, unsharded weights for generation; yields the module whose ``generate`` to call.

    FSDP1: ``summon_full_params`` (no writeback). FSDP2: unshard every group once and keep it
    unsharded across the many small forwards of decoding (about 2x faster than re-gathering).
    """
    if sharded.strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # Summoned parameters are the fp32 masters while the wrapped blocks still cast their inputs to
        # the mixed-precision dtype: autocast makes every matmul agree on the compute dtype.
        device_type = next(sharded.module.parameters()).device.type
        mixed = sharded.compute_dtype != "float32"
        autocast = (
            torch.autocast(device_type, dtype=_dtype(sharded.compute_dtype)) if mixed else contextlib.nullcontext()
        )
        with FSDP.summon_full_params(sharded.module, writeback=False, recurse=True), autocast:
            yield sharded.module.module
        return
    groups = [sharded.module] + list(sharded.blocks)
    for g in groups:
        g.set_reshard_after_forward(False)
    for g in groups:
        g.unshard()
    try:
        yield sharded.module
    finally:
        for g in groups:
            g.reshard()
        for g in groups:
            g.set_reshard_after_forward(sharded.reshard_after_forward)


def clip_grad_norm(sharded: Sharded, max_norm: float) -> torch.Tensor:
    """Total grad norm over all shards (clipped in place); a 0-d tensor."""
    if sharded.strategy == "fsdp":
        return sharded.module.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_([p for p in sharded.module.parameters() if p.grad is not None], max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_state_dict(sharded: Sharded, *, device: torch.device) -> dict | None:
    """The full state dict on rank 0 (None elsewhere); every rank must call it."""
    if sharded.strategy == "fsdp":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # offload_to_cpu=True segfaults on a CPU-only FSDP1 run (measured); it only matters on GPU.
        cfg = FullStateDictConfig(offload_to_cpu=device.type != "cpu", rank0_only=True)
        with FSDP.state_dict_type(sharded.module, StateDictType.FULL_STATE_DICT, cfg):
            sd = sharded.module.state_dict()
        return sd if dist.get_rank() == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(
        sharded.module, options=StateDictOptions(full_state_dict=True, cpu_offload=device.type != "cpu")
    )
    return sd if dist.get_rank() == 0 else None


def clean_state_dict(sd: dict) -> dict:
    """Plain HF parameter names (no FSDP / checkpoint wrapper prefixes), tensors on CPU."""
    return {
        k.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""): v.detach().cpu()
        for k, v in sd.items()
    }


def offload_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move optimizer state (Adam moments) to ``device``: CPU between updates, back before a step."""
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device != device and k != "step":
                state[k] = v.to(device, non_blocking=True)


def activation_offload_context(enabled: bool, device: torch.device):
    """Saved activations go to pinned host memory during backward-bearing forwards (CUDA only)."""
    if enabled and device.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()
