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
import functools
import weakref
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
    "offload_layers",
    "checkpoint_forward",
    "MIN_OFFLOAD_LAYERS",
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
    pinned host memory and comes back for backward as verl's activation offload moves it (:class:`ActivationOffload`:
    one group per block, copied out on a side stream while the next block computes, the last block's group kept on
    the device, each group copied back on a second side stream while the block after it runs its backward; no host
    wait), the weights a layer saves excepted. What the root saves, the LM head's logits among it, stays on the
    device in both; torch's ``save_on_cpu`` (no ``sharded``) copies everything, weights too, with a blocking copy
    each. CUDA only: on a CPU the activations are in host memory already, unless ``on_cpu`` asks for the same hooks
    there (each saved tensor copied out and back at the same block boundaries, in program order)."""
    if not enabled or (device.type != "cuda" and not on_cpu):
        return contextlib.nullcontext()
    if sharded is None:
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    # trainer.engine.parallelize.apply_offload attaches the hooks, or not (verl's rule: fewer than 3 layers)
    return sharded.activation_offload if sharded.activation_offload is not None else contextlib.nullcontext()


#: verl's enable_activation_offloading turns the offload off for a model with fewer FSDP layers than this
MIN_OFFLOAD_LAYERS = 3


def offload_layers(sharded: Sharded) -> list[nn.Module]:
    """The modules verl 0.9.1's ``enable_activation_offloading`` finds (its ``get_layers``), in order: each FSDP unit
    below the root that is not an embedding, an FSDP1 unit by its wrapped module. verl's FSDP2 also shards an untied
    ``lm_head`` apart (``utils/fsdp_utils.py::_select_fsdp2_wrap_targets``), which ours keeps in the root's unit: it
    is one of the layers here too, so the count (verl turns the offload off below :data:`MIN_OFFLOAD_LAYERS`) and the
    groups (each a layer's saves; the last layer's stays on the device) are verl's."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    layers: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if not isinstance(child, (FSDP, FSDPModule)):
                walk(child)
            elif not isinstance(child._fsdp_wrapped_module if isinstance(child, FSDP) else child, nn.Embedding):
                layers.append(child._fsdp_wrapped_module if isinstance(child, FSDP) else child)

    walk(sharded.module)
    model = sharded.module
    if sharded.strategy == "fsdp2" and not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        head = getattr(model, "lm_head", None)
        if isinstance(head, nn.Module) and hasattr(head, "weight") and head not in layers:
            layers.append(head)
    return layers


