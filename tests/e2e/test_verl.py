"""verl itself as the trial engine (`--engine verl`): real verl 0.9.1 on CPU, in its own venv (.venv-verl,
made by scripts/install_test_deps.sh; ``PPOTUNE_TEST_VERL_PYTHON`` names another), through the CPU shim
(trainer/verl_engine/cpu), on verl's default trainer path (``trainer.use_v1: true``).

The search every feature's test reads is a GRPO job's (what most verl users run: no critic, several responses per
prompt, the KL as a loss); the PPO job with a critic runs verl in the memory-cap and hang tests."""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import jsonschema
import optuna
import psutil
import pytest
import yaml

from support import REPO, processes_with, verl_preset_run, wait_until
from trainer.contracts import PHASES, Status, TrialRecord, memory_message
from trainer.launch.proc import processes_of
from trainer.verl_engine.adapter import SUPPORTED_VERL
from trainer.verl_engine.overrides import override_key
from tuner.trials.launch import launch_trial, train_command

pytestmark = pytest.mark.slow
VERL_PY = Path(os.environ.get("PPOTUNE_TEST_VERL_PYTHON") or REPO / ".venv-verl" / "bin" / "python")
SCHEMA = json.loads((REPO / "trainer" / "result_schema.json").read_text())
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


@contextmanager
def own_tmp() -> Iterator[Path]:
    """A short TMPDIR for what the test starts: each trial's Ray folder is made below it
    (``trainer.verl_engine.adapter.ray_temp_dir``), so this test's Ray is told from any other on the machine."""
    root = Path(tempfile.mkdtemp(prefix="p", dir="/tmp"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TMPDIR", str(root))
            yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def ray_left(root: Path) -> list[str]:
    """This test's Ray processes still alive (a folder of theirs open or named, or the test's TMPDIR inherited),
    read at once: the run ends them before it returns, with no waiting here."""
    out = []
    for p in processes_of(text=str(root), env=("TMPDIR", str(root))):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            pass
    return out


@pytest.fixture(scope="session")
def verl_python() -> Path:
    if not VERL_PY.is_file():
        status = REPO / ".test_deps" / "verl-venv.status"
        why = status.read_text().strip() if status.is_file() else "scripts/install_test_deps.sh was not run"
        pytest.skip(f"verl venv not installed (.venv-verl): {why}")
    return VERL_PY


@pytest.fixture(scope="session")
def verl_run_file(tmp_path_factory, verl_python, cli) -> Path:
    """The tiny verl preset (`ppotune make-preset verl`: sized for a 1-rank CPU run) as a run file."""
    return verl_preset_run(cli, tmp_path_factory.mktemp("verl_preset"), verl_python)


def _train(cli, run_file: Path, result: Path, *extra) -> subprocess.CompletedProcess:
    return cli(
        "train",
        "--engine",
        "verl",
        run_file,
        "--steps",
        3,
        "--warmup",
        1,
        "--nproc",
        1,
        "--result",
        result,
        *extra,
        timeout=600,
    )


#: the tiny preset as a GRPO job (verl's keys): no critic, 2 responses per prompt, the KL as a loss
GRPO = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
]
CRITIC_KNOB = "critic.model.enable_gradient_checkpointing"

#: a trial of the 2-node search below runs one node of 1 GPU: the global sizes halved (tuner.rules.world)
TRIAL_WORLD = [
    "trainer.nnodes=1",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "critic.ppo_mini_batch_size=2",
]


@pytest.fixture(scope="module")
def verl_study(cli, verl_run_file, tmp_path_factory, cpu_hog_if_asked) -> Path:
    """One small verl search of a GRPO job that every feature's test reads: 2 trials of 1 GPU for a 2-node job
    (--target-nodes 2), adaptive measurement (--precision), the worst-case probe of the pick (--probe 1), a report.
    Its space names a critic knob too, which a job without a critic does not search. A verl run per trial
    (``ppotune.sweep_settings: 1``): the in-run sweep has its own search below."""
    tmp = tmp_path_factory.mktemp("verl_study")
    run = yaml.safe_load(verl_run_file.read_text())
    run["overrides"] = [*run["overrides"], *GRPO]
    run["ppotune"]["sweep_settings"] = 1
    grpo = tmp / "grpo.yaml"
    grpo.write_text(yaml.safe_dump(run))
    space = tmp / "space.yaml"
    space.write_text(
        f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 2, memory: increasing}}\n"
        f"  {CRITIC_KNOB}: {{type: bool, memory: decreasing}}\n"
    )
    out = tmp / "out"
    with own_tmp() as root:
        r = _verl_search(cli, grpo, space, out)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        assert ray_left(root) == []
    assert "trials run 1 GPUs for a 2 x 1 = 2-GPU job" in r.stdout
    return out


