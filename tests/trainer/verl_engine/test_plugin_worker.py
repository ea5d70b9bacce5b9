"""The verl plugin's per-call peak in a verl worker on CUDA (trainer/verl_engine/plugin/worker.py), proven on a CPU:
each worker call of a pass records the allocator's peak of that call alone, not the peak since the process began
(verl's own ``perf/max_memory_*`` never resets it).

The fake follows torch's accounting (torch/cuda/memory.py::reset_peak_memory_stats: "the starting point in tracking
this metric" moves to now, ``_cuda_resetPeakMemoryStats`` setting each peak stat to its current value;
::max_memory_allocated reads ``allocated_bytes.all.peak``; ``device=None`` is the current device, which verl sets to
the rank's GPU before its worker builds anything: verl/single_controller/base/worker.py::Worker
``_setup_env_cuda_visible_devices``)."""

import json

import torch

from trainer.verl_engine.plugin import worker
from trainer.verl_engine.schedule import CALL_KEY, LOG_ENV

GIB = 1 << 30


class _FakeCuda:
    """One device's ``allocated_bytes.all.current`` and ``.peak``, as torch's caching allocator keeps them."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def is_available(self) -> bool:
        return True

    def allocate(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def free(self, nbytes: int) -> None:
        self.current -= nbytes

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = self.current

    def max_memory_allocated(self, device=None) -> int:
        return self.peak


class _Batch:
    """A v1 ``KVBatchMeta``: the driver's ``step:pass`` travels in its extra info."""

    def __init__(self, call: str) -> None:
        self.extra_info = {CALL_KEY: call}


def test_each_calls_peak_is_its_own_not_the_processs(monkeypatch, tmp_path):
    fake = _FakeCuda()
    for name in ("is_available", "reset_peak_memory_stats", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    log = tmp_path / "phases.jsonl"
    monkeypatch.setenv(LOG_ENV, str(log))

    def train_mini_batch(self, data, activations_gb):  # a pass that holds its activations, then frees them
        fake.allocate(activations_gb * GIB)
        fake.free(activations_gb * GIB)

    measured = worker._measured(train_mini_batch)
    fake.allocate(2 * GIB)  # the model and optimizer states, held across calls
    measured(None, _Batch("1:update_actor"), 6)
    measured(None, _Batch("1:update_critic"), 1)
    peaks = [json.loads(line)["peak_gb"] for line in log.read_text().splitlines()]
    assert peaks == [8.0, 3.0]  # the critic's update alone, not the actor's 8 GiB before it


def _verl_weight_sync_sides(job_id: str):
    """verl 0.9.1's two ends of the weight sync, as they build the socket path: the sender
    (verl/workers/rollout/vllm_rollout/vllm_rollout.py::ServerAdapter.__init__) and vLLM's worker
    (verl/workers/rollout/vllm_rollout/utils.py::vLLMColocateWorkerExtension._get_zmq_handle); every local Ray's first
    job id is the same, which is what made two trials on one node share the path."""
    import types

    class ServerAdapter:
        def __init__(self, replica_rank: int = 0, local_rank: int = 0):
            self.zmq_handle = f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-{replica_rank}-rank-{local_rank}.sock"

    class vLLMColocateWorkerExtension:  # noqa: N801 - verl's name
        local_rank = 0

        def _get_zmq_handle(self) -> str:
            return f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-0-rank-{self.local_rank}.sock"

    return types.SimpleNamespace(ServerAdapter=ServerAdapter), types.SimpleNamespace(
        vLLMColocateWorkerExtension=vLLMColocateWorkerExtension
    )


def test_two_trials_weight_sync_sockets_differ_and_each_trials_two_ends_meet(monkeypatch):
    from trainer.verl_engine.schedule import RUN_ENV

    handles = []
    for run in ("ppotune-ray-aaaa1111", "ppotune-ray-bbbb2222"):
        monkeypatch.setenv(RUN_ENV, run)
        sender, receiver = _verl_weight_sync_sides("01000000")  # both trials' Ray: the same first job id
        worker._patch_sender(sender)
        worker._patch_receiver(receiver)
        worker._patch_sender(sender)  # patched once however often the hook runs
        sent = sender.ServerAdapter().zmq_handle
        assert sent == receiver.vLLMColocateWorkerExtension()._get_zmq_handle()
        assert run in sent and len(sent[len("ipc://") :]) < 107  # a Unix socket path's limit
        handles.append(sent)
    assert handles[0] != handles[1]
    monkeypatch.delenv(RUN_ENV)
    assert worker.per_run_socket(handles[0]) == handles[0]  # outside a trial: verl's path as it is
