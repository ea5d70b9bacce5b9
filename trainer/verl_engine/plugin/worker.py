"""The worker side of :mod:`trainer.verl_engine.plugin`: per-call peaks, micro-batch counts and token lengths."""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Optional

import torch

from trainer.verl_engine.schedule import CALL_KEY, LOG_ENV, RUN_ENV

GIB = float(1 << 30)
_MICRO_BATCHES = [0]  # micro-batches verl cut since the current call began (calls run one at a time per process)


def _patch_workers(engine_workers) -> None:
    """verl 0.9.1's ``TrainingWorker.infer_batch`` / ``train_mini_batch``: every role's passes go through them."""
    cls = engine_workers.TrainingWorker
    for name in ("infer_batch", "train_mini_batch"):
        if not getattr(getattr(cls, name), "_ppotune", False):
            setattr(cls, name, _measured(getattr(cls, name)))


def _patch_engine(transformer_impl) -> None:
    """The FSDP engine's ``prepare_micro_batches``: counts what each call cuts."""
    prepare = transformer_impl.prepare_micro_batches
    if getattr(prepare, "_ppotune", False):
        return

    @functools.wraps(prepare)
    def counted(*args, **kwargs):
        out = prepare(*args, **kwargs)
        _MICRO_BATCHES[0] += len(out[0])
        return out

    counted._ppotune = True
    transformer_impl.prepare_micro_batches = counted


#: verl 0.9.1's weight-sync socket: ``ipc:///tmp/rl-colocate-zmq-{ray job id}-replica-R-rank-r.sock``, built by the
#: sender (vllm_rollout.py ServerAdapter.__init__) and the receiver (utils.py
#: vLLMColocateWorkerExtension._get_zmq_handle) alike. Every local Ray's first job id is the same, so two trials on
#: one node would bind one path (the sender removes and rebinds it each update): the trial's run id goes in.
_ZMQ_PREFIX = "ipc:///tmp/rl-colocate-zmq-"


def per_run_socket(handle: str) -> str:
    """``handle`` with this trial's run id (``RUN_ENV``) after verl's prefix; as it was outside a trial or for a
    handle of another form (another verl)."""
    run = os.environ.get(RUN_ENV, "")
    if not run or not handle.startswith(_ZMQ_PREFIX) or handle.startswith(f"{_ZMQ_PREFIX}{run}-"):
        return handle
    return f"{_ZMQ_PREFIX}{run}-{handle[len(_ZMQ_PREFIX):]}"


def _patch_sender(vllm_rollout) -> None:
    """The trainer side of the weight sync (``ServerAdapter.__init__`` sets ``zmq_handle``)."""
    cls = vllm_rollout.ServerAdapter
    init = cls.__init__
    if getattr(init, "_ppotune", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if isinstance(getattr(self, "zmq_handle", None), str):
            self.zmq_handle = per_run_socket(self.zmq_handle)

    __init__._ppotune = True
    cls.__init__ = __init__


def _patch_receiver(utils) -> None:
    """vLLM's side of the weight sync, in vLLM's worker (``vLLMColocateWorkerExtension._get_zmq_handle``)."""
    cls = utils.vLLMColocateWorkerExtension
    get = cls._get_zmq_handle
    if getattr(get, "_ppotune", False):
        return

    @functools.wraps(get)
    def _get_zmq_handle(self):
        return per_run_socket(get(self))

    _get_zmq_handle._ppotune = True
    cls._get_zmq_handle = _get_zmq_handle


#: what :mod:`trainer.verl_engine.plugin` patches in a worker process, once each module is imported
PATCHES = {
    "verl.workers.engine_workers": _patch_workers,
    "verl.workers.engine.fsdp.transformer_impl": _patch_engine,
    "verl.workers.rollout.vllm_rollout.vllm_rollout": _patch_sender,
    "verl.workers.rollout.vllm_rollout.utils": _patch_receiver,
}


def _measured(fn):
    @functools.wraps(fn)  # keeps verl's dispatch attributes (``register``), which the worker group binds by
    def wrapper(self, data, *args, **kwargs):
        call = _call_of(data)
        if call is None:
            return fn(self, data, *args, **kwargs)
        step, pass_name = call.split(":", 1)
        lengths = _lengths(data) if pass_name == "old_log_prob" else None
        _reset_peak()
        _MICRO_BATCHES[0] = 0
        t0, start = time.perf_counter(), time.time()
        out = fn(self, data, *args, **kwargs)
        line = {
            "step": int(step),
            "pass": pass_name,
            "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
            "peak_gb": _peak_gb(),
            "micro_batches": _MICRO_BATCHES[0],
            "seconds": time.perf_counter() - t0,
            # the pass's window on the wall clock the tuner's memory sampler keeps its timeline on (the same host)
            "start": start,
            "end": time.time(),
        }
        if lengths:
            line["lengths"] = lengths
        with open(os.environ[LOG_ENV], "a") as f:  # one short line per call: an atomic append
            f.write(json.dumps(line) + "\n")
        return out

    wrapper._ppotune = True
    return wrapper


def _call_of(data: Any) -> Optional[str]:
    """The ``step:pass`` the driver put into the batch: a ``KVBatchMeta``'s extra info (verl's v1 trainer, before
    TransferQueue turns it into a TensorDict) or a TensorDict's non-tensor data."""
    extra = getattr(data, "extra_info", None)
    if isinstance(extra, dict):
        return extra.get(CALL_KEY)
    try:
        from verl.utils import tensordict_utils as tu

        return tu.get_non_tensor_data(data, CALL_KEY, None)
    except Exception:  # noqa: BLE001 - not a batch we know: unmeasured
        return None


def _lengths(data: Any) -> Optional[dict]:
    """This rank's prompt and response lengths (valid tokens), from the batch's ``input_ids`` (nested: one row per
    sequence, no padding) and ``response_mask``; None when the batch is not laid out so."""
    try:
        ids, mask = data["input_ids"], data["response_mask"]
        totals = [int(x.numel()) for x in ids.unbind()]
        responses = [int(x.sum()) for x in mask.unbind()]
    except Exception:  # noqa: BLE001 - a KVBatchMeta or another layout: no lengths from this call
        return None
    if len(totals) != len(responses):
        return None
    return {"prompt": [t - r for t, r in zip(totals, responses)], "response": responses}


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:  # "5" resets the resident-memory high-water mark (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_gb() -> Optional[float]:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GIB
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None