def checkpoint_forward(module: nn.Module) -> None:
    """``module``'s forward recomputed in backward through a reentrant ``torch.utils.checkpoint``, as verl 0.9.1's
    ``ActivationHandler._ckpt_forward`` wraps each layer when activation offload and gradient checkpointing are both
    on (``enable_activation_offloading(enable_ckpt=True)``, after HF's own checkpointing is switched off): keyword
    arguments packed after the positional ones (its ``_pack_kwargs``), since a reentrant checkpoint takes positional
    tensors only. The checkpoint's ``save_for_backward`` of its tensor inputs runs inside :class:`ActivationOffload`'s
    hooks, so each layer's input goes to host memory with its group (HF's non-reentrant checkpointing saves through
    hooks of its own, which ours never see). A non-tensor argument (the rotary ``(cos, sin)`` tuple, ``None``, a flag)
    is held by reference, in verl as here.

    Only a training forward under autograd is checkpointed (verl: ``module.training``). Where no tensor input needs a
    gradient, the forward runs as it is: a reentrant checkpoint would give the layer's weights no gradient (it warns
    "None of the inputs have requires_grad=True"), and the plain forward's gradients are the checkpoint's bit for
    bit. A decoder block's input is the embedding's output or an earlier block's, which need one whenever the model
    trains."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        flat = (*args, *kwargs.values())  # verl's _pack_kwargs
        keys = tuple(kwargs)
        needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)
        if not (module.training and torch.is_grad_enabled() and needs_grad):
            return forward(*args, **kwargs)

        def run(*inputs):  # verl's _unpack_kwargs, then the original forward
            cut = len(inputs) - len(keys)
            return forward(*inputs[:cut], **dict(zip(keys, inputs[cut:])))

        return torch.utils.checkpoint.checkpoint(run, *flat, use_reentrant=True)

    module.forward = checkpointed


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """What the ``blocks`` save, to host memory and back (see :func:`activation_offload_context`), each distinct
    tensor once per forward and given back with its sizes and strides: a compiled backward reads its saved tensors as
    the forward saved them (Inductor's ``assert_size_stride``), and HF hands attention its q/k/v transposed.

    The window and the streams are verl 0.9.1's (``utils/activation_offload.py``,
    ``AsyncDoubleBufferGroupOffloadHandler`` with ``num_offload_group`` = blocks - 1, one group per block). When
    block g's forward ends (its ``synchronize_on_group_commit_forward``) the d2h stream waits for the compute, the
    compute waits for group g-1's copies and lets its device tensors go, and group g starts copying out on the d2h
    stream, held on the device while block g+1 runs; the last block's group is never copied. When block g's backward
    starts (a hook on its output's gradient, where verl's ``GroupCommitFunction.backward`` runs
    ``on_group_commit_backward``) the compute waits for group g's copies back and group g-1 starts coming back on the
    h2d stream. On a CPU there are no streams: the same window, every copy in program order
    (tests/trainer/engine/test_offload.py reads where each group is at every block boundary).

    A forward pre-hook on every block notes the storages of its gathered parameters while the block's forward runs
    (a forward hook forgets them), so the weights its layers save stay where they are (verl notes them the same way,
    per layer); outside a block nothing moves.

    A host copy belongs to the tensor object it was made from (a weak reference: its entry goes when the tensor
    does), never to an address: the allocator hands a freed tensor's address to the next one of its size, which
    must get its own copy. A noted weight storage is alive while its unit runs, so no activation shares its address
    then (tests/trainer/engine/test_offload.py forces the reuse)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__(self._pack, self._unpack)
        self.active = False
        self.weights: Counter[int] = Counter()  # storage address -> blocks now running that hold it
        self.noted: dict[nn.Module, list[int]] = {}  # the blocks now running -> the storages they noted
        self.copies: WeakIdKeyDictionary = WeakIdKeyDictionary()  # saved tensor -> its _Saved, this forward
        self.offloaded = len(blocks) - 1  # verl's num_offload_group: the last block's group stays on the device
        # the last forward's groups, one per block run (weak: autograd owns each entry and frees it as in a plain run)
        self.groups: list[list[weakref.ref]] = []
        self.streams = _Streams(None)  # verl's d2h and h2d streams, made at the first CUDA tensor saved
        self._outgoing: Optional[list[weakref.ref]] = None  # the group copying out, still held on the device
        self.hooks = [block.register_forward_pre_hook(self._note_weights) for block in blocks]
        self.hooks += [block.register_forward_hook(self._forget_weights) for block in blocks]

    def __enter__(self):
        self.active, self.weights, self.noted, self.copies = True, Counter(), {}, WeakIdKeyDictionary()
        self.groups, self._outgoing = [], None
        return super().__enter__()

    def __exit__(self, *exc):
        self._let_go()  # a forward that stopped before its last block: its copies land before its tensors go
        self.active, self.weights, self.noted, self.copies = False, Counter(), {}, WeakIdKeyDictionary()
        return super().__exit__(*exc)

    def _note_weights(self, module: nn.Module, args) -> None:
        if self.active:
            if not self.noted:  # an outermost block starts: its group
                self.groups.append([])
            storages = [s for s in (_storage(p) for p in module.parameters()) if s is not None]
            self.noted[module] = storages
            self.weights.update(storages)

    def _forget_weights(self, module: nn.Module, args, output) -> None:
        ran = self.noted.pop(module, None)
        self.weights.subtract(ran or [])
        self.weights = +self.weights  # drop the storages no running block holds
        if self.active and ran is not None and not self.noted:
            self._commit_forward(output)

    def _commit_forward(self, output) -> None:
        """verl's ``synchronize_on_group_commit_forward`` as block g (the last group) ends."""
        g, s = len(self.groups) - 1, self.streams
        s.side_waits(s.d2h)
        self._let_go()
        if g < self.offloaded:
            with s.on(s.d2h):
                for entry in _alive(self.groups[g]):
                    entry.copy_out()
            self._outgoing = self.groups[g]
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(functools.partial(self._commit_backward, self.groups, g))

    def _let_go(self) -> None:
        """The group copying out has landed (the compute waits for it): its device tensors go."""
        if self._outgoing is not None:
            self.streams.compute_waits(self.streams.d2h)
            for entry in _alive(self._outgoing):
                entry.device = None
            self._outgoing = None

    def _commit_backward(self, groups: list[list[weakref.ref]], g: int, grad: torch.Tensor) -> None:
        """verl's ``on_group_commit_backward`` as block g's backward is about to run: its group's copies back (started
        one block earlier) are waited for, and group g-1 starts coming back."""
        s = self.streams
        if g >= 1:
            s.side_waits(s.h2d)
        s.compute_waits(s.h2d)
        for entry in _alive(groups[g]):
            entry.pending = False
        if g >= 1:
            compute = s.compute()
            with s.on(s.h2d):
                for entry in _alive(groups[g - 1]):
                    entry.copy_in(compute)

    def offloads(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to the host: saved inside a block, a strided tensor with elements that is no parameter
        and shares no parameter's storage."""
        if not self.noted or t.layout != torch.strided or isinstance(t, nn.Parameter) or type(t) is not torch.Tensor:
            return False
        storage = _storage(t)
        return storage is not None and storage not in self.weights and t.numel() > 0

    def _pack(self, t: torch.Tensor):
        if not self.offloads(t):
            return t
        entry = self.copies.get(t)
        if entry is None:
            if t.is_cuda and self.streams.d2h is None:
                self.streams = _Streams(t.device)
            entry = self.copies[t] = _Saved(t)
            self.groups[-1].append(weakref.ref(entry))
        return entry

    def _unpack(self, packed):
        return packed.get(self.streams) if isinstance(packed, _Saved) else packed


class _Saved:
    """One saved activation: ``device`` is the tensor itself until its group's copy out has landed, then None, then
    its copy back; ``host`` its host copy once copied out. ``span``: None for a non-overlapping and dense tensor (it
    moves as itself, into ``empty_strided``: the same strides both ways); else (a slice with gaps, an expanded mask)
    the stretch of storage its elements cover, which moves whole and comes back viewed with the same sizes and
    strides."""

    __slots__ = ("device", "host", "home", "size", "stride", "span", "pending", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.device: Optional[torch.Tensor] = t
        self.host: Optional[torch.Tensor] = None
        self.home, self.size, self.stride, self.pending = t.device, t.size(), t.stride(), False
        self.span = None if _dense(t) else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))

    def copy_out(self) -> None:
        t, pin = self.device, self.home.type == "cuda"
        assert t is not None
        if self.span is None:
            self.host = torch.empty_strided(self.size, self.stride, dtype=t.dtype, device="cpu", pin_memory=pin)
            self.host.copy_(t, non_blocking=pin)
        else:
            self.host = torch.empty(self.span, dtype=t.dtype, device="cpu", pin_memory=pin)
            self.host.copy_(t.as_strided((self.span,), (1,), t.storage_offset()), non_blocking=pin)

    def copy_in(self, compute=None) -> None:
        """Back to the device, on the current stream; ``compute``: the stream that will read it, when the current one
        is a side stream (the allocator then keeps the memory until the compute's reads are done, and the first read
        waits for the copy)."""
        if self.device is not None or self.host is None:
            return
        pin = self.home.type == "cuda"
        shape = (self.span,) if self.span is not None else self.size
        strides = (1,) if self.span is not None else self.stride
        dev = torch.empty_strided(shape, strides, dtype=self.host.dtype, device=self.home)
        dev.copy_(self.host, non_blocking=pin)
        if compute is not None:
            dev.record_stream(compute)
            self.pending = True
        self.device = dev if self.span is None else dev.as_strided(self.size, self.stride)

    def get(self, streams: "_Streams") -> torch.Tensor:
        """What backward reads. One copy back per entry, shared by every node that saved the tensor (as the plain run
        shares the tensor itself); an entry its group's prefetch did not bring (saved again by a later block) comes
        back here, in stream order."""
        if self.device is None:
            self.copy_in()
        elif self.pending:
            streams.compute_waits(streams.h2d)
            self.pending = False
        assert self.device is not None
        return self.device


