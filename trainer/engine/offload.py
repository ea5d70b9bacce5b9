"""The offload knobs that act around a role's passes, as verl's FSDP engine does them: ``param_offload`` and
``optimizer_offload`` move the parameter shards and Adam's moments between phases (:func:`move_params`,
:func:`move_optimizer_state`, used by trainer.engine.roles.resident), ``enable_activation_offload`` sends what a
training forward saves for backward to host memory (:func:`activation_offload_context`). On a GPU every copy is
``non_blocking``, from or into pinned memory, in stream order: none makes the host wait. On a CPU there is no
device to offload from: the moves are no-ops and activation offload is off, unless a caller asks for the
mechanism (``copy=True`` / ``on_cpu=True``: every move a real copy into fresh host memory, as a device move would
be; the invariance suite runs every offload knob that way on a CPU).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from trainer.engine.parallel import Sharded

__all__ = [
    "move_params",
    "move_optimizer_state",
    "empty_device_cache",
    "activation_offload_context",
    "ActivationOffload",
]


def move_params(sharded: Sharded, device: torch.device, *, copy: bool = False) -> None:
    """``param_offload``: move this rank's parameter shards to ``device`` (host between phases, GPU before).

    As verl's offload_fsdp_model_to_cpu / load_fsdp_model_to_gpu: one copy per FSDP1 flat parameter (per FSDP2
    parameter), ``non_blocking`` on a GPU (a device-to-host copy lands in pinned memory, which makes the way
    back asynchronous too; both run in stream order, so the next phase's kernels see the data). FSDP2 modules
    support ``.to()`` (FSDP2 re-registers its sharded parameters); FSDP1 has no public API for it: the flat
    parameter's local shard is moved. ``copy``: a real copy even where the shards already are (a CPU run that
    exercises the mechanism).
    """
    on_cuda = _on_cuda(sharded)
    _relocate_params(sharded, lambda t: t.to(device, non_blocking=device.type == "cuda" or on_cuda, copy=copy))
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


def move_optimizer_state(
    optimizer: torch.optim.Optimizer, device: Optional[torch.device], *, copy: bool = False
) -> None:
    """``optimizer_offload``: Adam's moments to ``device`` (host between updates); ``None`` = to the device
    of each moment's parameter (before a step: never a CUDA moment for a CPU parameter or back). On a GPU the
    copies are ``non_blocking`` (verl's offload_fsdp_optimizer / load_fsdp_optimizer). ``copy``: a real copy
    even where a moment already is."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            target = device if device is not None else p.device
            for k, v in state.items():
                # Adam keeps ``step`` as a host scalar by design (capturable=False): leave it
                if k != "step" and isinstance(v, torch.Tensor) and (copy or v.device != target):
                    state[k] = v.to(target, non_blocking=True, copy=copy)


def activation_offload_context(
    enabled: bool, device: torch.device, sharded: Optional[Sharded] = None, *, on_cpu: bool = False
):
    """``enable_activation_offload``: what a training forward saves for backward inside the decoder blocks goes to
    pinned host memory and comes back for backward, both copies ``non_blocking`` on the compute stream (no host
    wait), the weights a layer saves excepted (verl's activation offload groups the decoder layers and skips FSDP
    parameters too; what the root saves, the LM head's logits among it, stays on the device in both; torch's
    ``save_on_cpu`` copies everything, weights too, with a blocking copy each). CUDA only: on a CPU the
    activations are in host memory already, unless ``on_cpu`` asks for the same hooks there (each saved tensor
    copied out and back)."""
    if not enabled or (device.type != "cuda" and not on_cpu):
        return contextlib.nullcontext()
    if sharded is None:
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    if sharded.activation_offload is None:
        sharded.activation_offload = ActivationOffload(sharded.blocks)
    return sharded.activation_offload


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """What the ``blocks`` save to host memory and back (see :func:`activation_offload_context`), each distinct
    tensor once per forward. A forward pre-hook on every block notes the storages of its gathered parameters while
    the block's forward runs (a forward hook forgets them), so the weights its layers save stay where they are
    (verl notes them the same way, per layer); outside a block nothing moves.

    A host copy belongs to the tensor object it was made from (a weak reference: its entry goes when the tensor
    does), never to an address: the allocator hands a freed tensor's address to the next one of its size, which
    must get its own copy. A noted weight storage is alive while its unit runs, so no activation shares its address
    then (tests/trainer/engine/test_offload.py forces the reuse)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__(self._pack, self._unpack)
        self.active = False
        self.weights: Counter[int] = Counter()  # storage address -> blocks now running that hold it
        self.noted: dict[nn.Module, list[int]] = {}  # the blocks now running -> the storages they noted
        self.copies: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.hooks = [block.register_forward_pre_hook(self._note_weights) for block in blocks]
        self.hooks += [block.register_forward_hook(self._forget_weights) for block in blocks]

    def __enter__(self):
        self.active, self.weights, self.noted, self.copies = True, Counter(), {}, WeakIdKeyDictionary()
        return super().__enter__()

    def __exit__(self, *exc):
        self.active, self.weights, self.noted, self.copies = False, Counter(), {}, WeakIdKeyDictionary()
        return super().__exit__(*exc)

    def _note_weights(self, module: nn.Module, args) -> None:
        if self.active:
            storages = [s for s in (_storage(p) for p in module.parameters()) if s is not None]
            self.noted[module] = storages
            self.weights.update(storages)

    def _forget_weights(self, module: nn.Module, args, output) -> None:
        self.weights.subtract(self.noted.pop(module, []))
        self.weights = +self.weights  # drop the storages no running block holds

    def offloads(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to the host: saved inside a block, a dense tensor that is no parameter and shares no
        parameter's storage."""
        if not self.noted or t.layout != torch.strided or isinstance(t, nn.Parameter) or type(t) is not torch.Tensor:
            return False
        storage = _storage(t)
        return storage is not None and storage not in self.weights

    def _pack(self, t: torch.Tensor):
        if not self.offloads(t):
            return t
        host = self.copies.get(t)
        if host is None:
            pin = t.device.type == "cuda"
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            self.copies[t] = host
        return (t.device, host)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, tuple):
            device, host = packed
            # a fresh tensor per unpack, also on a CPU: a backward may write into what it unpacked
            return host.to(device, non_blocking=host.is_pinned(), copy=True)
        return packed


def _storage(t: torch.Tensor) -> Optional[int]:
    """The address of a plain tensor's storage (None for tensor subclasses such as a sharded DTensor)."""
    if type(t) not in (torch.Tensor, nn.Parameter):
        return None
    return t.untyped_storage().data_ptr()
