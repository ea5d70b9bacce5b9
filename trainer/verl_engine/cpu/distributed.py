"""gloo for every process group verl creates (it asks for ``"cpu:gloo,<device>:<backend>"``)."""

from __future__ import annotations

import functools

import torch.distributed as dist


def patch() -> None:
    original = dist.init_process_group
    if getattr(original, "_ppotune_cpu", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend")
        if isinstance(backend, str) and "gloo" in backend:
            kwargs["backend"] = "gloo"  # "cpu:gloo,cpu:gloo" is refused: "Duplicate device type cpu"
        return original(*args, **kwargs)

    init_process_group._ppotune_cpu = True
    dist.init_process_group = init_process_group
