"""verl 0.9.1 on a CPU-only machine, without touching verl's files.

Loaded inside verl's own processes -- the ``main_ppo`` driver and every Ray worker, since they
all ``import verl`` -- through verl's plugin hook ``VERL_USE_EXTERNAL_MODULES=trainer.verl_engine.cpu``
(set by the verl trial engine only when the trial device is CPU; on a GPU verl runs as shipped).
The tuner never imports this package: it runs in the user's verl environment, with torch.

What it changes, each for a failure verl 0.9.1 hits on a machine with no accelerator:

* a ``cpu`` platform in verl's ``PlatformRegistry`` (selected with ``VERL_PLATFORM=cpu``): device
  ``torch.device("cpu")``, a no-op device module (memory figures 0: the tuner reads RSS from outside);
* ``torch.distributed.init_process_group``: verl asks for ``"cpu:gloo,cpu:gloo"``; gloo it is;
* attention: verl hard-codes ``flash_attention_2`` in places (the critic's loader); without flash-attn
  the request becomes ``eager``;
* a rollout named ``hf`` in verl's rollout registries (:mod:`trainer.verl_engine.cpu.hf_rollout`):
  HF ``generate`` in a Ray actor, weights pushed from the FSDP actor after every step.
"""

from __future__ import annotations

import os


def _check_version() -> None:
    import verl

    from trainer.verl_engine.adapter import SUPPORTED_VERL

    if verl.__version__ != SUPPORTED_VERL:
        raise RuntimeError(
            f"ppotune's verl CPU shim supports verl {SUPPORTED_VERL} only, found {verl.__version__}: "
            "install verl==0.9.1 in the engine environment (on a GPU machine no shim is needed)"
        )


def _install() -> None:
    _check_version()
    from trainer.verl_engine.cpu import attention, distributed, hf_rollout, platform

    platform.register_cpu_platform()
    distributed.patch_distributed()
    attention.patch_attention()
    hf_rollout.register_hf_rollout()


if os.environ.get("PPOTUNE_VERL_CPU_SHIM", "1") != "0":
    _install()
