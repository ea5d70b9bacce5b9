"""FSDP's mechanics: wrapping (each transformer block, then the root), gathering, clipping, state dicts, freeing.

:func:`shard_model` is the FSDP step of trainer.engine.parallelize.parallelize, which applies a role's knobs in
order. FSDP1 = ``FullyShardedDataParallel``; FSDP2 = ``fully_shard``.
Precision and offload follow verl 0.9.1's FSDP engine (``verl/workers/engine/fsdp/transformer_impl.py``):
fp32 master weights computed in ``mixed_precision.param_dtype`` (bf16 by default), gradients reduced
in ``reduce_dtype``; ``param_offload``/``optimizer_offload`` are moves between phases
(trainer/engine/offload.py), compute-time offload is FSDP2's
CPUOffloadPolicy (``offload_policy``) or, for the reference model, always on.
Knobs that cannot act on the device at hand are not faked: they are reported in ``notes``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from trainer.engine.logits import token_entropy

__all__ = [
    "ShardKnobs",
    "Sharded",
    "shard_model",
    "full_params",
    "clip_grad_norm",
    "full_state_dict",
    "iter_full_params",
    "free_memory",
    "gradient_sync",
    "compute_autocast",
    "layer_classes",
    "clean_state_dict",
    "torch_dtype",
]


@dataclass(frozen=True)
class ShardKnobs:
    strategy: str = "fsdp"  # fsdp | fsdp2
    # Compute-time offload: FSDP1 CPUOffload / FSDP2 CPUOffloadPolicy. The actor's and critic's come
    # from offload_policy (FSDP2 only); the reference model always has it, as in verl.
    compute_offload: bool = False
    reshard_after_forward: bool = True
    forward_prefetch: bool = False
    fsdp_size: int = -1  # -1: shard over all ranks; else replicate over world/fsdp_size groups (HSDP)
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    buffer_dtype: str = "float32"
    wrap_min_num_params: int = 0


@dataclass
class Sharded:
    module: nn.Module
    strategy: str
    blocks: list = field(default_factory=list)
    reshard_after_forward: bool = True
    compute_dtype: str = "float32"
    # trainer.engine.offload.ActivationOffload, built by parallelize's offload step (CUDA, or asked on a CPU)
    activation_offload: Any = None
    # the entropy head, (logits (M, V), rows (N,)) -> (N,): parallelize's compile step makes it from the knobs
    entropy_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_entropy
    # the device the model computes on (the rank's): where its offload copies run, what free_memory waits for
    device: Optional[torch.device] = None


def layer_classes(model: nn.Module) -> set[type]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def torch_dtype(name: str) -> torch.dtype:
    """A dtype spelled as verl spells it (bf16 | fp32, or the long names)."""
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[name]


#: meshes built in this process, per (device type, shape), with the default process group they were built on
_MESHES: dict[tuple, tuple] = {}


def _mesh(device: torch.device, fsdp_size: int):
    """1-D mesh over all ranks, or (replicate, shard) for hybrid sharding (verl's create_device_mesh).

    Built once per process and shape: a hybrid mesh makes new process groups (NCCL communicators, with their
    device memory), so building one per wrapped model would leak groups in a warm job, one set per trial,
    and each later trial's peak would carry the earlier trials' communicators."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    shape = (world,) if fsdp_size in (-1, world) else (world // fsdp_size, fsdp_size)
    key = (device.type, shape)
    cached = _MESHES.get(key)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    names = ("fsdp",) if len(shape) == 1 else ("ddp", "fsdp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    _MESHES[key] = (dist.group.WORLD, mesh)
    return mesh


def shard_model(
    model: nn.Module,
    knobs: ShardKnobs,
    *,
    device: torch.device,
    name: str,
    notes: list[str],
    offload_on_cpu: bool = False,
) -> Sharded:
    """Wrap ``model`` for data-parallel sharding over the default process group: each block, then the root.

    ``model`` may live on the meta device on ranks other than 0: its parameters and buffers are then
    materialized on ``device`` and filled from rank 0 (verl's ``sync_module_states``), so host memory
    per node does not grow with ranks x model size.
    ``name`` is the config prefix of these knobs (e.g. ``actor_rollout_ref.actor.fsdp_config``),
    used in the notes that say which knob had no effect here. ``offload_on_cpu``: FSDP2's compute-time offload
    policy, unpinned, on a CPU too (the offload mechanism under test there).
    """
    on_cpu = device.type == "cpu"
    if knobs.forward_prefetch and on_cpu:
        notes.append(
            f"{name}.forward_prefetch: applied, but no effect on CPU (gloo has no compute/communication overlap)"
        )
    blocks = [m for m in model.modules() if type(m) in layer_classes(model)]
    mesh = _mesh(device, knobs.fsdp_size)
    # FSDP1's CPUOffload pins its host shards, which a CPU-only torch refuses: never on a CPU
    offload = knobs.compute_offload and (not on_cpu or (offload_on_cpu and knobs.strategy == "fsdp2"))
    if knobs.strategy == "fsdp2":
        return _shard_fsdp2(model, blocks, knobs, device=device, mesh=mesh, offload=offload, name=name, notes=notes)
    return _shard_fsdp1(model, blocks, knobs, device=device, mesh=mesh, offload=offload)


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _shard_fsdp1(model, blocks, knobs: ShardKnobs, *, device, mesh, offload: bool) -> Sharded:
    import functools

    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    if knobs.wrap_min_num_params > 0:
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=knobs.wrap_min_num_params)
    else:
        policy = ModuleWrapPolicy(layer_classes(model))
    mp = MixedPrecision(
        param_dtype=torch_dtype(knobs.param_dtype),
        reduce_dtype=torch_dtype(knobs.reduce_dtype),
        buffer_dtype=torch_dtype(knobs.buffer_dtype),
    )
    hybrid = mesh.ndim == 2
    strategy = {
        (False, True): ShardingStrategy.FULL_SHARD,
        (False, False): ShardingStrategy.SHARD_GRAD_OP,
        (True, True): ShardingStrategy.HYBRID_SHARD,
        (True, False): ShardingStrategy._HYBRID_SHARD_ZERO2,
    }[(hybrid, knobs.reshard_after_forward)]
    if hybrid and mesh.size(1) == 1:
        # Shard groups of one rank: FSDP1's hybrid strategies turn into NO_SHARD inside each group and then
        # never all-reduce across the replicas (measured: each rank trained on its half of the batch).
        # Replicating on every rank is NO_SHARD over the whole world.
        strategy, mesh = ShardingStrategy.NO_SHARD, _mesh(device, -1)
    init_fn = _rank0_broadcast_init(model, device)
    wrapped = FSDP(
        model,
        auto_wrap_policy=policy,
        device_id=device,  # the rank's device, named (start_rank makes it current, but FSDP is told, not left to guess)
        device_mesh=mesh,
        sharding_strategy=strategy,
        cpu_offload=CPUOffload(offload_params=True) if offload else None,
        mixed_precision=mp,
        forward_prefetch=knobs.forward_prefetch,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        # verl's default: one flat parameter per unit, so the optimizer, the offload moves and the gradient clip
        # each touch ~one tensor per block instead of one per original parameter
        use_orig_params=False,
        param_init_fn=init_fn,
    )
    return Sharded(wrapped, "fsdp", blocks, knobs.reshard_after_forward, knobs.param_dtype, device=device)


def _shard_fsdp2(model, blocks, knobs: ShardKnobs, *, device, mesh, offload: bool, name: str, notes) -> Sharded:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=torch_dtype(knobs.param_dtype),
        reduce_dtype=torch_dtype(knobs.reduce_dtype),
        cast_forward_inputs=True,
    )
    if knobs.buffer_dtype not in ("fp32", "float32"):
        notes.append(f"{name}.mixed_precision.buffer_dtype: FSDP2 has no buffer dtype; buffers stay as loaded")
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    if knobs.wrap_min_num_params > 0:
        notes.append(
            f"{name}.wrap_policy.min_num_params: FSDP2 shards per transformer block; size-based wrapping ignored"
        )
    # rank 0 keeps the full weights until they are scattered; other ranks hold meta tensors
    full = model.state_dict() if dist.get_rank() == 0 else {}
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=policy)
    for block in blocks:
        fully_shard(block, reshard_after_forward=knobs.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=knobs.reshard_after_forward, **kwargs)
    if knobs.forward_prefetch:
        # FSDP2's explicit prefetch: block i starts all-gathering block i+1 before its own forward ends.
        for cur, nxt in zip(blocks, blocks[1:]):
            cur.set_modules_to_forward_prefetch([nxt])
    home = torch.device("cpu") if offload else device
    if _on_meta(model):
        model.to_empty(device=home)
    elif not offload:
        model.to(device)
    _fill_from_rank0(model, full, device)
    return Sharded(model, "fsdp2", blocks, knobs.reshard_after_forward, knobs.param_dtype, device=device)


