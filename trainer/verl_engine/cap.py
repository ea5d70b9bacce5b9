"""``--memory-limit-gb`` for verl's trainer ranks, loaded by verl's plugin hook (``VERL_USE_EXTERNAL_MODULES``).

Each of verl's FSDP worker processes gets the cap ``PPOTUNE_MEMORY_LIMIT_GB`` when it joins the process
group (``torch.distributed.init_process_group``, from verl/utils/distributed.py), as ``ppotune train``'s ranks do:
on a GPU the CUDA allocator's per-process fraction; on a CPU an ``RLIMIT_DATA`` of that many GiB of
private writable memory above what the process holds at that moment, so the models, optimizer states and
activations it builds afterwards are what the cap bounds. Ray's own processes, the driver and the
rollout, agent and reward workers are not capped (a cap under Ray's C++ core makes it abort in a loop).

Nor is vLLM's worker, though it loads this module too (it imports verl for verl's ``worker_extension_cls``, and
``verl/__init__.py`` imports ``VERL_USE_EXTERNAL_MODULES``) and joins a process group of its own
(vllm/distributed/parallel_state.py::init_distributed_environment): vLLM sizes itself as
``gpu_memory_utilization`` x the physical device (vllm/v1/worker/utils.py::request_memory reads the device's
total), whatever a cap says, so a fraction under that would only fail its KV cache at a size vLLM chose for the
whole card. A process group that vLLM's code asks for is left uncapped.
"""

from __future__ import annotations

import functools
import os
import resource
import sys

GIB = 1 << 30


def _data_bytes() -> int:
    """VmData of this process (private writable mappings: what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _cap(limit_gb: float) -> None:
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gb * GIB / total))
    else:
        limit = _data_bytes() + int(limit_gb * GIB)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _asked_by_vllm() -> bool:
    """Whether vLLM's code is what asks for the process group (any caller on the stack is a module of vLLM)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if name == "vllm" or name.startswith("vllm."):
            return True
        frame = frame.f_back
    return False


def _install(limit_gb: float) -> None:
    import torch.distributed as dist

    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        out = original(*args, **kwargs)
        if not _asked_by_vllm():
            _cap(limit_gb)
        return out

    dist.init_process_group = init_process_group


if os.environ.get("PPOTUNE_MEMORY_LIMIT_GB"):
    _install(float(os.environ["PPOTUNE_MEMORY_LIMIT_GB"]))
