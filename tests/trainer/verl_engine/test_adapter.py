"""The verl engine's own logic, without verl: run files, the overrides a trial adds, verl's metrics
lines -> our step rows, failure classification (tests/e2e/test_verl.py runs real verl)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trainer.config import ConfigError
from trainer.verl_engine.adapter import (
    CPU_KEYS,
    RAY_DIR_MAX_CHARS,
    RUN_ENV,
    TRIAL_KEYS,
    classify_failure,
    load_run,
    ray_temp_dir,
    run_overrides,
    steps_from_jsonl,
    verl_env,
)
from trainer.verl_engine.metrics import Enough, lengths_of
from trainer.verl_engine.overrides import override_key
from trainer.verl_engine.worst_case import WORST_CASE_KEYS, worst_case_overrides


def _run_file(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(body)
    return p


def test_run_file_forms_and_flags(tmp_path):
    lst = load_run(
        _run_file(tmp_path, "overrides: [trainer.nnodes=1, data.train_batch_size=8]\n"),
        ["a.b=2"],
        steps=4,
        warmup=1,
        nproc=2,
    )
    assert lst.overrides == ["trainer.nnodes=1", "data.train_batch_size=8", "a.b=2", "trainer.n_gpus_per_node=2"]
    assert (lst.steps, lst.warmup, lst.nproc, lst.python) == (4, 1, 2, sys.executable)
    nested = load_run(_run_file(tmp_path, "trainer: {nnodes: 1}\nppotune: {steps: 5, warmup: 2}\n"))
    assert nested.overrides == ["trainer.nnodes=1"] and (nested.steps, nested.warmup) == (5, 2)
    assert lst.get("data.train_batch_size") == "8" and override_key("++a.b=1") == "a.b"


@pytest.mark.parametrize(
    "body,flags,key",
    [
        ("overrides: [nonsense]\n", {}, "overrides"),
        ("ppotune: {stepz: 3}\n", {}, "ppotune.stepz"),
        ("overrides: []\n", {"python": "/no/such/python"}, "ppotune.python"),
        ("overrides: []\n", {"steps": 2, "warmup": 2}, "ppotune.warmup"),
        ("overrides: []\n", {"memory_limit_gb": -1.0}, "ppotune.memory_limit_gb"),
        ("- a list\n", {}, "<root>"),
    ],
)
def test_bad_run_files_name_the_key(tmp_path, body, flags, key):
    with pytest.raises(ConfigError) as e:
        load_run(_run_file(tmp_path, body), **flags)
    assert e.value.key == key and str(tmp_path) in str(e.value)


def test_what_a_trial_adds(tmp_path):
    spec = load_run(
        _run_file(tmp_path, "overrides: [trainer.nnodes=1, actor_rollout_ref.rollout.name=vllm]\n"), steps=3, nproc=2
    )
    gpu = run_overrides(spec, device="cuda", workdir=tmp_path)
    added = gpu[len(spec.overrides) :]
    assert {override_key(o) for o in added} == set(TRIAL_KEYS) and all(o.startswith("++") for o in added)
    assert "++trainer.total_training_steps=3" in added and "++ray_kwargs.ray_init.include_dashboard=False" in added
    cpu = run_overrides(spec, device="cpu", workdir=tmp_path)
    keys = {override_key(o) for o in cpu[len(spec.overrides) :]}
    assert keys >= set(CPU_KEYS) and "++actor_rollout_ref.actor.strategy=fsdp2" in cpu
    assert "++ray_kwargs.ray_init.num_gpus=2" in cpu
    assert any("rollout.name=vllm: no effect on CPU" in n for n in spec.notes)
    # a value the user set wins (e.g. too few CPUs on purpose)
    own = load_run(
        _run_file(
            tmp_path,
            "overrides: ['++ray_kwargs.ray_init.num_cpus=1', '++ray_kwargs.ray_init.include_dashboard=true']\n",
        )
    )
    ran = run_overrides(own, device="cpu", workdir=tmp_path)
    assert not any(
        o.startswith(("++ray_kwargs.ray_init.num_cpus=8", "++ray_kwargs.ray_init.include_dashboard=F")) for o in ran
    )
    fsdp1 = load_run(_run_file(tmp_path, "overrides: [critic.strategy=fsdp]\n"))
    with pytest.raises(ConfigError, match="critic.strategy"):
        run_overrides(fsdp1, device="cpu", workdir=tmp_path)


def test_a_trial_starts_a_ray_of_its_own(tmp_path, monkeypatch):
    """``address=local`` in a folder of the trial's own, whatever the run file, RAY_ADDRESS or a ``ray start`` on the
    node says (ray/_private/worker.py::init: "local" starts a new instance even with one running; RAY_ADDRESS is read
    only for no address or "auto")."""
    spec = load_run(_run_file(tmp_path, "overrides: ['++ray_kwargs.ray_init.address=auto']\n"))
    ran = run_overrides(spec, device="cuda", workdir=tmp_path, ray_dir=Path("/tmp/r"))
    assert ran[-2:] == ["++ray_kwargs.ray_init.address=local", "++ray_kwargs.ray_init._temp_dir=/tmp/r"]
    assert any(n.startswith("ray_kwargs.ray_init.address=auto: not in a trial") for n in spec.notes)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    env = verl_env(spec, device="cuda", metrics_path=tmp_path / "m", run_id="ppotune-ray-x")
    assert "RAY_ADDRESS" not in env and env[RUN_ENV] == "ppotune-ray-x"
    # Ray's sockets below the folder must fit a Unix socket path (107 bytes): a long TMPDIR falls back to /tmp
    monkeypatch.setenv("TMPDIR", str(tmp_path / ("x" * 60)))
    (tmp_path / ("x" * 60)).mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    one, two = ray_temp_dir(), ray_temp_dir()
    assert one != two and one.parent == Path("/tmp") and len(str(one)) <= RAY_DIR_MAX_CHARS
    one.rmdir(), two.rmdir()


def test_environment_loads_the_shim_only_on_cpu(tmp_path):
    spec = load_run(_run_file(tmp_path, "overrides: []\n"), memory_limit_gb=1.0)
    cpu = verl_env(spec, device="cpu", metrics_path=tmp_path / "m.jsonl")
    assert (
        cpu["VERL_PLATFORM"] == "cpu"
        and cpu["VERL_USE_EXTERNAL_MODULES"]
        == "trainer.verl_engine.cpu,trainer.verl_engine.cap,trainer.verl_engine.plugin"
    )
    assert cpu["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "m.jsonl") and cpu["PPOTUNE_MEMORY_LIMIT_GB"] == "1.0"
    gpu = verl_env(load_run(_run_file(tmp_path, "overrides: []\n")), device="cuda", metrics_path=tmp_path / "m")
    assert "VERL_PLATFORM" not in gpu and "trainer.verl_engine.cpu" not in gpu.get("VERL_USE_EXTERNAL_MODULES", "")
    # the per-pass peaks and micro-batches are measured on either device (trainer.verl_engine.plugin)
    assert gpu["VERL_USE_EXTERNAL_MODULES"] == "trainer.verl_engine.plugin" and gpu["PPOTUNE_VERL_PHASE_LOG"]


def _line(step: int, **data) -> str:
    base = {
        "timing_s/step": 1.0,
        "perf/throughput": 100.0 * step,
        "perf/total_num_tokens": 480,
        "timing_s/gen": 0.5,
        "timing_s/update_actor": 0.2,
        "timing_s/agent_loop/generate_sequences/max": 0.3,
        "actor/perf/max_memory_allocated_gb": 3.0,
        "critic/perf/max_memory_allocated_gb": 5.0,
        "response_length/mean": 30.0,
        "some/text": "x",
    }
    return json.dumps({"step": step, "data": {**base, **data}})


def test_verl_metrics_lines_become_our_step_rows():
    text = "\n".join([_line(1), "not json", json.dumps({"step": 1, "data": {"val/score": 1.0}}), _line(2)])
    rows = steps_from_jsonl(text, warmup=1, device="cuda")
    assert [(r["step"], r["warmup"]) for r in rows] == [(1, True), (2, False)]
    r = rows[1]
    assert r["perf/throughput"] == 200.0 and r["perf/total_num_tokens"] == 480 and r["timing_s/gen"] == 0.5
    assert "timing_s/agent_loop/generate_sequences/max" not in r and "some/text" not in r
    assert r["perf/max_memory_allocated_gb"] == 5.0  # verl logs per role; the max of actor and critic
    assert "perf/max_memory_allocated_gb" not in steps_from_jsonl(_line(1), warmup=0, device="cpu")[0]


@pytest.mark.parametrize(
    "tail,status",
    [
        ("(WorkerDict pid=1) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB", "oom"),
        ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes", "oom"),
        ("(TemporaryActor pid=2) MemoryError", "oom"),
        ("ray.exceptions.RayTaskError(ValueError): bad config", "error"),
        ("", "error"),
    ],
)
def test_failures_are_classified_from_the_log(tail, status):
    got, error = classify_failure(1, "line\n" + tail)
    assert got == status and error


def test_run_file_measuring_options(tmp_path):
    spec = load_run(
        _run_file(
            tmp_path,
            "overrides: []\nppotune: {precision: 0.2, min_measured_steps: 3, front: [[0, 10.0, 1.5]], "
            "worst_case: true}\n",
        )
    )
    assert (spec.precision, spec.min_measured_steps, spec.front, spec.worst_case) == (0.2, 3, [[0, 10.0, 1.5]], True)
    for body, key in [
        ("ppotune: {precision: 1.5}\n", "ppotune.precision"),
        ("ppotune: {front: [[1, 2]]}\n", "ppotune.front"),
        ("ppotune: {min_measured_steps: 1}\n", "ppotune.min_measured_steps"),
        ("ppotune: {worst_case: 'yes'}\n", "ppotune.worst_case"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_run(_run_file(tmp_path, body))
        assert e.value.key == key


def test_a_running_verl_stops_once_it_measured_enough(tmp_path):
    """verl's JSONL read as it grows: tight after 3 measured steps, never at the last step (verl ends by itself)."""
    metrics = tmp_path / "m.jsonl"
    spec = load_run(_run_file(tmp_path, "overrides: []\nppotune: {steps: 6, warmup: 1, precision: 0.1}\n"))
    enough = Enough(spec, metrics, "cpu")
    assert enough() is None  # no file yet
    lines = [_line(1, **{"perf/throughput": 50.0})]
    for step, thr in [(2, 100.0), (3, 101.0)]:
        lines.append(_line(step, **{"perf/throughput": thr}))
        metrics.write_text("\n".join(lines) + "\n")
        assert enough() is None  # two measured steps: fewer than min_measured_steps
    lines.append(_line(4, **{"perf/throughput": 99.0}))
    metrics.write_text("\n".join(lines) + "\n")
    assert enough().startswith("tight") and "(after step 4 of 6)" in enough.stopped
    last = Enough(load_run(_run_file(tmp_path, "overrides: []\nppotune: {steps: 4, precision: 0.1}\n")), metrics, "cpu")
    assert last() is None
    off = Enough(load_run(_run_file(tmp_path, "overrides: []\nppotune: {steps: 6}\n")), metrics, "cpu")
    assert off() is None  # no --precision, no front: every step is measured


