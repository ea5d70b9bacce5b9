"""``--memory-limit-gb`` in verl's trainer ranks (trainer/verl_engine/cap.py) on CUDA, proven on a CPU: the cap is set
on the device the rank computes on, as a fraction of that device's memory.

The fake follows torch's own code (torch/cuda/memory.py::set_per_process_memory_fraction: ``device=None`` means
``torch.cuda.current_device()``; the fraction must be a float in [0, 1], else TypeError/ValueError). verl makes the
rank's GPU the current device before its process group starts (verl/single_controller/base/worker.py::Worker
``_setup_env_cuda_visible_devices``: Ray leaves one visible GPU, or ``get_torch_device().set_device(local_rank)``
under ``RAY_EXPERIMENTAL_NOSET_*``), which is when the cap is set (after ``init_process_group``)."""

import torch

from trainer.verl_engine import cap

GIB = 1 << 30


class _Props:
    def __init__(self, total_memory: int) -> None:
        self.total_memory = total_memory


class _FakeCuda:
    """Two GPUs of different sizes, the second one current (verl's ``set_device(local_rank)``)."""

    def __init__(self, totals: list[int], current: int) -> None:
        self.totals, self.current, self.fractions = totals, current, {}

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return self.current

    def get_device_properties(self, device) -> _Props:
        return _Props(self.totals[int(device)])

    def set_per_process_memory_fraction(self, fraction, device=None) -> None:
        if device is None:  # torch/cuda/memory.py: "the default CUDA device is used"
            device = self.current_device()
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fractions[int(device)] = fraction


def _install(monkeypatch, fake: _FakeCuda) -> None:
    for name in ("is_available", "current_device", "get_device_properties", "set_per_process_memory_fraction"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))


def test_the_cap_is_a_fraction_of_the_ranks_own_device(monkeypatch):
    fake = _FakeCuda([80 * GIB, 40 * GIB], current=1)
    _install(monkeypatch, fake)
    cap._cap(10.0)
    assert fake.fractions == {1: 10.0 / 40}  # the current device's 40 GiB, not device 0's 80


def test_a_cap_above_the_device_is_the_whole_device(monkeypatch):
    fake = _FakeCuda([24 * GIB], current=0)
    _install(monkeypatch, fake)
    cap._cap(100.0)
    assert fake.fractions == {0: 1.0}  # torch refuses a fraction above 1


# --------------------------------------------------------------------------- whose process group is capped
# verl 0.9.1's trainer ranks join their group in verl/utils/distributed.py::initialize_global_process_group_ray
# (workers/engine_workers.py calls it); vLLM's worker joins its own in
# vllm/distributed/parallel_state.py::init_distributed_environment, after it has imported verl for
# verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension (vllm/v1/worker/worker_base.py::init_worker
# resolves worker_extension_cls before init_device), so the patch is in place there too. Each caller below is compiled
# as a module of that name and calls ``torch.distributed.init_process_group`` as its upstream does.
_CALLER = """
import torch


def join(**kwargs):
    torch.distributed.init_process_group(backend="nccl", world_size=1, rank=0, **kwargs)
"""


def _caller(name: str):
    module = {"__name__": name}
    exec(compile(_CALLER, f"<{name}>", "exec"), module)
    return module["join"]


def test_the_cap_is_set_for_the_trainers_process_group_and_never_for_vllms(monkeypatch):
    import torch.distributed as dist

    joined, capped = [], []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: joined.append(k))
    monkeypatch.setattr(cap, "_cap", capped.append)
    cap._install(10.0)
    _caller("verl.utils.distributed")()
    assert len(joined) == 1 and capped == [10.0]  # a trainer rank
    _caller("vllm.distributed.parallel_state")()
    assert len(joined) == 2 and capped == [10.0]  # vLLM's worker joins its group uncapped
