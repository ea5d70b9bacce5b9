"""The driver side of :mod:`trainer.verl_engine.plugin`: each worker-group call of a pass carries its step and pass
(and an in-run sweep's current setting) in its batch; each step's metrics row gets what the workers measured and the
wall-clock window of each phase; in a sweep the train dataloader replays its order at each setting.

Beside the passes the driver records the rollout's phases (:data:`ROLLOUT_PHASES`), read from the calls verl's
trainers make on the rollout replicas each step (verl 0.9.1 ``checkpoint_engine/base.py::CheckpointEngineManager``,
called by ``trainer/ppo/v1/trainer_sync.py``, ``trainer_colocate_async.py`` and v0's ``ray_trainer.py::fit``):
``update_weights`` wakes the replicas and pushes the actor's weights (``on_init_end`` before the first step, then
``on_step_end`` after each step's update): the phase ``weight_sync``; ``sleep_replicas`` frees their weights and KV
cache once the step's generation is in (``on_sample_end``). The replicas hold their memory from the end of the wake
to the end of the sleep, and the step's generation runs there (v1 submits it in ``prepare_step`` and waits for it in
``ReplayBuffer.sample``): that window is the phase ``generation``. The tuner reads what the trial's processes held in
each window from its own memory timeline (tuner.trials.memory), vLLM's servers included while they are awake."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from trainer.verl_engine.schedule import (
    CALL_KEY,
    LOG_ENV,
    PASS_OF_CALL,
    SETTING_METRIC,
    SWEEP_ENV,
    WINDOW_METRIC,
    Schedule,
)


class _State:
    """The trainer's current step (1-based: the step whose worker calls are being made) and the sweep."""

    def __init__(self) -> None:
        self.step = 1
        path = os.environ.get(SWEEP_ENV)
        self.schedule: Optional[Schedule] = Schedule.read(path) if path else None
        self.log = Path(os.environ[LOG_ENV])
        self.awake_since: Optional[float] = None  # when the replicas last finished waking (None: asleep, or unknown)

    def phase(self, name: str, start: float, end: float) -> None:
        """One window of a rollout phase, in the phase log beside the workers' lines (the step in progress)."""
        with open(self.log, "a") as f:  # one short line: an atomic append
            f.write(json.dumps({"step": self.step, "phase": name, "start": start, "end": end}) + "\n")

    def synced(self, start: float, end: float) -> None:
        self.phase("weight_sync", start, end)
        self.awake_since = end

    def woken(self, start: float, end: float) -> None:
        self.awake_since = end

    def slept(self, start: float, end: float) -> None:
        # the first sleep (verl's _setup, right after the replicas start) follows no wake of ours: no window
        if self.awake_since is not None:
            self.phase("generation", self.awake_since, end)
        self.awake_since = None

    def batch_keys(self, pass_name: str) -> dict:
        keys = {CALL_KEY: f"{self.step}:{pass_name}"}
        at = self.schedule.at(self.step) if self.schedule else None
        if at is not None:
            keys.update(self.schedule.settings[at[0]].batch_keys(pass_name))
        return keys

    def row(self, step: int) -> dict:
        """What the workers measured in ``step``: per pass the peak (max over ranks, GB) and micro-batches; the
        token lengths' percentiles; the setting it ran."""
        out: dict[str, Any] = {}
        at = self.schedule.at(step) if self.schedule else None
        if at is not None:
            out[SETTING_METRIC] = at[0]
        lines = []
        if self.log.is_file():
            for text in self.log.read_text().splitlines():
                try:
                    rec = json.loads(text)
                except json.JSONDecodeError:
                    continue
                if rec.get("step") == step:
                    lines.append(rec)
        out.update(_windows(lines))
        for rec in lines:
            p = rec.get("pass")
            if p is None:  # a rollout phase's window (the driver's own line)
                continue
            if rec.get("peak_gb") is not None:
                key = f"ppotune/memory/{p}_gb"
                out[key] = max(out.get(key, 0.0), float(rec["peak_gb"]))
            key = f"ppotune/micro_batches/{p}"
            out[key] = max(out.get(key, 0), int(rec["micro_batches"]))
        for part in ("prompt", "response"):
            xs = sorted(x for rec in lines for x in (rec.get("lengths") or {}).get(part, []))
            if xs:
                for q in (10, 50, 90):
                    out[f"ppotune/lengths/{part}/p{q}"] = float(xs[min(len(xs) - 1, q * len(xs) // 100)])
                out[f"ppotune/lengths/{part}/max"] = float(xs[-1])
        return out


def _windows(lines: list[dict]) -> dict:
    """Each phase's windows in a step's row (:data:`WINDOW_METRIC`): the ranks' lines of one call overlap and merge
    into one window; calls apart (a weight sync before the first step and after it) stay apart."""
    spans: dict[str, list[list[float]]] = {}
    for rec in lines:
        name, start, end = rec.get("pass") or rec.get("phase"), rec.get("start"), rec.get("end")
        if name is not None and isinstance(start, (int, float)) and isinstance(end, (int, float)):
            spans.setdefault(name, []).append([float(start), float(end)])
    out: dict[str, float] = {}
    for name, windows in spans.items():
        merged: list[list[float]] = []
        for start, end in sorted(windows):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for k, (start, end) in enumerate(merged):
            out[f"{WINDOW_METRIC}{name}/{k}/start"], out[f"{WINDOW_METRIC}{name}/{k}/end"] = start, end
    return out


_STATE: Optional[_State] = None


def _state() -> _State:
    global _STATE
    if _STATE is None:
        _STATE = _State()
    return _STATE


def _patch_binding(base) -> None:
    """verl 0.9.1's ``func_generator``: what binds a worker group's methods."""
    if not getattr(base.func_generator, "_ppotune", False):
        base.func_generator = _binding(base.func_generator)


def _patch_tracking(tracking) -> None:
    """verl 0.9.1's ``Tracking.log``: each step's metrics row."""
    if not getattr(tracking.Tracking.log, "_ppotune", False):
        tracking.Tracking.log = _logging(tracking.Tracking.log)


class _Replay:
    """A sampler that hands out ``base``'s order so that each setting of the sweep starts from its beginning
    (:meth:`Schedule.replay`); ``base`` draws its order afresh per pass as before (a seeded one draws the same)."""

    def __init__(self, base, schedule: Schedule, batch_size: int) -> None:
        self.base, self.schedule, self.batch_size = base, schedule, batch_size

    def __iter__(self):
        order = list(iter(self.base))
        return iter([order[p] for p in self.schedule.replay(len(order), self.batch_size)])

    def __len__(self) -> int:
        return len(self.schedule.replay(len(self.base), self.batch_size))


def _replaying(original):
    @functools.wraps(original)
    def create_rl_sampler(data_config, dataset):
        sampler = original(data_config, dataset)
        schedule = _state().schedule
        if schedule is None or len(schedule.settings) < 2:
            return sampler
        batch_size = int(data_config.get("gen_batch_size", None) or data_config.get("train_batch_size"))
        return _Replay(sampler, schedule, batch_size)

    create_rl_sampler._ppotune = True
    return create_rl_sampler


def _patch_sampler(module) -> None:
    """verl 0.9.1's ``create_rl_sampler`` (``trainer/ppo/utils.py``), where it is defined and where it is imported
    by name (the v0 and v1 trainers, v0's entry point): the train dataloader's sampler replays its order per setting."""
    fn = getattr(module, "create_rl_sampler", None)
    if fn is not None and not getattr(fn, "_ppotune", False):
        module.create_rl_sampler = _replaying(fn)


def _timed(inner, record: Callable[[float, float], None]):
    """``inner`` (a coroutine function) that tells ``record`` its wall-clock start and end."""

    @functools.wraps(inner)
    async def timed(*args, **kwargs):
        start = time.time()
        try:
            return await inner(*args, **kwargs)
        finally:
            record(start, time.time())

    return timed


def _recorder(method: str) -> Callable[[float, float], None]:
    return lambda start, end: getattr(_state(), method)(start, end)


def _patch_rollout_calls(base) -> None:
    """verl 0.9.1's ``CheckpointEngineManager.update_weights`` / ``sleep_replicas`` / ``wake_up_replicas``
    (``checkpoint_engine/base.py``): the rollout's phases. Each is an ``async def`` under verl's ``auto_await``, which
    runs it at once for a synchronous caller and hands an awaiting one the coroutine, telling them apart by its
    caller's frame (``utils/ray_utils.py::auto_await``): so the ``async def`` inside is timed and put back under
    ``auto_await``, never wrapped from outside (that would hide an awaiting caller from it)."""
    cls = base.CheckpointEngineManager
    for name, record in (("update_weights", "synced"), ("sleep_replicas", "slept"), ("wake_up_replicas", "woken")):
        fn = getattr(cls, name)
        inner = getattr(fn, "__wrapped__", None)
        if getattr(fn, "_ppotune", False) or inner is None:
            continue
        patched = base.auto_await(_timed(inner, _recorder(record)))
        patched._ppotune = True
        setattr(cls, name, patched)


#: what :mod:`trainer.verl_engine.plugin` patches in the trainer's process, once each module is imported
PATCHES = {
    "verl.single_controller.ray.base": _patch_binding,
    "verl.checkpoint_engine.base": _patch_rollout_calls,
    "verl.utils.tracking": _patch_tracking,
    **{
        name: _patch_sampler
        for name in (
            "verl.trainer.ppo.utils",
            "verl.trainer.ppo.ray_trainer",
            "verl.trainer.ppo.v1.trainer_base",
            "verl.trainer.main_ppo_v0",
        )
    },
}


def _pass_of(method_name: str) -> Optional[str]:
    """The pass a worker-group method runs (``critic_infer_batch`` -> values: a colocated group prefixes the role)."""
    for name, pass_name in PASS_OF_CALL.items():
        if method_name == name or method_name.endswith("_" + name):
            return pass_name
    return None


def _binding(original):
    @functools.wraps(original)
    def func_generator(self, method_name, *args, **kwargs):
        functor = original(self, method_name, *args, **kwargs)
        pass_name = _pass_of(method_name)
        return functor if pass_name is None else _tagged(functor, pass_name)

    func_generator._ppotune = True
    return func_generator


def _tagged(functor, pass_name: str):
    def call(*args, **kwargs):
        batch = args[0] if args else next(iter(kwargs.values()), None)
        name = "ref" if pass_name == "old_log_prob" and _has(batch, "no_lora_adapter") else pass_name
        keys = _state().batch_keys(name)
        _put(batch, keys)
        try:
            return functor(*args, **kwargs)
        finally:
            _drop(batch, keys)

    return call


def _has(batch: Any, key: str) -> bool:
    extra = getattr(batch, "extra_info", None)
    return key in extra if isinstance(extra, dict) else key in getattr(batch, "keys", lambda: ())()


def _put(batch: Any, keys: dict) -> None:
    extra = getattr(batch, "extra_info", None)
    if isinstance(extra, dict):  # v1: a KVBatchMeta; the worker sees its extra info as the batch's non-tensor data
        extra.update(keys)
        return
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(batch, **keys)


def _drop(batch: Any, keys: dict) -> None:
    """v1 reuses a step's KVBatchMeta for every pass: what one call got must not reach the next."""
    extra = getattr(batch, "extra_info", None)
    if isinstance(extra, dict):
        for k in keys:
            extra.pop(k, None)


def _logging(original):
    @functools.wraps(original)
    def log(self, data, step, *args, **kwargs):
        if isinstance(data, dict) and "perf/throughput" in data:  # a training step's row (not validation's)
            data = {**data, **_state().row(step)}
            _state().step = step + 1
        return original(self, data, step, *args, **kwargs)

    log._ppotune = True
    return log