def _verl_search(cli, grpo: Path, space: Path, out: Path) -> subprocess.CompletedProcess:
    return cli(
        "search",
        grpo,
        "--engine",
        "verl",
        "--engine-python",
        VERL_PY,
        "--space",
        space,
        "--trials",
        2,
        "--confirm",
        0,
        "--sampler",
        "grid",
        "--steps",
        6,
        "--warmup",
        1,
        "--precision",
        0.95,
        "--nproc",
        1,
        "--target-nodes",
        2,
        "--probe",
        1,
        "--out",
        out,
        "--report",
        "--trial-timeout",
        300,
        timeout=1500,
    )


def _ok_trials(out: Path) -> tuple[optuna.Study, dict]:
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    recs = {t.number: TrialRecord.from_user_attrs(t.user_attrs) for t in study.get_trials()}
    return study, {n: rec for n, rec in recs.items() if rec.status == Status.OK}


def test_verl_search_runs_the_trial_world_and_stops_once_measured(verl_study):
    study, ok = _ok_trials(verl_study)
    assert len(ok) == 2 and all(rec.engine == "verl" and rec.throughput > 0 for rec in ok.values())
    # the decision base read verl's GRPO config: no critic, so the critic's knob was not searched
    assert study.user_attrs["base_config"]["algorithm"]["adv_estimator"] == "grpo"
    assert all(CRITIC_KNOB not in t.params for t in study.get_trials())
    assert study.user_attrs["engine"] == "verl" and (verl_study / "report" / "report.html").is_file()
    assert study.user_attrs["target"]["world"] == 2 and study.user_attrs["target"]["trial_world"] == 1
    for rec in ok.values():
        ran = json.loads(Path(rec.result_path).read_text())
        assert all(o in ran["config"]["overrides"] for o in TRIAL_WORLD)  # production's per-GPU batch on 1 GPU
        # --precision: verl is ended once the 90% interval is tight (after 3 or 4 measured steps, on a loaded
        # machine, never all 5 asked)
        n = rec.measured_steps
        assert 3 <= n < 5 and len(ran["steps"]) == n + 1, (n, rec.notes)
        assert ran["summary"]["stopped_early"].startswith("tight") and ran["status"] == "ok"


def test_a_verl_trial_is_measured_from_verls_own_metrics(verl_study):
    """Each trial of the search is one run of verl's main_ppo, read from verl's own per-step metrics."""
    _, ok = _ok_trials(verl_study)
    for rec in ok.values():
        res = json.loads(Path(rec.result_path).read_text())
        jsonschema.validate(res, SCHEMA)
        assert res["status"] == "ok" and res["environment"]["verl"] == SUPPORTED_VERL
        steps = res["steps"]
        n = rec.measured_steps  # after one warm-up step (--precision ends verl early: see the test above)
        assert [s["step"] for s in steps] == list(range(1, n + 2))
        assert [s["warmup"] for s in steps] == [True] + [False] * n
        s = res["summary"]
        assert s["num_measured_steps"] == n
        # verl's perf/throughput (all tokens / (step time x GPUs)), the median over the measured steps
        assert s["throughput"] == pytest.approx(statistics.median(x["perf/throughput"] for x in steps[1:]))
        phases = {"gen", "old_log_prob", "adv", "update_actor", "update_weights", "step"}
        assert set(s["timing_s"]) >= phases
        assert not s["timing_s"].get("values") and not s["timing_s"].get("update_critic")  # verl built no critic
        assert all(o in res["config"]["overrides"] for o in GRPO)
        assert set(s["timing_s"]) - {"update_weights", "step", "reward", "ref"} <= set(PHASES)
        # the HF rollout's log-probs agree with the actor's recomputed ones: the weights were pushed
        assert all(x["training/rollout_probs_diff_max"] < 1e-2 for x in steps)
        assert any("verl CPU shim loaded" in n for n in res["notes"])
        assert res["config"]["command"][1:3] == ["-m", "verl.trainer.main_ppo"]


