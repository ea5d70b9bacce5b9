"""One rank of a warm job (``ppotune train CONFIG --serve JOBDIR``; the launcher starts its ranks:
trainer/launch/ranks.py).

The rank starts once (:func:`trainer.rank.process.start_rank`: device, process group), then runs trial after trial
as the launcher hands them over (:class:`trainer.launch.jobdir.JobDir` task files, read by every rank: the job
is one node), each trial through :func:`trainer.rank.trial.run_trial`, the code a cold ``ppotune train`` runs.
Between two trials it gives back what the trial held and resets what the next one measures:

* memory: garbage collection, the CUDA caching allocator emptied, on CPU ``malloc_trim(0)`` so freed heap
  goes back to the OS (the next trial's "resident memory above its start" then counts only its own);
  the CUDA peak statistics and the CPU peak (``/proc/self/clear_refs``) reset; the memory cap lifted
  (the next trial sets its own: RLIMIT_DATA above the level at its start, as a soft limit). On CPU a
  later trial counts its memory and its cap from its start less what the job's first trial left behind
  once freed (``first_use``: kernels, caches, lazily built state, which a cold run allocates inside its
  own figure), so its figures are a cold run's (trainer.rank.trial.run_trial);
* torch's random generators re-seeded as a fresh process has them, so a trial samples the same responses
  warm or cold. ``torch._dynamo`` is NOT reset: what it caches is the compiled entropy function (a pure
  function, no model in it: trainer.engine.parallelize.compiled_entropy), compiled once for every token count. A cold
  run compiles it in its warm-up step, which is never measured; a later trial of the job, which runs no warm-up
  step, finds it compiled, so its measured steps hold no compile either (a reset made every later trial
  compile inside its first measured step).

What a job keeps: the process, its imports, the process group and a CPU copy of the weights the last trial
loaded (:class:`WeightCache`, rank 0 only: the other ranks build on the meta device and get their shards
from rank 0), and the tokenized prompts while the data config stays the same. An OOM, an error or a signal
ends the rank exactly as in a cold run (trainer.rank.process.fail: status file, exit code 3/1); the launcher then ends
the job and the tuner starts a fresh one for the next trial.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

from trainer.launch.jobdir import JobDir
from trainer.launch.proc import die_with_parent, leave_rank, write_json_atomic
from trainer.rank.process import MemoryLevel, fail_rank, malloc_trim, new_state, on_sigterm_write, start_rank
from trainer.rank.trial import run_trial

__all__ = ["serve_main", "WeightCache"]


class WeightCache:
    """The weights a trial loaded, kept in host memory for the next trial of the job.

    :meth:`load` stands in for a loader (``trainer.engine.models.load_actor`` / ``load_critic``): it returns a fresh
    deep copy of what the loader returned for the same arguments, so the trial allocates and owns its model
    exactly as after a load (same memory, same values) without reading the checkpoint again. The copy kept
    here is made before the trial's memory is counted (:meth:`prime`), so it is in every trial's starting
    level, not in one trial's peak. Only the current trial's models are kept, and only while they fit in a
    quarter of the host's available memory (else each trial loads them again, as a cold run does).
    """

    def __init__(self, *, share_of_available: float = 0.25) -> None:
        self._kept: dict[tuple, object] = {}
        self._too_big: set[tuple] = set()
        self.share_of_available = share_of_available
        self.notes: list[str] = []  # said in the result of the trial that met them

    @staticmethod
    def _key(load, path: str, kw: dict) -> tuple:
        return (load.__module__, load.__qualname__, path, repr(sorted(kw.items(), key=lambda kv: kv[0])))

    def load(self, load, path: str, tokenizer, **kw):
        key = self._key(load, path, kw)
        if kw.get("meta") or key not in self._kept:  # no weights, or not kept: load as a cold run does
            return load(path, tokenizer, **kw)
        return copy.deepcopy(self._kept[key])

    def prime(self, wanted: list[tuple]) -> None:
        """Hold exactly the models in ``wanted`` (``(loader, path, tokenizer, kw)``), loading the missing ones."""
        import psutil

        wanted_keys = {self._key(load, path, kw): (load, path, tok, kw) for load, path, tok, kw in wanted}
        if set(self._kept) - set(wanted_keys):  # another model now: let the old ones go first
            self._kept = {k: m for k, m in self._kept.items() if k in wanted_keys}
            gc.unfreeze()  # release() froze them with everything else that outlived a trial
            gc.collect()
        self.notes = []
        for key, (load, path, tok, kw) in wanted_keys.items():
            if kw.get("meta") or key in self._kept or key in self._too_big:
                continue
            model = load(path, tok, **kw)
            size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
            room = self.share_of_available * psutil.virtual_memory().available
            if size > room:
                self._too_big.add(key)
                self.notes.append(
                    f"warm job: {path} ({load.__name__}) is loaded again by each trial: its {size / 2**30:.1f} GiB "
                    f"exceed {self.share_of_available:.0%} of the host memory available"
                )
                continue
            self._kept[key] = model


#: GB still allocated on the device after a trial's release above which the next trial says so
LEFTOVER_NOTE_GB = 0.016


def release(device) -> float:
    """Give back what the finished trial held and reset what the next trial measures (see the module doc).
    -> GB the device's allocator still holds in live tensors afterwards (0 on CPU): what the next trial
    starts with that a fresh process would not have."""
    import resource

    import torch

    from trainer.engine.metrics import _reset_rss_peak
    from trainer.engine.vllm_rollout import unmapped_pool_bytes

    gc.collect()  # FSDP's modules and hooks hold cycles
    # what outlives a trial (modules, caches, the kept weights) is not looked at again: the next trial's
    # collection walks only what that trial made (a full one is slow: see docs/decisions.md#gc-freeze-between-trials)
    gc.freeze()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
    left = 0.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
        # an earlier trial's vLLM engine, kept asleep, is counted by the allocator but not on the device
        left = (torch.cuda.memory_allocated(device) - unmapped_pool_bytes(device).allocated) / 2**30
    malloc_trim()
    _reset_rss_peak()
    return left


def _next_task(job: JobDir, seq: int) -> dict:
    path = job.task(seq)
    while not path.is_file():
        time.sleep(JobDir.POLL_S)
    return json.loads(path.read_text())


def serve_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trainer.rank.serve")
    ap.add_argument("config", help="the job's config: its layout (world size, device, process-group timeout)")
    ap.add_argument("--job-dir", required=True)
    args = ap.parse_args(argv)
    die_with_parent(signal.SIGKILL)  # the launcher died (even by SIGKILL): no orphan rank keeps a GPU
    job = JobDir(Path(args.job_dir))
    rank = int(os.environ.get("RANK", "0"))
    idle = {"state": new_state(), "rank_file": job.setup_dir / f"rank{rank}.json"}  # before and between trials
    current = dict(idle)
    on_sigterm_write(current)
    try:
        import torch
        import torch.distributed as dist

        from trainer.config import load_config
        from trainer.engine.models import load_tokenizer
        from trainer.engine.roles import model_loads

        fresh_seed = torch.initial_seed()  # a fresh process's generators: every trial starts from them
        proc = start_rank(load_config(args.config, validate=False))
        weights, tokenizers, data_cache = WeightCache(), {}, {}
        first_use = None  # CPU: what the job's first trial left behind (see trainer.rank.trial.run_trial)
        left_gb = 0.0  # CUDA: what the earlier trials left allocated on the device
        seq = 0
        while True:
            seq += 1
            task = _next_task(job, seq)
            if task.get("stop"):
                break
            state = current["state"] = new_state()
            rank_file = current["rank_file"] = Path(task["rank_dir"]) / f"rank{rank}.json"
            cfg = load_config(task["config"], validate=False)  # the launcher validated it and wrote this file
            torch.manual_seed(fresh_seed)
            path = cfg.actor_rollout_ref.model.path
            if path not in tokenizers:
                tokenizers[path] = load_tokenizer(path)
            weights.prime([(load, where, tokenizers[path], kw) for load, where, kw in model_loads(cfg, rank).values()])
            state["notes"] += weights.notes
            if left_gb > LEFTOVER_NOTE_GB:
                state["notes"].append(
                    f"warm job: earlier trials left {left_gb:.3f} GB allocated on the device: in this trial's peaks"
                )
            torch.manual_seed(fresh_seed)
            start = run_trial(
                cfg, proc, rank, rank_file, state,
                weights=weights, data_cache=data_cache, first_use=first_use, later=seq > 1,
            )  # fmt: skip
            state["phase"] = "release"
            left_gb = release(proc.device)
            if first_use is None and proc.device.type == "cpu":
                left = MemoryLevel.now() - start
                first_use = MemoryLevel(max(0.0, left.rss_gb), max(0, left.data_bytes))
            dist.barrier()  # every rank released before any says done (the next trial starts clean)
            state.update(status="ok", done=True)
            write_json_atomic(rank_file, state)
            current.update(idle)  # the launcher may remove the trial's files now
        dist.destroy_process_group()
        leave_rank()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes data for the launcher
        fail_rank(exc, rank, current["rank_file"], current["state"])


if __name__ == "__main__":
    sys.exit(serve_main())
