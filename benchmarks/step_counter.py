"""What a pass costs the host, counted the same way for any engine (imported by bench_step_overhead.py's workers
in both environments, and by the sync-count test): torch only, no project import.

:class:`Counting` is two torch modes at once:

* a ``TorchFunctionMode`` sees the Python-level calls that read a device tensor on the host or copy between
  host and device: ``Tensor.item``, ``tolist``, ``numpy``, ``__bool__``/``__int__``/``__float__``/``__index__``
  (each a **sync** on a GPU), and ``Tensor.to``/``cpu``/``cuda``/``copy_``/``pin_memory`` with a device
  (a **host copy**, with its bytes; ``.cpu()`` is a sync too, unless ``non_blocking``). On a CPU run every
  tensor is a host tensor, so a call is counted where it would copy on a GPU: an upper bound for copies, the
  same for both engines (FSDP's moves of forward inputs to the compute device count, a no-op on a GPU); a
  ``.to(device)`` is never counted a sync, as it may stand for a host-to-device copy (so a ``.to("cpu")`` read,
  e.g. tensordict's ``.cpu()``, is undercounted: conservative for a comparison against verl). A copy of host data
  to a device is a **sync** too unless it is ``non_blocking`` from pinned memory (on CUDA torch synchronizes the
  stream after a blocking copy, and the host stages a pageable one): ``torch.tensor(data, device=...)``, and a
  move of a tensor known to live on the host (``Counting(host=...)``: a driver's batch; made by ``.cpu()`` or
  ``pin_memory()`` inside the pass; or computed from one of those: a split, a view).
* a ``TorchDispatchMode`` counts every aten op dispatched (forward and backward: what a GPU would launch, more
  or less) and flags the ops whose output shape depends on the data (``nonzero``, ``masked_select``, ``unique``,
  indexing with a boolean mask, ``repeat_interleave`` without ``output_size``, ``_local_scalar_dense``...): each
  waits for the device on a GPU. An op run inside a counted Python call (``item`` -> ``_local_scalar_dense``)
  is not counted twice.

Ops under a tensor subclass (FSDP2's DTensor) are counted once, at the subclass's level.

:func:`count_region` wraps a function so that the ops it dispatches (and its calls) are also counted under a name
(``Counts.region_ops``): a benchmark tells apart the paths both engines share from an engine's CPU stand-ins.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Counts", "Counting", "measure", "count_region"]

_READS = {  # (``numpy`` is not one: it refuses a device tensor, so it only ever reads host memory)
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
}
_MOVES = {
    torch.Tensor.to: "to",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.cuda: "cuda",
    torch.Tensor.copy_: "copy_",
    torch.Tensor.pin_memory: "pin_memory",
}
_DATA_DEPENDENT = {
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::equal",
    "aten::argwhere",
}


@dataclass
class Counts:
    """What one pass did: aten ops, syncs (Python reads + data-dependent ops), host copies and their bytes."""

    ops: int = 0
    syncs: int = 0
    host_copies: int = 0
    host_bytes: int = 0
    wall_s: float = 0.0
    sync_calls: Counter = field(default_factory=Counter)  # what synced, by name
    copy_calls: Counter = field(default_factory=Counter)  # what copied, by name
    region_ops: Counter = field(default_factory=Counter)  # ops dispatched inside a count_region, by its name
    region_calls: Counter = field(default_factory=Counter)  # calls of a count_region's function, by its name

    def as_dict(self) -> dict:
        return {
            "ops": self.ops,
            "syncs": self.syncs,
            "host_copies": self.host_copies,
            "host_bytes": self.host_bytes,
            "wall_s": self.wall_s,
            "sync_calls": dict(self.sync_calls),
            "copy_calls": dict(self.copy_calls),
            "region_ops": dict(self.region_ops),
            "region_calls": dict(self.region_calls),
        }


def _tensors(obj) -> list:
    """The tensors of ``obj``: itself, or the items of a tuple or list (one level)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    return []


