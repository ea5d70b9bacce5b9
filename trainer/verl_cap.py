"""``--memory-limit-gb`` for verl's processes, loaded by verl's plugin hook (``VERL_USE_EXTERNAL_MODULES``).

Every Ray worker process of the run (trainer ranks, rollout, agent and reward workers) gets the cap
``PPOTUNE_MEMORY_LIMIT_GB``, as ``ppotune train``'s ranks do: on a GPU the CUDA allocator's per-process
fraction; on a CPU an ``RLIMIT_DATA`` of that many GiB of private writable memory above what the process
holds once verl is imported. The driver and Ray's own daemons are not capped.
"""

from __future__ import annotations

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


def _apply() -> None:
    cap = float(os.environ["PPOTUNE_MEMORY_LIMIT_GB"])
    if not sys.argv or not sys.argv[0].endswith("default_worker.py"):  # only Ray's worker processes
        return
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GIB / total))
    else:
        limit = _data_bytes() + int(cap * GIB)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


if os.environ.get("PPOTUNE_MEMORY_LIMIT_GB"):
    _apply()