def test_lengths_of_verls_steps():
    rows = [
        {"prompt_length/min": 72.0, "prompt_length/mean": 72.0, "prompt_length/max": 72.0}
        | {"response_length/min": 3.0, "response_length/mean": 20.0, "response_length/max": 32.0},
        {"prompt_length/min": 72.0, "prompt_length/mean": 72.0, "prompt_length/max": 72.0}
        | {"response_length/min": 5.0, "response_length/mean": 10.0, "response_length/max": 30.0},
    ]
    got = lengths_of(rows)
    # one length for every prompt: its percentiles are exact; verl logs none for responses of several lengths
    assert got["prompt"] == {"min": 72.0, "mean": 72.0, "max": 72.0, "p10": 72.0, "p50": 72.0, "p90": 72.0}
    assert got["response"] == {"min": 3.0, "mean": 15.0, "max": 32.0}
    assert lengths_of([{"perf/throughput": 1.0}]) == {}


def test_worst_case_overrides_are_the_documented_keys(tmp_path):
    over = worst_case_overrides(tmp_path / "w.parquet")
    assert [override_key(o) for o in over] == list(WORST_CASE_KEYS) and all(o.startswith("++") for o in over)
    assert "++actor_rollout_ref.rollout.ignore_eos=True" in over


def test_a_verl_trial_runs_the_trial_world_and_exports_production():
    """tuner.trials.runners.VerlEngine: the trial's world after the base, its run options from the trial's config."""
    from tuner.trials.runners import VerlEngine

    engine = VerlEngine("py", ("a=1", "trainer.nnodes=2"), steps=5, warmup=1, world=("trainer.nnodes=1", "b=2"))
    config = {
        "trainer": {"total_training_steps": 1},
        "ppotune": {"warmup_steps": 0, "worst_case": True, "precision": None, "front": []},
    }
    probe = engine.run_file({"k": True}, config)
    assert probe["overrides"] == ["a=1", "trainer.nnodes=2", "trainer.nnodes=1", "b=2", "k=true"]
    assert probe["ppotune"] == {"python": "py", "steps": 1, "warmup": 0, "memory_limit_gb": None, "worst_case": True}
    config["ppotune"].update(worst_case=False, precision=0.2, min_measured_steps=3, front=[[0, 1.0, 2.0]])
    config["trainer"]["total_training_steps"] = 5
    opts = engine.run_file({}, config)["ppotune"]
    assert opts["precision"] == 0.2 and opts["front"] == [[0, 1.0, 2.0]] and "worst_case" not in opts
    exported = VerlEngine("py", engine.base_overrides, steps=5, warmup=1).run_file({"k": 1})  # export: no world
    assert exported["overrides"] == ["a=1", "trainer.nnodes=2", "k=1"]