def test_verl_worst_case_probe(verl_study):
    """The pick's worst case through verl: generated prompts at data.max_prompt_length, EOS ignored."""
    study, ok = _ok_trials(verl_study)
    ((number, got),) = study.user_attrs["worst_case"].items()
    assert int(number) in ok and got["status"] == "ok", got
    assert (got["prompt_length"], got["response_length"]) == (72, 32)
    # every prompt and every response at its maximum (verl's own min == max), so the figure is the worst case
    assert got["lengths"]["prompt"]["min"] == got["lengths"]["prompt"]["max"] == 72, got["lengths"]
    assert got["lengths"]["response"]["min"] == got["lengths"]["response"]["max"] == 32, got["lengths"]
    assert not any("NOT reached" in n for n in got["notes"]) and got["peak_memory_gb"] > 0
    ran = json.loads(Path(got["result_path"]).read_text())
    cmd = ran["config"]["command"]
    assert "++actor_rollout_ref.rollout.ignore_eos=True" in cmd and "++trainer.total_training_steps=1" in cmd
    assert all(o in cmd for o in TRIAL_WORLD) and len(ran["steps"]) == 1


def test_verl_export_writes_production_and_validate_runs_it(cli, verl_study, tmp_path):
    study, ok = _ok_trials(verl_study)
    # the interpreter is named on export's command line: never taken from the study (docs/security.md)
    r = cli("export", "--storage", verl_study, "--out", tmp_path / "e", "--engine-python", VERL_PY)
    assert r.returncode == 0, r.stderr
    chosen = max(ok, key=lambda n: ok[n].throughput)
    ran = json.loads(Path(ok[chosen].result_path).read_text())["config"]
    exported = (tmp_path / "e" / "verl_overrides.txt").read_text().splitlines()
    # the exported verl command is what the winning trial ran, less its world (production's: 2 nodes, the
    # global sizes as written) and less what a trial adds for itself
    knobs = [f"{k}={v}" for k, v in ok[chosen].overrides.items()]  # the chosen knobs (none: baseline)
    assert "trainer.nnodes=2" in exported and "trainer.nnodes=1" not in exported  # the run file's own, rewritten
    assert "data.train_batch_size=8" in exported and "data.train_batch_size=4" not in exported
    base = exported[: len(exported) - len(knobs)]
    assert ran["overrides"] == base + TRIAL_WORLD + knobs
    added = ran["command"][3 + len(ran["overrides"]) :]
    assert ran["command"][3 : 3 + len(ran["overrides"])] == ran["overrides"] and all(o.startswith("++") for o in added)
    assert {override_key(o) for o in added} >= {"trainer.total_training_steps", "trainer.logger"}
    assert all(o in exported for o in GRPO)  # the run file's GRPO keys, as the trial ran them
    script = (tmp_path / "e" / "verl_command.sh").read_text()
    assert f"exec {VERL_PY} -m verl.trainer.main_ppo" in script and all(line in script for line in exported[-2:])

    # validate: the export against the study's baseline, verl both, at the trials' world (1 round of 2 steps)
    cfg = tmp_path / "e" / "best_config.yaml"
    args = ("validate", cfg, "--steps", 2, "--rounds", 1, "--storage", verl_study, "--out", tmp_path / "v")
    with own_tmp() as root:
        r = cli(*args, "--engine-python", VERL_PY, timeout=900)
        assert ray_left(root) == []
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-2000:]  # PASS or FAIL: both a verdict
    assert f"= trial #{chosen} of study" in r.stdout and "at the trials' world" in r.stdout
    (found,) = (tmp_path / "v").rglob("validate.json")
    summary = json.loads(found.read_text())
    runs = summary["measured"]["runs"]
    assert [x["status"] for x in runs["config"] + runs["baseline"]] == ["ok", "ok"] and summary["trial"] == chosen
    results = list(found.parent.rglob("result.json"))
    assert len(results) == 2
    assert all(all(o in json.loads(f.read_text())["config"]["overrides"] for o in TRIAL_WORLD) for f in results)


