"""A sleeping vLLM engine beside training, on CUDA, proven on a CPU: vLLM's own sleep-mode code, a fake device.

vLLM's real ``CuMemAllocator`` (vllm/device_allocator/cumem.py: its malloc callback, ``sleep``, ``wake_up``) and
its real sleep-mode backend (vllm/device_allocator/sleep_mode_backend.py ``CuMemBackend``: level 2 keeps no
weights) run on test_metrics_unmapped.py's FakeCuda; only the C extension's driver calls
(``python_unmap_and_release``, ``python_create_and_map``: cuMemUnmap/cuMemRelease, cuMemCreate/cuMemMap) are the
fake's. The trainer's real ``VLLMRollout`` sleeps and wakes the engine in verl's order
(:meth:`~trainer.engine.vllm_rollout.VLLMRollout.update_weights`), the real ``PhaseMeter`` measures the phases,
and the trial's real hook (``trainer.rank.trial.follow_sleeping_engine``) re-sets the memory cap.

vLLM is imported in a child process (its import sets process-wide environment and torch settings): run as a
script, this file runs one scenario and exits non-zero on a failed check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
GPU = torch.device("cuda", 1)


def _run(name: str) -> None:
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), VLLM_LOGGING_LEVEL="ERROR")
    r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_phase_peaks_and_the_cap_follow_vllms_own_sleep_and_wake(vllm_installed):
    _run("sleep_and_wake")


class FakeLLM:
    """``vllm.LLM`` as far as memory goes: ``LLM.sleep(level)`` reaches the worker's
    ``sleep_mode_backend.suspend(level)`` and ``LLM.wake_up(tags)`` its ``resume(tags)``
    (v1/worker/gpu_worker.py Worker.sleep / Worker.wake_up; the buffers a level-2 sleep saves go to the host).
    The push's ``reload_weights`` consumes the weights iterator, as the worker's weight loader does."""

    def __init__(self, backend):
        self.backend = backend

    def sleep(self, level: int = 1) -> None:
        self.backend.suspend(level)

    def wake_up(self, tags=None) -> None:
        self.backend.resume(tags)

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_weights"
        for _ in kwargs["weights_iterator"]:
            pass

    def reset_prefix_cache(self) -> None:
        pass


def sleep_and_wake() -> None:  # long: one engine's life through a step, checked at each phase
    import vllm.device_allocator as allocators
    from vllm.device_allocator import cumem
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    from tests.trainer.engine.test_metrics_unmapped import FakeCuda, FakeDevice, MiB, Pool
    from trainer.engine.metrics import GB, PhaseMeter, Unmapped
    from trainer.engine.vllm_rollout import SLEEP_LEVEL, VLLMRollout
    from trainer.rank.trial import follow_sleeping_engine

    mp = pytest.MonkeyPatch()
    cuda = FakeCuda(FakeDevice(0, 1000 * MiB, 0), FakeDevice(1, 1000 * MiB, 50 * MiB)).install(mp)
    allocator = cumem.CuMemAllocator()  # vLLM's bookkeeping; get_instance() would ask for the CUDA extension
    mp.setattr(cumem.CuMemAllocator, "instance", allocator)
    mp.setattr(allocators, "get_mem_allocator_instance", lambda: allocator)
    mp.setattr(cumem, "python_unmap_and_release", lambda device, size, ptr, handle: cuda.unmap(ptr, device))
    mp.setattr(cumem, "python_create_and_map", lambda device, size, ptr, handle: cuda.map(ptr, device))
    pool = Pool(on_segment=allocator.python_malloc_callback)  # my_malloc's call into vLLM's bookkeeping

    # the engine's build: each allocation tagged as CuMemAllocator.use_memory_pool(tag) tags it
    for tag, size in (("weights", 100 * MiB), ("kv_cache", 300 * MiB)):
        allocator.current_tag = tag
        cuda.malloc(size, GPU, pool)
    allocator.current_tag = cumem.CuMemAllocator.default_tag
    engine = VLLMRollout(FakeLLM(CuMemBackend()), sleep_level=SLEEP_LEVEL, vocab_size=8, device=GPU)
    engine.sleep()  # as VLLMRollout.build ends
    assert all(data.is_asleep for data in allocator.pointer_to_data.values())
    assert engine.unmapped() == Unmapped(400 * MiB, 400 * MiB)

    meter = PhaseMeter(GPU, device_wide=True)
    follow_sleeping_engine(engine, meter, limit_gb=500 / 1024)
    assert cuda.devices[1].fraction == pytest.approx((500 + 400) / 1000)  # the cap: the limit, and what sleeps

    with meter.phase("update_actor"):
        held = cuda.malloc(450 * MiB, GPU)  # under the limit on the device: allowed
        try:
            cuda.malloc(100 * MiB, GPU)
            raise AssertionError("550 MiB over a 500 MiB cap were allowed")
        except torch.OutOfMemoryError:
            pass
        cuda.free(held, GPU)
    assert cuda.max_memory_allocated(GPU) == (400 + 450) * MiB  # torch's own peak: the sleeping engine counted
    assert meter.memory["update_actor"] == pytest.approx((450 + 50) * MiB / GB)

    def gathered():  # the actor's full tensors, one at a time on the device (iter_full_params)
        for _ in range(2):
            t = cuda.malloc(50 * MiB, GPU)
            yield "w", t
            cuda.free(t, GPU)

    with meter.phase("update_weights"):
        engine.update_weights(gathered())
    assert not engine.asleep and not any(data.is_asleep for data in allocator.pointer_to_data.values())
    # max(weights + a gathered tensor, the whole engine): the KV cache asleep during the push is not counted
    assert meter.memory["update_weights"] == pytest.approx((400 + 50) * MiB / GB)
    assert cuda.devices[1].fraction == pytest.approx(500 / 1000)  # awake: the engine is on the device, capped

    with meter.phase("gen"):
        cuda.free(cuda.malloc(20 * MiB, GPU), GPU)
        meter.sample()
        engine.sleep()
    assert meter.memory["gen"] == pytest.approx((400 + 20 + 50) * MiB / GB)
    assert cuda.devices[1].fraction == pytest.approx((500 + 400) / 1000)
    # the device got the engine's memory back (and the trainer's cache: CuMemAllocator.sleep empties it);
    # torch's counters kept the engine
    assert cuda.mem_get_info(GPU)[1] - cuda.mem_get_info(GPU)[0] == 50 * MiB
    assert cuda.memory_reserved(GPU) == cuda.memory_allocated(GPU) == 400 * MiB
    mp.undo()


if __name__ == "__main__":
    {"sleep_and_wake": sleep_and_wake}[sys.argv[1]]()