def _rank0_broadcast_init(model: nn.Module, device: torch.device):
    """FSDP1's ``param_init_fn`` that fills each module from rank 0 as FSDP wraps it, unit by unit.

    Every rank's model goes to the meta device (rank 0 keeps its real tensors aside: a rank that built
    real weights too, as in an old-style load, has them replaced by rank 0's); FSDP1 materializes
    the modules of one unit at a time through this function, which copies rank 0's tensors in and
    broadcasts them, then shards the unit before the next. So a rank other than 0 never holds more than
    one unit in full (verl's ``sync_module_states=True`` does the same on a GPU, but FSDP1 refuses it for
    modules on the CPU; this one path serves both). Tied parameters (an LM head tied to the embedding)
    stay one parameter: materializing gives each module its own tensor, so the second is re-pointed.
    """
    rank0 = dist.get_rank() == 0
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    real = {k: v.detach() for k, v in named} if rank0 else {}
    tie = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}  # tied names share an id
    model.to("meta")  # on rank 0 ``real`` holds the storage; elsewhere whatever was built is dropped
    prefix = {m: name for name, m in model.named_modules()}
    filled: dict[int, nn.Parameter] = {}

    def init(module: nn.Module) -> None:
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                key = f"{prefix[module]}.{name}" if prefix[module] else name
                if tie.get(key) in filled:
                    setattr(module, name, filled[tie[key]])
                    continue
                if rank0:
                    t.copy_(real[key])
                dist.broadcast(t, src=0)
                if key in tie:
                    filled[tie[key]] = t
        if rank0:
            for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                real.pop(f"{prefix[module]}.{name}" if prefix[module] else name, None)

    return init


