"""The trial launcher and the memory sampler, on real subprocesses (python one-liners).

The thing under test is the launcher: process group, timeout, kill, reaping, classification.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from support import REPO, processes_with, wait_until
from tuner.trials.launch import classify, launch_trial, train_command
from tuner.trials.memory import MemorySampler, nvml_available

PY = sys.executable


def run(tmp_path, code: str, *, timeout_s=30.0, grace_s=2.0, **kw):
    d = tmp_path / "trial"
    return launch_trial(
        [PY, "-c", textwrap.dedent(code)],
        trial_dir=d,
        result_path=d / "result.json",
        timeout_s=timeout_s,
        grace_s=grace_s,
        **kw,
    )


# --------------------------------------------------------------------------- classification table
OK = {"status": "ok", "error": None, "summary": {"throughput": 10.0}}


@pytest.mark.parametrize(
    "rc,result,kw,expected",
    [
        (0, OK, {}, "ok"),
        (0, {"status": "ok", "error": None, "summary": {"throughput": None}}, {}, "crash"),
        (3, {"status": "oom", "error": "rank 0 out of memory"}, {}, "oom"),
        (2, {"status": "error", "error": "config: x.yaml: data.train_batch_size: must be > 0"}, {}, "invalid"),
        (1, {"status": "error", "error": "config: refused"}, {}, "invalid"),
        (1, {"status": "error", "error": "rank 1 failed in phase gen: boom"}, {}, "crash"),
        # vLLM's share too small for one sequence, as a rank records it (trainer.contracts.MemoryMessage.error)
        (
            1,
            {
                "status": "error",
                "error": "rank 0 failed in phase gen: config: actor_rollout_ref.rollout.gpu_memory_utilization too "
                "small: vLLM's share of the device holds no sequence: ValueError: No available memory for the cache "
                "blocks. Try increasing `gpu_memory_utilization` when initializing the engine.",
            },
            {},
            "invalid",
        ),
        # a trial whose own states are over the cap (tuner.memory_model.floor, refused by ppotune train, exit 2)
        (
            2,
            {
                "status": "error",
                "error": "config: ppotune.memory_limit_gb: 0.5 is below what a rank holds from its first step on: "
                "0.62 GiB (the actor's fp32 states sharded over 1 rank; trial.yaml)",
            },
            {},
            "oom",
        ),
        (1, {"status": "weird"}, {}, "crash"),
        (2, None, {}, "invalid"),
        (3, None, {}, "oom"),
        (-9, None, {}, "crash"),
        (1, None, {}, "crash"),
        (0, None, {}, "crash"),
        (None, None, {"timed_out": True, "timeout_s": 5}, "hang"),
        (-15, OK, {"timed_out": True, "timeout_s": 5}, "hang"),
        (-15, None, {"interrupted": True}, "interrupted"),
    ],
)
def test_classify(rc, result, kw, expected):
    status, error = classify(rc, result, **kw)
    assert status == expected
    assert (error is None) == (expected == "ok")
    if error:
        assert "\n" not in error


def test_train_command_carries_only_the_config_and_the_result():
    cmd = train_command("c.yaml", result_path="r.json")
    assert cmd == [sys.executable, "-m", "tuner.cli", "train", "c.yaml", "--result", "r.json"]


# --------------------------------------------------------------------------- real processes
def test_ok_result_file_and_log(tmp_path):
    r = run(
        tmp_path,
        f"""
        import json
        print("hello from the trial")
        json.dump({OK!r}, open({str(tmp_path / "trial" / "result.json")!r}, "w"))
    """,
    )
    assert r.status == "ok" and r.returncode == 0 and r.result["summary"]["throughput"] == 10.0
    assert "hello from the trial" in (tmp_path / "trial" / "train.log").read_text()
    assert r.log_tail is None  # only kept for failures


def test_timeout_kills_the_whole_group_including_grandchildren(tmp_path):
    marker = f"marker-{os.getpid()}-timeout"
    r = run(
        tmp_path,
        f"""
        import subprocess, time
        subprocess.Popen(["bash", "-c", "sleep 300; echo {marker}"])
        subprocess.Popen(["python3", "-c", "import time; time.sleep(300)  # {marker}"])
        time.sleep(300)
    """,
        timeout_s=2.0,
        grace_s=1.0,
    )
    assert r.status == "hang" and "trial-timeout" in r.error
    assert 2.0 <= r.duration_s < 15
    assert r.leftover_pids == []
    assert processes_with(marker) == []
    assert "timed out" in (tmp_path / "trial" / "train.log").read_text()


STEP = r"^step \d+"


@pytest.mark.parametrize(
    "elapsed, steps, since_last, expected",
    [
        (5.0, 0, None, None),  # starting up, within the start-up limit
        (11.0, 0, None, "--startup-timeout"),  # no first step in time
        (50.0, 3, 2.0, None),  # a slow start-up is not a hang once steps come
        (50.0, 3, 21.0, "--step-timeout"),  # stepped, then stuck
        (101.0, 3, 1.0, "--trial-timeout"),  # the whole-trial cap, whatever the steps
    ],
)
def test_timeout_reason(tmp_path, elapsed, steps, since_last, expected):
    from tuner.trials.watch import StepWatch, timeout_reason

    watch = StepWatch(tmp_path / "log", STEP)
    watch.steps, now = steps, 1000.0
    watch.last = None if since_last is None else now - since_last
    why = timeout_reason(elapsed, watch, total_s=100.0, startup_s=10.0, step_s=20.0, now=now)
    assert (why is None) if expected is None else (expected in why)


def test_step_lines_of_both_engines(tmp_path):
    """What each engine's trial log shows after a step (verl's line as it reached a real trial log)."""
    from tuner.trials.runners import STEP_LINE
    from tuner.trials.watch import StepWatch

    log = tmp_path / "train.log"
    log.write_bytes(
        b"step 1 (warm-up) | timing_s/step=0.6657 | perf/throughput=695.5\n"
        b"ppotune train: ok | throughput 1776.1 tokens/s/GPU | step 0.28 s\n"
        b"\x1b[36m(TaskRunner pid=30282)\x1b[0m step:1 - global_seqlen/min:478 - global_seqlen/max:478\n"
        b"(TaskRunner pid=30282) training step:1 of 3\n"
        b"step:2 - global_seqlen/min:523 - timing_s/step:1.2\npartial line step 3 |"
    )
    found = {}
    for engine, pattern in STEP_LINE.items():
        watch = StepWatch(log, pattern)
        watch.poll(1.0)
        found[engine] = watch.steps
    assert found == {"ppotune": 1, "verl": 2}


def test_step_timeout_catches_a_trial_stuck_after_its_first_step(tmp_path):
    r = run(
        tmp_path,
        """
        import time
        print("step 1 (warm-up) | timing_s/step=0.5", flush=True)
        print("not a step line: step counting", flush=True)
        time.sleep(300)
    """,
        timeout_s=None,
        grace_s=1.0,
        step_line=STEP,
        startup_timeout_s=60.0,
        step_timeout_s=1.5,
    )
    assert r.status == "hang" and "no step for 1.5 s after step 1 (--step-timeout)" in r.error, r.error
    assert 1.5 <= r.duration_s < 15


def test_startup_timeout_and_steady_steps(tmp_path):
    """No first step within the start-up limit is a hang; steps closer than the step limit are not,
    however long the trial runs."""
    stuck = run(
        tmp_path, "import time; time.sleep(300)", timeout_s=None, grace_s=1.0, step_line=STEP, startup_timeout_s=1.5
    )
    assert stuck.status == "hang" and "--startup-timeout" in stuck.error, stuck.error
    steady = run(
        tmp_path,
        """
        import time
        time.sleep(1.0)  # start-up
        for i in range(6):
            print(f"step {i + 1} | timing_s/step=0.4", flush=True)
            time.sleep(0.4)
    """,
        timeout_s=None,
        grace_s=1.0,
        step_line=STEP,
        startup_timeout_s=1.8,
        step_timeout_s=1.2,
    )
    assert steady.status != "hang" and steady.duration_s > 2.4, (steady.status, steady.error)


def test_sigterm_ignoring_trial_is_sigkilled_after_grace(tmp_path):
    r = run(
        tmp_path,
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(300)
    """,
        timeout_s=1.0,
        grace_s=1.0,
    )
    assert r.status == "hang"
    assert r.duration_s < 12
    assert r.leftover_pids == []


