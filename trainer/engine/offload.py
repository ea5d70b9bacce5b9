"""The offload knobs that act around a role's passes, as verl's FSDP engine does them: ``param_offload`` and
``optimizer_offload`` move the parameter shards and Adam's moments between phases (:func:`move_params`,
:func:`move_optimizer_state`, used by trainer.engine.roles.resident), ``enable_activation_offload`` sends what a
training forward saves for backward to host memory (:func:`activation_offload_context`). On a GPU every copy is
``non_blocking``, from or into pinned memory, in stream order: none makes the host wait. On a CPU there is no
device to offload from: the moves are no-ops and activation offload is off.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch import nn

from trainer.engine.parallel import Sharded

__all__ = [
    "move_params",
    "move_optimizer_state",
    "empty_device_cache",
    "activation_offload_context",
    "ActivationOffload",
]


def move_params(sharded: Sharded, device: torch.device) -> None:
    """``param_offload``: move this rank's parameter shards to ``device`` (host between phases, GPU before).

    As verl's offload_fsdp_model_to_cpu / load_fsdp_model_to_gpu: one copy per FSDP1 flat parameter (per FSDP2
    parameter), ``non_blocking`` on a GPU (a device-to-host copy lands in pinned memory, which makes the way
    back asynchronous too; both run in stream order, so the next phase's kernels see the data). FSDP2 modules
    support ``.to()`` (FSDP2 re-registers its sharded parameters); FSDP1 has no public API for it: the flat
    parameter's local shard is moved.
    """
    on_cuda = _on_cuda(sharded)
    _relocate_params(sharded, lambda t: t.to(device, non_blocking=device.type == "cuda" or on_cuda))
    if on_cuda and device.type == "cpu":
        empty_device_cache()  # verl's offload_fsdp_model_to_cpu(empty_cache=True): NVML sees the shards go


def empty_device_cache() -> None:
    """Give the CUDA allocator's cached free blocks back to the device, where verl does (after a model offload,
    around the rollout's weight sync): what NVML reads, and what a colocated vLLM engine can take, then matches
    verl's. It waits for the device (cudaFree does), as verl's call does. A no-op without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _on_cuda(sharded: Sharded) -> bool:
    return any(p.device.type == "cuda" for p in sharded.module.parameters())


def _relocate_params(sharded: Sharded, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    if sharded.strategy == "fsdp2":
        with torch.no_grad():
            sharded.module._apply(fn)  # FSDPModule._apply resets the sharded parameters after the move
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for m in sharded.module.modules():
        handle = getattr(m, "_handle", None) if isinstance(m, FSDP) else None
        if handle is None or handle._offload_params:  # CPUOffload already keeps it in host memory
            continue
        flat = handle.flat_param
        flat.data = fn(flat.data)
        if hasattr(flat, "_local_shard"):
            flat._local_shard = flat.data
        if handle._use_orig_params:  # original parameters re-pointed, so no view keeps the old storage alive
            handle._use_sharded_views()


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: Optional[torch.device]) -> None:
    """``optimizer_offload``: Adam's moments to ``device`` (host between updates); ``None`` = to the device
    of each moment's parameter (before a step: never a CUDA moment for a CPU parameter or back). On a GPU the
    copies are ``non_blocking`` (verl's offload_fsdp_optimizer / load_fsdp_optimizer)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            target = device if device is not None else p.device
            for k, v in state.items():
                # Adam keeps ``step`` as a host scalar by design (capturable=False): leave it
                if k != "step" and isinstance(v, torch.Tensor) and v.device != target:
                    state[k] = v.to(target, non_blocking=True)


def activation_offload_context(enabled: bool, device: torch.device, sharded: Optional[Sharded] = None):
    """``enable_activation_offload``: what a training forward saves for backward goes to pinned host memory and
    comes back for backward, both copies ``non_blocking`` on the compute stream (no host wait), the weights a
    layer saves excepted (verl's activation offload skips FSDP parameters too; torch's ``save_on_cpu`` copies
    them as well, with a blocking copy each). CUDA only: on a CPU the activations are in host memory already."""
    if not enabled or device.type != "cuda":
        return contextlib.nullcontext()
    if sharded is None:
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if sharded.activation_offload is None:
        sharded.activation_offload = ActivationOffload(_units(sharded))
    return sharded.activation_offload


def _units(sharded: Sharded) -> list[nn.Module]:
    """The modules whose forward runs with their own parameters gathered: each block (FSDP1: the module a unit
    wraps) and the root (FSDP1: the module the root wraps)."""
    root = sharded.module.module if sharded.strategy == "fsdp" else sharded.module
    return [root, *sharded.blocks]


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors to host memory and back (see :func:`activation_offload_context`), each distinct tensor once
    per forward. A forward pre-hook on every unit notes the storages of its gathered parameters as it starts,
    so the weights its layers save stay where they are (verl notes them the same way, per layer)."""

    def __init__(self, units: list[nn.Module]) -> None:
        super().__init__(self._pack, self._unpack)
        self.active = False
        self.weights: set[int] = set()
        self.copies: dict[tuple, torch.Tensor] = {}
        self.hooks = [unit.register_forward_pre_hook(self._note_weights) for unit in units]

    def __enter__(self):
        self.active, self.weights, self.copies = True, set(), {}
        return super().__enter__()

    def __exit__(self, *exc):
        self.active, self.copies = False, {}
        return super().__exit__(*exc)

    def _note_weights(self, module: nn.Module, args) -> None:
        if self.active:
            self.weights.update(_storage(p) for p in module.parameters() if _storage(p) is not None)

    def offloads(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to the host: a dense tensor that is no parameter and shares no parameter's storage."""
        if t.layout != torch.strided or isinstance(t, nn.Parameter) or type(t) is not torch.Tensor:
            return False
        storage = _storage(t)
        return storage is not None and storage not in self.weights

    def _pack(self, t: torch.Tensor):
        if not self.offloads(t):
            return t
        key = (_storage(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        host = self.copies.get(key)
        if host is None:
            pin = t.device.type == "cuda"
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            self.copies[key] = host
        return (t.device, host)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=host.is_pinned())
        return packed


def _storage(t: torch.Tensor) -> Optional[int]:
    """The address of a plain tensor's storage (None for tensor subclasses such as a sharded DTensor)."""
    if type(t) not in (torch.Tensor, nn.Parameter):
        return None
    return t.untyped_storage().data_ptr()