def _to_a_device(func, args: tuple, kwargs: dict) -> bool:
    """A move whose result is on a device (``.cuda()``, a ``.to()`` naming one), not a host-side cast or copy."""
    if func is torch.Tensor.cuda:
        return True
    return func is torch.Tensor.to and _names_a_device(args[1:], kwargs) and "cpu" not in (args[1:2] or ("",))


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``.to(...)`` call moves between devices (not a dtype-only cast)."""
    for a in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return True
        if isinstance(a, torch.Tensor):  # .to(other): its device
            return True
    return False


#: calls whose result lives in host memory (on a GPU too): a later move of it to a device is a host-to-device copy
#: (``torch.from_numpy`` is not: torch's function modes do not see it)
_MAKES_HOST = {torch.Tensor.cpu: "cpu", torch.Tensor.pin_memory: "pin_memory"}


class _Functions(TorchFunctionMode):
    def __init__(self, counts: Counts, reading: list, host: WeakIdKeyDictionary) -> None:
        super().__init__()
        self.counts, self.reading, self.host = counts, reading, host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = _READS.get(func)
        if read is not None:
            self.counts.syncs += 1
            self.counts.sync_calls[read] += 1
        self.reading.append(read is not None)
        try:
            out = func(*args, **kwargs)
        finally:
            self.reading.pop()
        if read is None:
            self._count_move(func, args, kwargs, out)
        if func in _MAKES_HOST and isinstance(out, torch.Tensor):
            self.host[out] = func is torch.Tensor.pin_memory  # host memory; pinned or not
        elif _to_a_device(func, args, kwargs):
            for t in _tensors(out):  # on a device now (a CPU run hands back the same object: it is the device's)
                self.host.pop(t, None)
        elif self.host and self._reads_host(args, kwargs):
            for t in _tensors(out):  # what is computed from host tensors stays in host memory (a split, a view)
                self.host[t] = False
        return out

    def _reads_host(self, args: tuple, kwargs: dict) -> bool:
        return any(t in self.host for t in _tensors((*args, *kwargs.values())))

    def _count_move(self, func, args: tuple, kwargs: dict, out) -> None:
        """A host copy: a move that names a device (on a CPU run: one that would copy on a GPU), a ``copy_``
        between devices, a tensor made from host data on a named device."""
        move = _MOVES.get(func)
        if move is None:
            if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
                self._copy(out, "tensor(device)", to_host=False, blocking=False)
                self._pageable(out, "tensor(device)")  # host data, pageable, copied to the device
            return
        if not args or not isinstance(args[0], torch.Tensor):
            return
        src = args[0]
        if move == "copy_":
            if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].device != src.device:
                self._copy(args[1], "copy_", to_host=src.device.type == "cpu", blocking=not kwargs.get("non_blocking"))
            return
        if move == "to" and not _names_a_device(args[1:], kwargs):
            return  # a dtype-only cast
        # only ``.cpu()`` reads a device tensor for sure: a ``.to(device)`` on a CPU run may stand for a
        # host-to-device copy or a no-op on a GPU (FSDP moving inputs already on the device), never counted a sync,
        # unless its source is known to be host memory
        non_blocking = kwargs.get("non_blocking", False)
        self._copy(src, move, to_host=move == "cpu", blocking=not non_blocking)
        if move != "cpu" and src in self.host and not (non_blocking and self.host[src]):
            self._pageable(src, move)

    def _pageable(self, t, name: str) -> None:
        """A host-to-device copy that is not non-blocking from pinned memory: the host waits."""
        self.counts.syncs += 1
        self.counts.sync_calls[f"{name}(host->device)"] += 1

    def _copy(self, t, name: str, *, to_host: bool, blocking: bool) -> None:
        if not isinstance(t, torch.Tensor):
            return
        self.counts.host_copies += 1
        self.counts.host_bytes += t.numel() * t.element_size()
        self.counts.copy_calls[name] += 1
        if to_host and blocking:  # a device-to-host copy the host waits for
            self.counts.syncs += 1
            self.counts.sync_calls[f"{name}(cpu)"] += 1


def _data_dependent(func, args: tuple, kwargs: dict) -> bool:
    name = func._schema.name
    if name in _DATA_DEPENDENT:
        return True
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    if name == "aten::repeat_interleave":
        return kwargs.get("output_size") is None and not (len(args) > 3 and args[3] is not None)
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counts, reading: list, regions: list) -> None:
        super().__init__()
        self.counts, self.reading, self.regions = counts, reading, regions

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counts.ops += 1
        if self.regions:
            self.counts.region_ops[self.regions[-1]] += 1
        if not any(self.reading) and _data_dependent(func, args, kwargs):
            self.counts.syncs += 1
            self.counts.sync_calls[func._schema.name] += 1
        return func(*args, **kwargs)


_ACTIVE: list["Counting"] = []  # the Counting now counting (count_region's wrappers report to it)


class Counting:
    """``with Counting() as counts:`` -> a :class:`Counts` of everything the body ran (wall time included,
    though the modes slow the body down: time a pass without them). ``host``: tensors that live in host memory
    when the body starts (a batch as a driver hands it over): moving one to a device is a host-to-device copy."""

    def __init__(self, host: Iterable[torch.Tensor] = ()) -> None:
        self.counts = Counts()
        self._reading: list = []
        self.regions: list[str] = []
        known = WeakIdKeyDictionary()
        for t in host:
            try:
                known[t] = t.is_pinned()
            except (NotImplementedError, RuntimeError):  # a nested (jagged) tensor has no pinned flag of its own
                known[t] = False
        self._modes = [
            _Functions(self.counts, self._reading, known),
            _Dispatch(self.counts, self._reading, self.regions),
        ]

    def __enter__(self) -> Counts:
        for mode in self._modes:
            mode.__enter__()
        _ACTIVE.append(self)
        self._t0 = time.perf_counter()
        return self.counts

    def __exit__(self, *exc) -> None:
        self.counts.wall_s = time.perf_counter() - self._t0
        _ACTIVE.remove(self)
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def count_region(fn: Callable, name: str) -> Callable:
    """``fn`` wrapped: while a :class:`Counting` counts, its calls and the ops they dispatch are also counted under
    ``name`` (nothing else changes)."""

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        counting = _ACTIVE[-1] if _ACTIVE else None
        if counting is None:
            return fn(*args, **kwargs)
        counting.counts.region_calls[name] += 1
        counting.regions.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            counting.regions.pop()

    return counted


def measure(
    fn, *, timed_runs: int = 1, setup=None, host: Optional[Callable[[], Iterable[torch.Tensor]]] = None
) -> dict:
    """Run ``fn`` once unmeasured (first-use costs: lazy initialisation, optimizer state), once under
    :class:`Counting` (the counts), then ``timed_runs`` times without it; -> the counts and the median plain
    wall time (``wall_s``). ``setup`` (unmeasured) runs before each run of ``fn``; ``host``: what is in host memory
    when ``fn`` starts (read after ``setup``)."""
    prepare = setup or (lambda: None)
    prepare()
    fn()  # the warm-up run
    prepare()
    with Counting(host=host() if host else ()) as counts:
        fn()
    times = []
    for _ in range(timed_runs):
        prepare()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    out = counts.as_dict()
    out["wall_s"] = statistics.median(times) if times else counts.wall_s
    return out