class _Streams:
    """verl's ``d2h_stream`` and ``h2d_stream`` on ``device``; with none (a CPU run) every copy runs in program order
    and there is nothing to wait for."""

    def __init__(self, device: Optional[torch.device]) -> None:
        self.d2h = torch.cuda.Stream(device) if device is not None else None
        self.h2d = torch.cuda.Stream(device) if device is not None else None

    def compute(self):
        return torch.cuda.current_stream(self.d2h.device) if self.d2h is not None else None

    def on(self, side):
        return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()

    def side_waits(self, side) -> None:
        """``side`` starts after everything the compute stream has queued so far."""
        if side is not None:
            side.wait_stream(self.compute())

    def compute_waits(self, side) -> None:
        """What the compute stream queues next starts after everything ``side`` has queued so far."""
        if side is not None:
            self.compute().wait_stream(side)


def _alive(group: list[weakref.ref]) -> list["_Saved"]:
    return [e for e in (r() for r in group) if e is not None]


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (torch._prims_common.is_non_overlapping_and_dense's rule): some order of the
    dimensions of size > 1 has each stride the product of the sizes before it."""
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _storage(t: torch.Tensor) -> Optional[int]:
    """The address of a plain tensor's storage (None for tensor subclasses such as a sharded DTensor)."""
    if type(t) not in (torch.Tensor, nn.Parameter):
        return None
    return t.untyped_storage().data_ptr()