def test_orphaned_grandchild_is_reaped_when_the_trial_exits(tmp_path):
    # the trial exits at once, leaving a detached grandchild (a rank whose launcher died)
    marker = f"marker-{os.getpid()}-orphan"
    r = run(
        tmp_path,
        f"""
        import subprocess
        subprocess.Popen(["bash", "-c", "sleep 300; echo {marker}"], start_new_session=True)
    """,
    )
    assert r.status == "crash" and "without a result file" in r.error  # rc 0, no result
    assert wait_until(lambda: not processes_with(marker), 10)


def test_signal_death_is_a_crash(tmp_path):
    r = run(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert r.returncode == -signal.SIGKILL
    assert r.status == "crash" and "SIGKILL" in r.error


def test_exit_2_is_invalid(tmp_path):
    r = run(
        tmp_path,
        """
        import sys
        print("ppotune train: error: c.yaml: data.train_batch_size: must be > 0", file=sys.stderr)
        sys.exit(2)
    """,
    )
    assert r.status == "invalid" and "data.train_batch_size" in r.error
    assert "must be > 0" in r.log_tail


def test_stop_event_interrupts(tmp_path):
    import threading

    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    r = run(tmp_path, "import time; time.sleep(300)", stop_event=stop)
    assert r.status == "interrupted"
    assert r.duration_s < 10


def test_trial_dies_with_a_sigkilled_tuner(tmp_path):
    """PDEATHSIG on the reaper: SIGKILL the process that launched the trial, the trial tree goes."""
    marker = f"marker-{os.getpid()}-pdeathsig"
    tuner = subprocess.Popen(
        [
            PY,
            "-c",
            textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tuner.trials.launch import launch_trial
        launch_trial([sys.executable, "-c", "import subprocess, time; "
                      "subprocess.Popen(['bash', '-c', 'sleep 300; echo {marker}']); time.sleep(300)"],
                     trial_dir={str(tmp_path / "t")!r}, result_path={str(tmp_path / "t" / "r.json")!r},
                     timeout_s=300, grace_s=2)
    """),
        ]
    )
    assert wait_until(lambda: len(processes_with(marker)) >= 1, 20)
    tuner.kill()
    tuner.wait()
    assert wait_until(lambda: not processes_with(marker), 15), [p.cmdline() for p in processes_with(marker)]


def test_a_signal_stops_even_while_the_main_thread_holds_the_stop_events_lock():
    """``Event.wait`` and ``Event.set`` hold the event's non-reentrant lock for a moment; a handler runs in the
    main thread between two bytecodes, maybe then. A handler that called ``Event.set`` itself would wait
    forever for its own thread (a trial's reaper did, and outlived its SIGKILLed tuner)."""
    code = textwrap.dedent(
        """
        import os, signal, threading, time
        from tuner.trials.launch import stop_on_signals
        stop = threading.Event()
        with stop_on_signals(stop) as got:
            with stop._cond:  # the moment inside stop.wait() when the lock is held
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.3)  # the handler runs in here
            print("stopped" if stop.wait(10) else "not stopped", got)
        """
    )
    try:
        r = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the signal handler deadlocked on the stop event's lock")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["stopped", f"[{int(signal.SIGTERM)}]"], r.stdout


# --------------------------------------------------------------------------- memory
def test_psutil_fallback_without_nvml(tmp_path):
    assert not nvml_available()  # this CPU machine: nvmlInit raises NVMLError_LibraryNotFound
    r = run(
        tmp_path,
        """
        import time
        block = bytearray(300 * 1024 * 1024)  # touched: 300 MB resident
        time.sleep(1.0)
    """,
    )
    assert r.memory.external_source == "psutil"
    assert r.memory.samples >= 8  # >= 10 Hz over ~1 s
    assert r.memory.external_peak_gb > 0.28
    assert r.memory.device_used_peak_gb is None


def test_sampler_reads_the_process_tree(tmp_path):
    code = (
        "import subprocess, sys, time; "
        "kids = [subprocess.Popen([sys.executable, '-c', 'b = bytearray(150 * 2**20); import time; time.sleep(2)']) "
        "for _ in range(2)]; [k.wait() for k in kids]"
    )
    proc = subprocess.Popen([PY, "-c", code])
    sampler = MemorySampler(proc.pid, use_nvml=True, hz=20)
    assert sampler.source == "psutil"
    sampler.start()
    proc.wait()
    peaks = sampler.stop()
    # per rank, like NVML per GPU: the largest single process; the tree's sum is kept beside it
    assert 0.14 < peaks.external_peak_gb < 0.28
    assert peaks.tree_rss_peak_gb > 0.28  # two children of 150 MB each, summed
    assert len(peaks.pids_seen) >= 3


@pytest.mark.parametrize("flag", ["--startup-timeout", "--step-timeout", "--trial-timeout", "--timeout"])
def test_a_timeout_must_be_positive(cli, tmp_path, flag):
    r = cli("search", "configs/tiny_cpu.yaml", "--space", "search_spaces/tiny_cpu.yaml", "--trials", 1,
            flag, 0, "--out", tmp_path / "out")  # fmt: skip
    assert (
        r.returncode == 2 and r.stderr.strip() == f"ppotune search: error: argument {flag}: must be > 0 seconds, got 0"
    )
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.parametrize("command", ["probe", "validate"])
def test_probe_and_validate_check_their_timeouts_too(cli, tmp_path, command):
    r = cli(command, "configs/tiny_cpu.yaml", "--startup-timeout", -1, "--out", tmp_path / "out")
    assert r.returncode == 2 and "argument --startup-timeout: must be > 0 seconds, got -1" in r.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- warm jobs (what needs no trial)
def _nested(*overrides: str) -> dict:
    from trainer.config import config_to_dict, load_config

    return config_to_dict(load_config(REPO / "configs" / "tiny_cpu.yaml", list(overrides)))


def test_what_runs_warm_and_what_a_job_fixes():
    from trainer.launch.jobdir import serve_layout, warm_refusal

    base = _nested()
    assert warm_refusal(base) is None
    assert "vLLM engine" in warm_refusal(_nested("actor_rollout_ref.rollout.name=vllm"))
    assert "nnodes" in warm_refusal(_nested("trainer.nnodes=2"))
    # the per-GPU knobs change in place; the processes (world size, device, process-group timeout) do not
    assert serve_layout(_nested("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")) == serve_layout(base)
    assert serve_layout(_nested("actor_rollout_ref.actor.strategy=fsdp2")) == serve_layout(base)
    for other in ("trainer.n_gpus_per_node=1", "ppotune.device=auto", "ppotune.dist_timeout_s=60"):
        assert serve_layout(_nested(other)) != serve_layout(base), other


@pytest.mark.parametrize(
    "extra, says",
    [
        (["actor_rollout_ref.rollout.name=vllm"], "in-process vLLM engine"),
        (["--engine", "verl"], "--serve runs ppotune's own trainer"),
    ],
)
def test_serve_refuses_what_cannot_run_warm(cli, tmp_path, extra, says):
    r = cli("train", REPO / "configs" / "tiny_cpu.yaml", *extra, "--serve", tmp_path / "job")
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "job").exists()  # nothing was started


SPIN = "import time\nt = time.time()\nwhile time.time() - t < 2.5: pass"


def test_the_load_meter_counts_cpu_outside_the_trial_not_the_trials_own():
    """The trial's own CPU is its own; a process outside it kept busy is load (tuner.trials.memory.LoadMeter)."""
    proc = subprocess.Popen([PY, "-c", SPIN])  # a trial that spins
    sampler = MemorySampler(proc.pid, use_nvml=False, hz=20)
    sampler.start()
    proc.wait()
    own = sampler.stop().load
    assert own["cpu_trial"] > 0.4 and own["gpu_other_processes"] == 0
    # a trial that sleeps beside a process that spins outside the tuner's tree (started detached, as another job)
    outside = subprocess.Popen(
        [PY, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SPIN!r}])"]
    )
    outside.wait()  # its spinning child is now an orphan: not ours
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(2)"])
    sampler = MemorySampler(proc.pid, use_nvml=False, hz=20)
    sampler.start()
    proc.wait()
    beside = sampler.stop().load
    assert beside["cpu_others"] > 0.4 and beside["cpu_trial"] < 0.2
    assert beside["cpu_others_share"] == pytest.approx(beside["cpu_others"] / psutil.cpu_count(), abs=1e-3)


def test_what_the_tuner_started_beside_a_trial_is_not_load():
    """A process the tuner started (a warm job started ahead for the next trial) is the tuner's, not load."""
    ahead = subprocess.Popen([PY, "-c", SPIN])  # a child of this process, as a warm job of the tuner's
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(2)"])
    sampler = MemorySampler(proc.pid, use_nvml=False, hz=20)
    sampler.start()
    proc.wait()
    load = sampler.stop().load
    ahead.wait()
    # the trial sleeps: the spinning child's CPU is counted as the tuner's own (with the trial's), not as others'
    # (what other jobs on the machine add to cpu_others is theirs: this holds on a busy machine too)
    assert load["cpu_trial"] > 0.4, load


def test_a_trial_is_loaded_over_a_quarter_of_the_hosts_cpus_or_with_another_process_on_its_gpus():
    from tuner.trials.memory import LOADED_CPU_SHARE, is_loaded

    assert LOADED_CPU_SHARE == 0.25
    assert not is_loaded(0.25, 0) and is_loaded(0.26, 0) and is_loaded(0.0, 1) and not is_loaded(None, 0)
