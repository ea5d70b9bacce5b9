"""The rollout's phases and every phase's wall-clock window, recorded by the verl plugin's driver side
(trainer/verl_engine/plugin/driver.py) and read back from the step rows (trainer/verl_engine/metrics.py::windows_of),
proven on a CPU without verl.

The fakes follow verl 0.9.1's source line by line:

* ``checkpoint_engine/base.py::CheckpointEngineManager``: ``sleep_replicas``, ``wake_up_replicas`` and
  ``update_weights`` are ``async def`` methods under ``utils/ray_utils.py::auto_await``, copied below as verl has it
  (run at once with ``asyncio.run`` for a synchronous caller; the coroutine handed back to a caller whose own frame is
  a coroutine's; a thread pool otherwise);
* the call order of ``trainer/ppo/v1/trainer_base.py`` with ``trainer_sync.py``'s hooks: ``_setup`` ends with
  ``sleep_replicas``; ``on_init_end`` calls ``update_weights``; each step samples its generated batch
  (``_step_once``: ``replay_buffer.sample``), ``on_sample_end`` calls ``sleep_replicas``, then the passes
  (``compute_log_prob`` ... ``update_actor``), then ``on_step_end`` calls ``update_weights``, and ``fit`` logs the
  step's row (``Tracking.log``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import time
import types

import pytest

from trainer.verl_engine.metrics import steps_from_jsonl, windows_of
from trainer.verl_engine.plugin import driver, worker
from trainer.verl_engine.schedule import LOG_ENV, WINDOW_METRIC


def auto_await(func):  # verl 0.9.1 utils/ray_utils.py::auto_await, as verl has it
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        coro = func(*args, **kwargs)
        if not inspect.iscoroutine(coro):
            return coro
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            return asyncio.run(coro)
        caller_frame = inspect.currentframe()
        if caller_frame is not None:
            caller_frame = caller_frame.f_back
        caller_is_async = caller_frame is not None and (caller_frame.f_code.co_flags & inspect.CO_COROUTINE) != 0
        if caller_is_async:
            return coro
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(asyncio.run, coro)
            return future.result()

    return wrapper


class _Clock:
    """``time.time()`` the test moves: each verl call below takes the seconds it is given."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _checkpoint_engine_module(clock: _Clock, seconds: dict) -> types.ModuleType:
    """``verl.checkpoint_engine.base`` as the driver patches it: the manager and the ``auto_await`` it imports."""
    base = types.ModuleType("verl.checkpoint_engine.base")
    base.auto_await = auto_await

    class CheckpointEngineManager:
        def __init__(self) -> None:
            self.awake = True  # the replicas start awake (vLLM allocates at launch); _setup puts them to sleep

        @auto_await
        async def sleep_replicas(self):
            clock.now += seconds["sleep"]
            self.awake = False

        @auto_await
        async def wake_up_replicas(self):
            self.awake = True

        @auto_await
        async def update_weights(self, global_steps: int = None):
            self.awake = True  # naive backend: the actor's update_weights resumes the rollout, then pushes weights
            clock.now += seconds["sync"]
            return {}

    base.CheckpointEngineManager = CheckpointEngineManager
    return base


class _Batch:
    def __init__(self) -> None:
        self.extra_info: dict = {}


@pytest.fixture
def plugin(monkeypatch, tmp_path):
    clock = _Clock()
    monkeypatch.setattr(time, "time", clock)
    log = tmp_path / "phases.jsonl"
    monkeypatch.setenv(LOG_ENV, str(log))
    monkeypatch.delenv("PPOTUNE_VERL_SWEEP", raising=False)
    monkeypatch.setattr(driver, "_STATE", None)
    seconds = {"sleep": 0.5, "sync": 2.0, "gen": 3.0, "old_log_prob": 1.0, "update_actor": 4.0}
    base = _checkpoint_engine_module(clock, seconds)
    driver._patch_rollout_calls(base)
    driver._patch_rollout_calls(base)  # idempotent: timed once
    return clock, seconds, base, tmp_path