def _fill_from_rank0(module: nn.Module, full: dict, device: torch.device) -> None:
    """Every rank's shards from rank 0's full state dict (``full`` is empty elsewhere), then the buffers
    (e.g. rotary frequencies, not in the state dict) that ``to_empty`` left unset on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full.clear()
    for buf in module.buffers():
        staged = buf.to(device)
        dist.broadcast(staged, src=0)
        if staged is not buf:
            buf.copy_(staged)


@contextlib.contextmanager
def full_params(sharded: Sharded):
    """Full, unsharded weights for generation, gathered ONCE per call; yields the module whose ``generate`` to call.

    FSDP1: ``summon_full_params`` gathers every unit, and the FSDP-wrapped blocks are swapped for the
    modules they wrap for the duration: called through their wrappers, they would re-gather (and
    free) their parameters on every decoded token (see docs/decisions.md#gather-once-for-generation).
    FSDP2: unshard every group once and keep it unsharded across the many small forwards of decoding.
    """
    if sharded.strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # Summoned parameters are the fp32 masters: autocast makes every matmul use the compute dtype.
        device_type = next(sharded.module.parameters()).device.type
        with (
            FSDP.summon_full_params(sharded.module, writeback=False, recurse=True),
            compute_autocast(sharded, device_type),
            _unwrapped_units(sharded.module.module),
        ):
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


@contextlib.contextmanager
def _unwrapped_units(module: nn.Module):
    """Every FSDP1 unit inside ``module`` replaced by the module it wraps (restored on exit)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    swaps = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, FSDP)
    ]
    for parent, name, child in swaps:
        parent._modules[name] = child.module
    try:
        yield
    finally:
        for parent, name, child in swaps:
            parent._modules[name] = child