def test_verl_oom_under_a_memory_cap(cli, verl_python, tmp_path):
    """A 512-wide, 4-layer preset under a 0.4 GB cap per trainer rank, just above what its ranks' states hold
    (tuner.memory_model.floor refuses less before launch): the CPU allocator fails for real."""
    r = cli(
        "make-preset",
        "verl",
        tmp_path / "wide",
        "--hidden-size",
        512,
        "--layers",
        4,
        "--heads",
        8,
        "--kv-heads",
        4,
        "--intermediate",
        2048,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    run = tmp_path / "wide.yaml"
    overrides = yaml.safe_load((tmp_path / "wide" / "preset.yaml").read_text())["overrides"]
    run.write_text(yaml.safe_dump({"overrides": overrides, "ppotune": {"python": str(verl_python)}}))
    with own_tmp() as root:
        r = _train(cli, run, tmp_path / "r.json", "--memory-limit-gb", 0.4)
        assert ray_left(root) == []
    res = json.loads((tmp_path / "r.json").read_text())
    assert r.returncode == 3 and res["status"] == "oom", (res["status"], res["error"], r.stdout[-2000:])
    # the host allocator's own failure, whichever allocation hit the cap first: a tensor ("can't allocate memory"),
    # the checkpoint's mmap while loading ("Cannot allocate memory (12)", ENOMEM), Python's MemoryError
    found = memory_message(res["error"])
    assert found is not None and found.memory == "host", res["error"]


def test_verl_hang_is_killed_with_no_ray_process_left(verl_run_file, tmp_path, cpu_hog):
    """Too few logical CPUs for verl's placement bundles: it waits forever, with no error. Killed with Ray's processes
    up, on a loaded machine (one core busy beside it), and none of them left once the trial is recorded."""
    run = yaml.safe_load(verl_run_file.read_text())
    run["overrides"].append("++ray_kwargs.ray_init.num_cpus=1")
    hang = tmp_path / "hang.yaml"
    hang.write_text(yaml.safe_dump(run))
    cmd = train_command(hang, result_path=tmp_path / "r.json", engine="verl") + ["--nproc", "1", "--steps", "2"]
    with own_tmp() as root:
        r = launch_trial(cmd, trial_dir=tmp_path, result_path=tmp_path / "r.json", timeout_s=45, grace_s=5)
        assert ray_left(root) == []
    assert r.status == Status.HANG and r.leftover_pids == []
    assert "Started a local Ray instance" in Path(r.log_path).read_text()  # killed with Ray's processes up


@contextmanager
def ray_cluster_on_the_node() -> Iterator[tuple[str, Path]]:
    """``ray start --head`` in a folder of its own: (its address, the folder). Ended by
    killing the processes of that folder only (``ray stop`` ends every Ray of the machine)."""
    folder = Path(tempfile.mkdtemp(prefix="o", dir="/tmp"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["--head", "--block", f"--port={port}", f"--temp-dir={folder}", "--num-cpus=1", "--disable-usage-stats"]
    proc = subprocess.Popen([str(VERL_PY.parent / "ray"), "start", *args, "--include-dashboard=false"])
    try:
        address = folder / "ray_current_cluster"  # written by ray start once its head is up
        assert wait_until(lambda: address.is_file() and address.read_text().strip(), 120), "ray start did not come up"
        yield address.read_text().strip(), folder
    finally:
        start = psutil.Process(proc.pid)
        cluster = {p.pid: p for p in [start, *start.children(recursive=True), *processes_of(text=str(folder))]}
        left = list(cluster.values())
        for how in (psutil.Process.terminate, psutil.Process.kill):
            for p in left:
                try:
                    how(p)
                except psutil.Error:
                    pass
            _, left = psutil.wait_procs(left, timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
        assert not left, left


def _cluster_pids(folder: Path) -> set[int]:
    """The cluster's daemons (their command lines name its folder; its idle workers come and go by themselves)."""
    return {p.pid for p in processes_with(str(folder))}


def test_a_verl_search_runs_its_own_ray_beside_a_cluster_on_the_node(cli, verl_run_file, tmp_path, monkeypatch):
    """A cluster already on the node (``ray start``, named by RAY_ADDRESS) takes no trial: verl's ``ray.init`` would
    join it (ray/_private/services.py::get_ray_address_from_environment) and run the trial's workers there, without
    the trial's plugin or file logger ("exited 0 after 0 of N steps"). A search's trials (one verl run, its in-run
    sweep of two settings) are measured on a Ray of their own, and the cluster is left as it was: the same processes,
    alive."""
    space = tmp_path / "space.yaml"
    space.write_text(f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 2, memory: increasing}}\n")
    out = tmp_path / "out"
    with ray_cluster_on_the_node() as (address, folder):
        before = _cluster_pids(folder)
        monkeypatch.setenv("RAY_ADDRESS", address)
        with own_tmp() as root:
            r = cli(
                "search", verl_run_file, "--engine", "verl", "--engine-python", VERL_PY, "--space", space,
                "--trials", 2, "--confirm", 0, "--probe", 0, "--sampler", "grid", "--steps", 4, "--warmup", 1,
                "--nproc", 1, "--out", out, timeout=900,
            )  # fmt: skip
            assert ray_left(root) == []
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        assert len(before) >= 2 and _cluster_pids(folder) == before  # gcs_server, raylet, ...
    trials = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}").get_trials()
    records = [TrialRecord.from_user_attrs(t.user_attrs) for t in trials]
    assert [rec.status for rec in records] == [Status.OK, Status.OK], [(rec.status, rec.error) for rec in records]
    logs = "\n".join(Path(rec.log_path).read_text() for rec in records if rec.log_path)
    assert "Started a local Ray instance" in logs and "Connecting to existing Ray cluster" not in logs


def test_bad_engine_python_is_one_line_exit_2(cli, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("overrides: [trainer.nnodes=1]\n")
    r = cli(
        "train",
        "--engine",
        "verl",
        run,
        "--engine-python",
        tmp_path / "nope" / "python",
        "--result",
        tmp_path / "r.json",
    )
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "ppotune.python" in line and str(run) in line
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "error"


#: the in-run sweep's search: the actor's and the old-log-prob pass's micro-batches, per-step knobs both
SWEEP_KNOBS = {MICRO: (1, 4), "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (2, 8)}


@pytest.fixture(scope="module")
def sweep_study(cli, verl_run_file, tmp_path_factory) -> Path:
    """A search of the PPO preset (actor, critic) over per-step knobs only: its first launch measures 3 settings in
    one verl run (``ppotune.sweep_settings: 3``), which is the whole budget."""
    tmp = tmp_path_factory.mktemp("verl_sweep")
    space = tmp / "space.yaml"
    space.write_text(
        "knobs:\n"
        + "".join(
            f"  {k}: {{type: pow2, low: {lo}, high: {hi}, memory: increasing}}\n" for k, (lo, hi) in SWEEP_KNOBS.items()
        )
    )
    run = yaml.safe_load(verl_run_file.read_text())
    run["ppotune"]["sweep_settings"] = 3
    ppo = tmp / "ppo.yaml"
    ppo.write_text(yaml.safe_dump(run))
    out = tmp / "out"
    args = ("search", ppo, "--engine", "verl", "--space", space, "--trials", 3, "--confirm", 0, "--probe", 0)
    with own_tmp() as root:
        r = cli(*args, "--steps", 3, "--warmup", 1, "--nproc", 1, "--out", out, "--trial-timeout", 600, timeout=1200)
        assert ray_left(root) == []
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return out


def test_an_in_run_sweep_measures_each_setting_as_its_own_trial(sweep_study):
    """One verl start-up for 3 configs that differ only in per-step knobs; each is a trial of the study with its own
    figures; verl's default trainer (v1) ran it."""
    study, ok = _ok_trials(sweep_study)
    assert len(ok) == 3 and len({json.dumps(r.overrides, sort_keys=True) for r in ok.values()}) == 3
    (result,) = list(sweep_study.glob("trials/*/result.json"))  # one verl run
    res = json.loads(result.read_text())
    jsonschema.validate(res, SCHEMA)
    assert [s["status"] for s in res["settings"]] == ["ok"] * 3
    assert "TaskRunnerV1" in (result.parent / "train.log").read_text()  # verl's default trainer path
    assert all("trainer.use_v1" not in o for o in res["config"]["command"])
    for rec in ok.values():
        assert rec.throughput > 0 and rec.measured_steps == 2 and rec.engine == "verl"
        assert any("in-run sweep" in n for n in rec.notes), rec.notes
    # rising memory: the settings ran in the order of their micro-batches
    micro = [s["knobs"][MICRO] for s in res["settings"]]
    assert micro == sorted(micro), micro
    # each setting ran on the batches a run of its own gets: the dataloader replayed its order (same prompts)
    prompts = [
        [{k: v for k, v in row.items() if k.startswith("ppotune/lengths/prompt/")} for row in s["steps"]]
        for s in res["settings"]
    ]
    assert prompts[0] and all(prompts[0]) and prompts == [prompts[0]] * 3, prompts


def test_each_per_step_knob_acts_in_verl(sweep_study):
    """The setting's keys reached verl's worker calls: the micro-batches each pass cut follow them (the rank's 8
    sequences; an update of 2 mini-batches of 4), step by step."""
    res = json.loads(next(sweep_study.glob("trials/*/result.json")).read_text())
    lp = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
    for setting in res["settings"]:
        knobs = setting["knobs"]
        for row in setting["steps"]:
            assert row["ppotune/micro_batches/update_actor"] == 2 * 4 // knobs[MICRO], (knobs, row)
            assert row["ppotune/micro_batches/old_log_prob"] == 8 // knobs[lp], (knobs, row)
            # the critic runs as verl runs it: token budgets from critic.fsdp (one micro-batch per mini-batch)
            assert row["ppotune/micro_batches/update_critic"] == 2 and row["ppotune/micro_batches/values"] == 1


def test_verl_trials_record_per_phase_peaks_that_the_memory_model_fits(sweep_study):
    """Each pass's peak (reset at each worker call), the lengths' percentiles and the actor's shape: the calibration
    samples of tuner.memory_model, which fits them."""
    from tuner.memory_model import MemoryModel, samples_from_trials

    study, ok = _ok_trials(sweep_study)
    for rec in ok.values():
        phases = rec.memory["by_phase_gb"]
        assert set(phases) >= {"old_log_prob", "values", "update_critic", "update_actor"}, phases
        assert all(v > 0 for v in phases.values()) and rec.peak_memory_gb >= max(phases.values())
        assert rec.model_shape["hidden_size"] > 0 and {"p10", "p50", "p90"} <= set(rec.lengths["response"])
    samples = samples_from_trials(study.get_trials(), study.user_attrs["base_config"])
    assert len(samples) == 3
    model = MemoryModel.calibrate(samples)
    for s in samples:  # in-sample: the fit reproduces each pass's peak closely
        pred = model.predict(s.config, lengths=s.lengths)
        for phase, measured in s.by_phase_gb.items():
            assert pred.by_phase_gb[phase] == pytest.approx(measured, rel=0.25), (phase, pred.by_phase_gb, measured)