def _run_sync_trainer(clock, seconds, base, tmp_path, steps: int) -> list[dict]:
    """verl 0.9.1's v1 sync trainer, its calls on the replicas and the workers in order; the file logger's rows."""
    manager = base.CheckpointEngineManager()
    manager.sleep_replicas()  # trainer_base.py::_setup: "sleep all replicas to load checkpoint"
    manager.update_weights(0)  # trainer_sync.py::on_init_end
    metrics = tmp_path / "metrics.jsonl"

    def file_log(self, data, step):  # verl's FileLogger.log
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": step, "data": data}) + "\n")

    log = driver._logging(file_log)
    for step in range(1, steps + 1):
        clock.now += seconds["gen"]  # prepare_step submits, replay_buffer.sample waits for the generated batch
        manager.sleep_replicas()  # trainer_sync.py::on_sample_end
        for pass_name, call in (("old_log_prob", "compute_log_prob"), ("update_actor", "update_actor")):

            def run(self, data, took=seconds[pass_name]):  # a worker's pass (TrainingWorker.infer_batch et al.)
                clock.now += took

            tagged = driver._tagged(lambda batch, run=worker._measured(run): run(None, batch), pass_name)
            tagged(_Batch())
            clock.now += 0.25  # the driver between passes (the advantage, the batch's transfer)
        manager.update_weights(step)  # trainer_sync.py::on_step_end
        log(None, {"perf/throughput": 1.0, "timing_s/step": 1.0, "perf/total_num_tokens": 8}, step)
    return steps_from_jsonl(metrics.read_text(), warmup=0, device="cpu")


def test_each_step_row_carries_its_phases_windows(plugin):
    """Step 1: the weight sync before it (on_init_end) and after it stay two windows; generation runs from the end of
    the wake to the end of the sleep; each pass's window is its worker call's. The first sleep (_setup) follows no
    wake: no window."""
    clock, seconds, base, tmp_path = plugin
    rows = _run_sync_trainer(clock, seconds, base, tmp_path, steps=2)
    windows = windows_of(rows)
    assert not any(k.startswith(WINDOW_METRIC) for r in rows for k in r)  # taken out of the rows
    got = {(w["step"], w["phase"], w["start"] - 1000.0, w["end"] - 1000.0) for w in windows}
    assert got == {
        (1, "weight_sync", 0.5, 2.5),  # on_init_end's, after _setup's sleep (0.5 s)
        (1, "generation", 2.5, 6.0),  # awake from the wake's end: generation 3 s, the sleep 0.5 s
        (1, "old_log_prob", 6.0, 7.0),
        (1, "update_actor", 7.25, 11.25),
        (1, "weight_sync", 11.5, 13.5),  # on_step_end's: a second window of step 1, apart from the first
        (2, "generation", 13.5, 17.0),
        (2, "old_log_prob", 17.0, 18.0),
        (2, "update_actor", 18.25, 22.25),
        (2, "weight_sync", 22.5, 24.5),
    }


def test_worker_lines_carry_their_window_and_ranks_of_one_call_merge(plugin):
    """Two ranks' lines of one pass overlap: one window from the first start to the last end."""
    tmp_path = plugin[3]
    log = tmp_path / "phases.jsonl"
    lines = [
        {"step": 3, "pass": "update_actor", "rank": 0, "peak_gb": 2.0, "micro_batches": 2, "start": 10.0, "end": 14.0},
        {"step": 3, "pass": "update_actor", "rank": 1, "peak_gb": 3.0, "micro_batches": 2, "start": 10.2, "end": 14.5},
        {"step": 3, "phase": "generation", "start": 5.0, "end": 9.0},
    ]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    row = driver._state().row(3)
    assert row[f"{WINDOW_METRIC}update_actor/0/start"] == 10.0 and row[f"{WINDOW_METRIC}update_actor/0/end"] == 14.5
    assert f"{WINDOW_METRIC}update_actor/1/start" not in row
    assert row[f"{WINDOW_METRIC}generation/0/end"] == 9.0
    assert row["ppotune/memory/update_actor_gb"] == 3.0  # the driver's own line is no pass: the peaks as before


def test_an_awaiting_caller_still_gets_its_coroutine(plugin):
    """auto_await tells an awaiting caller by its frame: the driver times the async def inside it, so a coroutine
    that awaits ``update_weights`` gets the coroutine and its window is recorded when it finishes."""
    _, _, base, tmp_path = plugin
    manager = base.CheckpointEngineManager()

    async def caller():
        got = manager.update_weights(1)
        assert inspect.iscoroutine(got)
        return await got

    assert asyncio.run(caller()) == {}
    line = json.loads((tmp_path / "phases.jsonl").read_text().splitlines()[-1])
    assert line["phase"] == "weight_sync" and line["end"] - line["start"] == 2.0