def clip_grad_norm(sharded: Sharded, max_norm: float, device: torch.device) -> torch.Tensor:
    """Total grad norm over all shards (clipped in place); a 0-d tensor on ``device``.

    FSDP2: the norm is summed from the local shards on the compute device (the gradients may be CPU
    DTensors under CPUOffloadPolicy, which the process group cannot reduce) over the mesh dims the
    gradients are sharded on, then every local gradient is scaled in place (verl's fsdp2_clip_grad_norm_).
    """
    if sharded.strategy == "fsdp":
        return sharded.module.clip_grad_norm_(max_norm).to(device)
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    grads = [p.grad for p in sharded.module.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    # the local shards as they are (DTensor.to_local() would dispatch an op per parameter: ~300 at 24 layers)
    local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    # torch's foreach norm (grouped by device and dtype: a few kernels, not a chain per parameter), as verl's
    # fsdp2_clip_grad_norm_; the local sum of squares is then summed over the shards
    sq = torch.nn.utils.get_total_norm(local, 2.0, foreach=True).to(device, non_blocking=True).float().pow(2)
    if isinstance(grads[0], DTensor):
        placements = [Partial() if isinstance(pl, Shard) else Replicate() for pl in grads[0].placements]
        sq = DTensor.from_local(sq, grads[0].device_mesh, placements).full_tensor()
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for dev in {g.device for g in local}:
        group = [g for g in local if g.device == dev]
        # host gradients (CPUOffloadPolicy) need the coefficient on the host now: a blocking copy, as in verl
        torch._foreach_mul_(group, coef.to(dev, non_blocking=dev.type != "cpu"))
    return norm


def full_state_dict(sharded: Sharded, *, device: torch.device) -> dict | None:
    """The full state dict on rank 0 (None elsewhere); every rank must call it."""
    if sharded.strategy == "fsdp":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # offload_to_cpu=True segfaults on a CPU-only FSDP1 run; it only matters on GPU
        # (docs/decisions.md#fsdp1-state-dict-on-cpu)
        cfg = FullStateDictConfig(offload_to_cpu=device.type != "cpu", rank0_only=True)
        with FSDP.state_dict_type(sharded.module, StateDictType.FULL_STATE_DICT, cfg):
            sd = sharded.module.state_dict()
        return sd if dist.get_rank() == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(
        sharded.module, options=StateDictOptions(full_state_dict=True, cpu_offload=device.type != "cpu")
    )
    return sd if dist.get_rank() == 0 else None


def iter_full_params(sharded: Sharded, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` for every entry of the model's state dict, gathered ONE tensor (FSDP2)
    or one FSDP unit (FSDP1) at a time, never the whole model: what a colocated rollout engine loads
    each step (verl's ``get_per_tensor_param``). Every rank must iterate to the end, in step: each item
    is a collective. Every yielded tensor owns its storage (a consumer may keep it).
    """
    if sharded.strategy == "fsdp2":
        from torch.distributed.tensor import DTensor

        for name, value in sharded.module.state_dict().items():
            if isinstance(value, DTensor):
                # with offload_policy the shard lives in host memory: gather on the compute device
                value = value.to(device).full_tensor()
            yield _clean_name(name), value.detach()
        return
    from torch.distributed.fsdp import FlatParameter
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    root = sharded.module
    prefixes = {id(m): name for name, m in root.named_modules()}
    for unit in FSDP.fsdp_modules(root):
        prefix = prefixes[id(unit)]
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            # inside, the unit's original parameters are registered again (full); nested units stay flat
            for name, p in unit.named_parameters():
                if isinstance(p, FlatParameter):
                    continue
                # a copy: the summoned view is freed when the unit reshards, and vLLM may keep a tensor
                # until a later one completes its layer
                yield _clean_name(f"{prefix}.{name}" if prefix else name), p.detach().clone()
    for prefix, module in root.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:  # as state_dict() keeps them
                yield _clean_name(f"{prefix}.{name}" if prefix else name), buf


def _clean_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def clean_state_dict(sd: dict) -> dict:
    """Plain HF parameter names (no FSDP / checkpoint wrapper prefixes), tensors on CPU."""
    return {_clean_name(k): v.detach().cpu() for k, v in sd.items()}


def free_memory(sharded: Sharded, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Give back the memory of a model whose run is over: the storage of every parameter, gradient, buffer,
    FSDP1 flat-parameter buffer and optimizer moment is resized to 0. The module must not be used again.

    Dropping the last reference is not enough: torch's FSDP1 keeps each FlatParameter (its whole local
    shard) alive after its module is gone, reachable from no Python object; in a warm job each trial then
    added its models to the memory of every later one (see docs/decisions.md#free-fsdp1-flat-params).
    """
    from torch.distributed.tensor import DTensor

    if sharded.device is not None and sharded.device.type == "cuda":
        # non-blocking offload copies into host memory land before their storage goes
        torch.cuda.synchronize(sharded.device)
    tensors: list[torch.Tensor] = []

    def add(t) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, torch.Tensor) and not t.is_meta:
            tensors.append(t)

    for t in (*sharded.module.parameters(), *sharded.module.buffers()):
        add(t)
        add(t.grad)
    for m in sharded.module.modules():
        handle = getattr(m, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if flat is not None:  # FSDP1: the flat parameter and the buffers FSDP hangs on it (_mp_shard, ...)
            add(flat)
            add(flat.grad)
            for value in vars(flat).values():
                add(value)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
        optimizer.state.clear()
    for t in tensors:
        try:
            t.untyped_storage().resize_(0)
        except RuntimeError:  # a storage that cannot be resized (not allocated by torch): left to its owner
            pass


@contextlib.contextmanager
def gradient_sync(sharded: Sharded, enabled: bool):
    """``use_no_sync_for_gradient_accumulation``: skip the gradient reduce on a non-final micro-batch."""
    if enabled:
        yield
    elif sharded.strategy == "fsdp":
        with sharded.module.no_sync():
            yield
    else:
        sharded.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.module.set_requires_gradient_sync(True)


def compute_autocast(sharded: Sharded, device_type: str):
    """verl runs every forward under autocast to the mixed-precision param dtype (none for fp32)."""
    if sharded.compute_dtype in ("fp32", "float32"):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch_dtype(sharded.compute_dtype))
