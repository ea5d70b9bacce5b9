"""gloo for every process group verl creates (it asks for ``"cpu:gloo,<device>:<backend>"``); FSDP2's CPU offload
without pinned memory (verl always offloads the reference model with ``CPUOffloadPolicy(pin_memory=True)``, and
pinning needs an accelerator)."""

from __future__ import annotations

import functools

import torch.distributed as dist


def patch_distributed() -> None:
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
    _unpinned_offload()


def _unpinned_offload() -> None:
    """verl's FSDP engine builds the reference model (a KL in the reward or as a loss: GRPO recipes) with
    ``CPUOffloadPolicy(pin_memory=True)``, which fails with no accelerator ("Cannot access accelerator device");
    ``pin_memory=False`` runs (docs: facts measured on CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.fsdp import transformer_impl

    def unpinned(*args, **kwargs):
        kwargs["pin_memory"] = False
        return CPUOffloadPolicy(*args, **kwargs)

    transformer_impl.CPUOffloadPolicy = unpinned
