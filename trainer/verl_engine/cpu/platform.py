"""A ``cpu`` platform for verl's PlatformRegistry (selected by ``VERL_PLATFORM=cpu``)."""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any, Optional

import torch


class _CpuStream:
    """Streams and events are no-ops on the CPU: work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass


def _device_module() -> types.SimpleNamespace:
    """What verl calls on ``get_torch_device()``; memory figures are 0 (the tuner samples RSS from outside)."""
    zero = lambda *a, **k: 0  # noqa: E731
    nothing = lambda *a, **k: None  # noqa: E731
    return types.SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: torch.device("cpu"),
        device_count=lambda: 1,
        set_device=nothing,
        synchronize=nothing,
        empty_cache=nothing,
        ipc_collect=nothing,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        memory_allocated=zero,
        memory_reserved=zero,
        max_memory_allocated=zero,
        max_memory_reserved=zero,
        reset_peak_memory_stats=nothing,
        mem_get_info=lambda *a, **k: (0, 0),
        set_per_process_memory_fraction=nothing,
        get_device_name=lambda *a, **k: "cpu",
        current_stream=lambda *a, **k: _CpuStream(),
        stream=lambda *a, **k: contextlib.nullcontext(),
        Stream=_CpuStream,
        Event=_CpuStream,
    )


def register_cpu_platform() -> None:
    """``cpu`` in verl's PlatformRegistry: :class:`_CpuPlatform` on verl's ``PlatformBase``."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(_CpuPlatform, PlatformBase):
        pass


class _CpuPlatform:
    """The methods of the ``cpu`` platform. A mixin, not a ``PlatformBase`` subclass: verl can be imported only
    inside verl's processes, so the class verl registers is put together in :func:`register_cpu_platform`."""

    _module = _device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return os.environ.get("VERL_PLATFORM", "").lower() == "cpu"

    def current_device(self) -> Any:
        # verl passes this to ``.to()``: an int would name a CUDA device
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: Optional[int] = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"  # logical GPUs declared to Ray (ray_init.num_gpus): one per trainer rank

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