def test_verls_default_trainer_path_needs_transfer_queue(tmp_path):
    """verl's v1 trainer (its default, what a CPU trial runs too) keeps a step's batch in TransferQueue: an engine
    environment without it is refused in one line naming the key, unless the run file takes the legacy trainer."""
    from trainer.verl_engine.adapter import _check_version

    spec = load_run(_run_file(tmp_path, "overrides: []\n"))
    with pytest.raises(ConfigError) as e:
        _check_version(spec, "cpu", "0.9.1", has_tq=False)
    assert e.value.key == "ppotune.python" and "pip install TransferQueue" in str(e.value)
    _check_version(spec, "cpu", "0.9.1", has_tq=True)
    legacy = load_run(_run_file(tmp_path, "overrides: [trainer.use_v1=False]\n"))
    _check_version(legacy, "cpu", "0.9.1", has_tq=False)


# --------------------------------------------------------------------------- memory failures in verl's log
# verl 0.9.1 runs vLLM as a server (workers/rollout/vllm_rollout/vllm_async_server.py::vLLMHttpServer, executor "mp"):
# the worker's start-up refusal reaches the log as a Ray actor's error line, prefixed with the actor and pid.
_VLLM_SHARE_BUSY = (
    "(vLLMHttpServer pid=4242) ValueError: Free memory on device cuda:0 (30.12/79.19 GiB) on startup is less than "
    "desired GPU memory utilization (0.95, 75.23 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
    "other processes."
)  # vllm/v1/worker/utils.py::request_memory
_VLLM_KV_TOO_SMALL = (
    "(vLLMHttpServer pid=4242) ValueError: To serve at least one request with the model's max seq len (4096), (0.5 "
    "GiB KV cache is needed, which is larger than the available KV cache memory (0.25 GiB). Based on the available "
    "memory, the estimated maximum model length is 2048. Try increasing `gpu_memory_utilization` (which also controls "
    "CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)  # vllm/v1/core/kv_cache_planning.py::_check_enough_kv_cache_memory


def test_a_vllm_server_that_cannot_get_its_share_is_an_oom():
    """The verl fit's first probe (vLLM at 0.95 of a device the trainer already uses) is an OOM, as in our engine."""
    status, error = classify_failure(1, "Traceback ...\n" + _VLLM_SHARE_BUSY + "\nRuntimeError: Engine core failed")
    assert status == "oom" and "less than desired GPU memory utilization" in error


def test_a_vllm_share_too_small_for_one_sequence_is_a_config_refusal_the_fit_reads_back():
    from trainer.contracts import VLLM_UTILIZATION_KEY, MemoryOutcome, memory_message

    status, error = classify_failure(1, _VLLM_KV_TOO_SMALL + "\nRuntimeError: Engine core initialization failed")
    # "config:": the tuner records it invalid (tuner.trials.launch), not a crash; the message is kept whole enough
    # for the table to find it again, though the line is longer than the 300 characters an error keeps
    assert status == "error" and error.startswith(f"config: {VLLM_UTILIZATION_KEY} too small"), error
    assert len(_VLLM_KV_TOO_SMALL) > 300 and memory_message(error).outcome is MemoryOutcome.UNDERSIZED


@pytest.mark.parametrize(
    "line",
    [
        "(WorkerDict pid=7) NCCL WARN Cuda failure 'out of memory'",  # nccl src/include/checks.h::CUDACHECK
        "(WorkerDict pid=7) NCCL WARN Failed to malloc 1048576 bytes",  # nccl src/include/alloc.h::ncclCallocDebug
        "(vLLMHttpServer pid=9) RuntimeError: CUDA Error: out of memory at csrc/cumem_allocator.cpp:62",  # wake_up
    ],
)
def test_the_log_is_read_with_the_ranks_table(line):
    assert classify_failure(1, "line\n" + line) == ("oom", line)
