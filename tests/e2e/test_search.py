"""``ppotune search`` end to end: REAL trials (``ppotune train`` on the tiny preset, 2 CPU
processes, --steps 2, the shared study 3, --warmup 1). Nothing stands in for the trainer or for Optuna.

One study is shared by many assertions (module fixture): the baseline, a real distributed
hang (``ppotune.fault=hang``), a real OOM (``--memory-limit-gb 0.25``: a 1024-wide model
cannot allocate its weights under that RLIMIT_DATA cap, a 64-wide one runs), an inferred
OOM that is never launched, a real crash (``ppotune.fault=crash``: rank 1 SIGKILLs
itself), a duplicate proposal, two plain ok trials and a ``--confirm`` re-run. Trials are
enqueued through Optuna's own API so the sequence is deterministic.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState

from support import TINY_BASE, check_report_dir, processes_with, wait_until
from trainer.config import load_config
from trainer.contracts import CONSTRAINT_KEY, Status, TrialRecord, parse_storage
from tuner.cli import main
from tuner.results.view import load as load_view
from tuner.rules.budget import count_progress, counted
from tuner.rules.candidates import constraint
from tuner.space import from_params, space_from_dict

pytestmark = pytest.mark.slow

HIDDEN, MICRO, FAULT = (
    "ppotune.tiny.hidden_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "ppotune.fault",
)
SPACE = f"""
knobs:
  {HIDDEN}: {{type: categorical, choices: [64, 1024], memory: increasing, algorithm: true}}
  {MICRO}: {{type: pow2, low: 1, high: 4, memory: increasing}}
  {FAULT}: {{type: categorical, choices: [none, crash, hang], memory: none}}
"""
BASELINE = {HIDDEN: 64, MICRO: 2, FAULT: "none"}
SHARED_STEPS = 3  # the shared study's --steps (see the fixture)
# for tests whose later trials the sampler picks: nothing slow (a fault, a wide model) to stumble on
SAFE_SPACE = f"""
knobs:
  {MICRO}: {{type: pow2, low: 1, high: 4, memory: increasing}}
"""


def knobs(hidden, micro, fault="none") -> dict:
    return {HIDDEN: hidden, MICRO: micro, FAULT: fault}


def point(values: dict) -> dict:
    """Knob values as the Optuna params to enqueue (the micro-batch is its exponent: tuner.space)."""
    import yaml

    return space_from_dict(yaml.safe_load(SPACE)).to_params(values)


def values(t) -> dict:
    """A trial's knob values (Optuna holds the power-of-two micro-batch as its exponent)."""
    return from_params(t.params)


def common(d: Path, space: Path, *extra, steps: int = 2) -> list:
    return [
        TINY_BASE,
        "--space",
        space,
        "--steps",
        steps,
        "--warmup",
        1,
        "--out",
        d / "out",
        "--seed",
        0,
        "--kill-grace",
        3,
        "--confirm",  # the confirmation has its own test (test_confirm_reruns_...); a later --confirm wins
        0,
        "--probe",  # the worst-case probe has its own tests (tests/e2e/test_probe.py)
        0,
        *extra,
    ]


def load(storage: str, name: str = "tiny_cpu--space") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=storage)


def by_number(study: optuna.Study) -> dict:
    return {t.number: t for t in study.get_trials()}


def trial_where(study, **params) -> list:
    return [t for t in study.get_trials() if all(values(t).get(k) == v for k, v in params.items())]


# --------------------------------------------------------------------------- the shared study
@pytest.fixture(scope="module")
def shared(tmp_path_factory, cli):
    d = tmp_path_factory.mktemp("shared")
    space = d / "space.yaml"
    space.write_text(SPACE)
    # 3 steps: the baseline (its job's first trial, whose first step is a warm-up) measures 2, so it has an interval
    # and a challenger within its noise is a finalist: the confirmation runs (tuner.rules.finalists.within_noise)
    args = common(d, space, "--memory-limit-gb", 0.25, steps=SHARED_STEPS)
    storage = f"sqlite:///{d / 'out' / 'study.db'}"
    runs = []
    t0 = time.monotonic()
    # 1. the baseline alone
    runs.append(cli("search", *args, "--trials", 1, "--trial-timeout", 180))
    assert runs[-1].returncode == 0, runs[-1].stdout + runs[-1].stderr
    # 2. a real distributed hang, killed at a short trial timeout (resumes the study)
    load(storage).enqueue_trial(point(knobs(64, 2, "hang")))
    runs.append(cli("search", *args, "--trials", 2, "--trial-timeout", 20))
    assert runs[-1].returncode == 0, runs[-1].stdout + runs[-1].stderr
    # 3. OOM, inferred OOM, crash, a duplicate of the baseline, two ok trials (the second in the first's warm
    # job, whatever the confirmation decides); then --confirm 1. The inferred OOM and the duplicate are rejected
    # before launch: free, they do not count toward --trials
    study = load(storage)
    for p in (knobs(1024, 1), knobs(1024, 4), knobs(64, 2, "crash"), BASELINE, knobs(64, 4), knobs(64, 1)):
        study.enqueue_trial(point(p))
    runs.append(cli("search", *args, "--trials", 6, "--trial-timeout", 180, "--confirm", 1))
    assert runs[-1].returncode == 0, runs[-1].stdout + runs[-1].stderr
    return SimpleNamespace(
        dir=d, out=d / "out", storage=storage, study=load(storage), runs=runs, seconds=time.monotonic() - t0
    )


def status_of(study, status):
    return [t for t in study.get_trials() if t.user_attrs.get("status") == status]


def test_study_completes_with_baseline_first(shared):
    study = shared.study
    first = by_number(study)[0]
    assert first.user_attrs["baseline"] is True and first.user_attrs["status"] == "ok"
    assert values(first) == BASELINE and first.user_attrs["overrides"] == {}
    assert first.params[f"log2:{MICRO}"] == 1  # Optuna holds micro-batch 2 as its exponent
    assert sum(1 for t in study.get_trials() if t.user_attrs.get("baseline")) == 1
    assert count_progress(study.get_trials()) == 6
    assert len([t for t in study.get_trials() if counted(t)]) == 6


def test_every_trial_has_a_status_and_launched_ones_a_memory_source(shared):
    for t in shared.study.get_trials():
        assert t.state in (TrialState.COMPLETE, TrialState.FAIL), t
        assert t.user_attrs["status"] in set(Status)
        if t.user_attrs["status"] in ("ok", "oom", "hang", "crash"):
            # CPU: a measured trial's objective is the RSS it gained above its post-start level; the outside
            # view (psutil: no NVML on this machine) stands in where no step measured it
            source = t.user_attrs["memory_source"]
            ok = t.user_attrs["status"] == "ok"
            assert source == "rss_above_start" if ok else source in ("rss_above_start", "psutil")
            mem = t.user_attrs["memory"]
            assert mem["external_source"] == "psutil" and mem["external_peak_gb"] > 0
            # sampled throughout at its 10 Hz: at least half the rate (a later warm trial lasts ~1 s)
            took = t.user_attrs["duration_s"]
            assert mem["samples"] >= 5 * took, (t.number, mem["samples"], took)
            assert t.user_attrs["duration_s"] > 0
            assert Path(t.user_attrs["log_path"]).is_file()


def test_pareto_front_is_feasible_and_not_empty(shared):
    # a duplicate is told its twin's values: to Optuna it is the same point again, beside its twin
    front = [t for t in shared.study.best_trials if t.user_attrs["status"] != "duplicate"]
    assert front
    for t in front:
        # graded: peak / limit - 1 (the limit: host RAM on CPU)
        assert t.user_attrs["status"] == "ok" and -1.0 < t.constraints[CONSTRAINT_KEY] <= 0.0
        assert t.constraints[CONSTRAINT_KEY] == pytest.approx(t.user_attrs["constraint"])
        assert t.values[0] == pytest.approx(t.user_attrs["throughput"])
        assert t.values[1] == pytest.approx(t.user_attrs["peak_memory_gb"])
        # CPU: the objective is the inside view, the RSS gained above the post-start level; the outside view (the
        # largest process's whole RSS, libraries included) is kept beside it
        mem = t.user_attrs["memory"]
        assert 0 < t.values[1] < mem["external_peak_gb"] and t.values[1] < mem["rss_peak_gb"]


def test_real_oom_is_infeasible_and_the_study_goes_on(shared):
    (oom,) = status_of(shared.study, "oom")
    assert values(oom) == knobs(1024, 1)
    assert oom.state == TrialState.COMPLETE
    # graded by how early in the step it ran out (the 1024-wide model: while building, before every phase)
    penalty = shared.study.user_attrs["penalty_memory_gb"]
    graded = constraint(TrialRecord.from_user_attrs(oom.user_attrs), limit_gb=penalty)
    assert oom.constraints[CONSTRAINT_KEY] == pytest.approx(graded) and graded > 1.0
    assert oom.values == [0.0, pytest.approx(penalty)]
    assert "out of memory" in oom.user_attrs["error"]
    assert any(t.number > oom.number and t.user_attrs.get("status") == "ok" for t in shared.study.get_trials())


def test_dominating_config_is_inferred_oom_and_never_launched(shared):
    (oom,) = status_of(shared.study, "oom")
    (inf,) = status_of(shared.study, "inferred_oom")
    assert values(inf) == knobs(1024, 4)
    assert inf.user_attrs["inferred_from"] == oom.number
    assert inf.state == TrialState.COMPLETE and inf.constraints == oom.constraints  # its OOM's constraint
    assert not counted(inf)
    assert inf.user_attrs["duration_s"] == 0
    assert inf.user_attrs["log_path"] is None and inf.user_attrs["config_path"] is None
    assert not (shared.out / "trials" / str(inf.number)).exists()  # no directory, no log, no process
    assert f"trials/{inf.number}/" not in "".join(r.stdout for r in shared.runs)


def test_hang_is_killed_at_the_trial_timeout_with_nothing_left(shared, no_processes_left):
    (hang,) = status_of(shared.study, "hang")
    assert values(hang) == knobs(64, 2, "hang")
    assert hang.state == TrialState.COMPLETE and hang.constraints == {CONSTRAINT_KEY: 1.0}
    assert 20 <= hang.user_attrs["duration_s"] < 20 + 3 + 10
    assert "trial-timeout" in hang.user_attrs["error"] and hang.user_attrs["log_tail"]
    assert no_processes_left(str(shared.out / "trials" / str(hang.number)), timeout=5) == []


def test_crash_is_a_failure_with_reason_and_log(shared):
    (crash,) = status_of(shared.study, "crash")
    assert values(crash) == knobs(64, 2, "crash")
    assert crash.state == TrialState.FAIL
    assert crash.user_attrs["error"] and crash.user_attrs["log_tail"]


def test_duplicate_proposal_is_recorded_not_run(shared):
    (dup,) = status_of(shared.study, "duplicate")
    assert values(dup) == BASELINE and dup.user_attrs["duplicate_of"] == 0
    # answered with its twin's values and constraint (TPE sees the point again), not run, not counted
    twin = by_number(shared.study)[0]
    assert dup.state == TrialState.COMPLETE and not counted(dup) and dup.user_attrs["duration_s"] == 0
    assert dup.values == twin.values and dup.constraints == twin.constraints
    assert not (shared.out / "trials" / str(dup.number)).exists()
    # each measured config was measured once (the confirm run aside)
    measured = [
        tuple(sorted(t.params.items()))
        for t in shared.study.get_trials()
        if t.user_attrs["status"] in ("ok", "oom", "hang", "crash") and "confirm_of" not in t.user_attrs
    ]
    assert len(measured) == len(set(measured))


def test_confirm_reruns_the_finalists_interleaved_with_the_baseline(shared):
    """--confirm 1: one round (run again once load passes), the finalists then the baseline, each a real re-run of
    the same config (its own trial with confirm_of, outside the budget); their paired ratios are the study attribute
    ``confirmation``."""
    study = shared.study
    trials = by_number(study)
    reruns = [t for t in study.get_trials() if "confirm_of" in t.user_attrs]
    measured = [t for t in status_of(study, "ok") if "confirm_of" not in t.user_attrs]

    def dominated(t):
        return any(o.values[0] >= t.values[0] and o.values[1] <= t.values[1] and o.values != t.values for o in measured)

    conf = study.user_attrs.get("confirmation")
    if conf is None:  # nothing to confirm: the baseline dominates every other measured config
        assert not reruns and all(dominated(t) for t in measured if t.number != 0)
        pytest.skip("the baseline dominated the other ok trials: nothing was confirmed this time")
    finalists = [e["number"] for e in conf["finalists"]]
    assert conf["baseline"] == 0 and conf["rounds"] == 1 and finalists
    # the finalists of the first round (widened later when that round contradicted the single trials)
    first = (conf.get("suspect") or {}).get("first_finalists") or finalists
    for n in first:  # a measured config besides the baseline, on the front or within noise of the best
        assert n != 0 and trials[n].user_attrs["status"] == "ok" and "confirm_of" not in trials[n].user_attrs
        best = max(measured, key=lambda t: t.values[0]).user_attrs.get("throughput_ci")
        ci = trials[n].user_attrs.get("throughput_ci")
        assert not dominated(trials[n]) or (best and ci and ci[1] >= best[0]), n
    # round 1: the finalists, then the baseline (cut short where the load outlasted the wait); each re-run is the same
    # config, and no budget trial
    order = first + [0]
    assert [t.user_attrs["confirm_of"] for t in reruns[: len(order)]] == order[: len(reruns)]
    assert len(reruns) >= len(order) or conf.get("load_wait")
    for c in reruns:
        orig = trials[c.user_attrs["confirm_of"]]
        assert c.params == orig.params and c.user_attrs["overrides"] == orig.user_attrs["overrides"]
        assert not counted(c) and c.user_attrs["baseline"] is False
        assert c.user_attrs["status"] == "ok" and c.user_attrs["throughput"] > 0
    out = shared.runs[-1].stdout
    assert "confirm round 1: " + " ".join(f"#{n}" for n in first + [0]) in out
    loaded = any((c.user_attrs.get("load") or {}).get("loaded") for c in reruns)
    assert bool(conf["loaded_rounds"]) == loaded
    if conf.get("load_wait"):  # the load beside it (the other test worker) outlasted the wait: said, not claimed
        assert loaded and not conf["complete"] and "--confirm" in conf["load_wait"]["reconfirm"]
        assert "under load" in out
        return
    assert conf["complete"]
    if loaded or conf.get("suspect") or len(reruns) != len(first) + 1:
        return  # a round ran again once the load had passed, or the finalists widened: the race's own tests
    # the aggregate, by hand: one round, so the ratio is the finalist's re-run over the baseline's, and its interval
    # comes from the two runs' own measured noise (tuner.rules.race.paired_interval)
    base_thr = reruns[-1].user_attrs["throughput"]
    for e, c in zip(conf["finalists"], reruns):
        assert e["trials"] == [c.number] and e["rounds"] == 1
        assert e["ratio"] == pytest.approx(c.user_attrs["throughput"] / base_thr, rel=1e-5)
        assert e["ratio_ci"][0] < e["ratio"] < e["ratio_ci"][1]
        assert e["peak_memory_gb"] == pytest.approx(c.user_attrs["peak_memory_gb"], abs=1e-4)  # kept to 4 decimals
    assert f"confirmed: trial {finalists[0]}: {conf['finalists'][0]['ratio']:.2f}x the baseline" in out


def test_trial_files_follow_the_contract(shared):
    ok = [t for t in status_of(shared.study, "ok") if not t.user_attrs.get("baseline")][0]
    d = shared.out / "trials" / str(ok.number)
    assert Path(ok.user_attrs["config_path"]) == d / "config.yaml"
    assert Path(ok.user_attrs["result_path"]) == d / "result.json"
    cfg = load_config(d / "config.yaml")
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == values(ok)[MICRO]
    assert cfg.trainer.n_gpus_per_node == 2 and cfg.trainer.total_training_steps == SHARED_STEPS
    assert cfg.ppotune.memory_limit_gb == 0.25
    # the trial command carries only the (complete) config and the result path: parsed once
    first = (d / "train.log").read_text().splitlines()[0]
    assert first.endswith(f"train {d / 'config.yaml'} --result {d / 'result.json'}"), first
    for key in (
        "throughput",
        "throughput_cv",
        "step_s",
        "peak_memory_gb",
        "timing_s",
        "notes",
        "error",
        "log_tail",
        "log_path",
        "result_path",
        "config_path",
        "duration_s",
        "overrides",
        "baseline",
    ):
        assert key in ok.user_attrs, key
    assert set(ok.user_attrs["timing_s"]) >= {"gen", "update_actor", "update_critic", "step"}


def test_trials_run_warm_and_a_fault_ends_their_job(shared):
    """The default runner: the trials of a search share a warm job; an OOM, a crash or a hang ends it."""
    launched = [t for t in shared.study.get_trials() if t.user_attrs["status"] in ("ok", "oom", "hang", "crash")]
    notes = {t.number: [n for n in t.user_attrs["notes"] if n.startswith(("warm:", "cold:"))] for t in launched}
    assert all(len(n) == 1 and n[0].startswith("warm: trial ") for n in notes.values()), notes
    for t in launched:
        ended = notes[t.number][0].endswith("the job ended with it")
        assert ended == (t.user_attrs["status"] != "ok"), (t.number, notes[t.number])
    # run 3's job was started ahead of its first trial (or for a trial after a fault); its later trials (and any
    # --confirm re-runs) ran in it, without a start-up of their own
    later = [t for t in launched if not notes[t.number][0].startswith("warm: trial 1 of job ")]
    assert all(" (started " in notes[t.number][0] for t in later)
    assert later and all(t.user_attrs["status"] == "ok" for t in later)


def test_study_attrs_follow_the_contract(shared):
    ua = shared.study.user_attrs
    assert ua["ppotune_schema"] == 1
    assert ua["nproc"] == 2 and ua["steps"] == SHARED_STEPS and ua["warmup"] == 1
    assert ua["memory_limit_gb"] == 0.25
    assert ua["device"]["kind"] == "cpu" and ua["device"]["memory_total_gb"] > 0
    assert ua["base_config"]["trainer"]["n_gpus_per_node"] == 2
    assert set(ua["space"]["knobs"]) == {HIDDEN, MICRO, FAULT}
    assert ua["space_path"].endswith("space.yaml") and ua["base_config_path"].endswith("tiny_cpu.yaml")
    assert [d.name for d in shared.study.directions] == ["MAXIMIZE", "MINIMIZE"]


def test_one_plain_line_per_finished_trial(shared):
    out = "".join(r.stdout for r in shared.runs)
    for t in shared.study.get_trials():
        lines = [ln for ln in out.splitlines() if ln.startswith(f"trial {t.number:4d} ")]
        assert len(lines) == 1, (t.number, lines)
        assert t.user_attrs["status"] in lines[0]


def test_resume_refuses_a_different_setup(shared, cli):
    r = cli(
        "search",
        *common(shared.dir, shared.dir / "space.yaml", "--memory-limit-gb", 0.25, steps=SHARED_STEPS),
        *("--trials", 7, "--nproc", 1),
    )
    assert r.returncode == 2
    assert "nproc=2" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- stop and resume
def _start(cli, d, space, trials):
    return cli.popen("search", *common(d, space), "--trials", trials, "--trial-timeout", 180)


def _ranks_running(trial_dir: Path) -> bool:
    """The trial's ranks are up: a cold trial's name its directory; a warm job's (trainer.rank.serve, under
    <out>/jobs) have been handed the trial once its log exists."""
    if any("trainer.rank.run" in " ".join(p.cmdline()) for p in processes_with(str(trial_dir))):
        return True
    jobs = processes_with(str(trial_dir.parent.parent / "jobs"))
    return any("trainer.rank.serve" in " ".join(p.cmdline()) for p in jobs) and (trial_dir / "train.log").is_file()


def test_sigint_then_sigkill_then_resume_loses_and_duplicates_nothing(tmp_path, cli, no_processes_left):
    space = tmp_path / "space.yaml"
    space.write_text(SAFE_SPACE)
    out = tmp_path / "out"
    storage = f"sqlite:///{out / 'study.db'}"

    # Ctrl-C while the baseline runs: the trial is killed, marked interrupted and enqueued again
    tuner = _start(cli, tmp_path, space, 2)
    assert wait_until(lambda: _ranks_running(out / "trials" / "0"), 90), tuner.poll()
    tuner.send_signal(signal.SIGINT)
    text = tuner.communicate(timeout=60)[0]
    assert tuner.returncode == 130, text
    assert no_processes_left(str(out), timeout=10) == []
    t0 = by_number(load(storage))[0]
    assert t0.state == TrialState.FAIL and t0.user_attrs["status"] == "interrupted"
    (retry,) = load(storage).get_trials(states=(TrialState.WAITING,))
    assert retry.user_attrs["retry_of"] == 0 and retry.user_attrs["baseline"] is True

    # SIGKILL while the retry runs: no trial process survives the tuner
    tuner = _start(cli, tmp_path, space, 2)
    assert wait_until(lambda: _ranks_running(out / "trials" / str(retry.number)), 90), tuner.poll()
    tuner.kill()
    tuner.wait()
    assert no_processes_left(str(out), timeout=20) == []
    assert by_number(load(storage))[retry.number].state == TrialState.RUNNING  # left behind

    # the same command again: the stale trial is swept, re-run, and the study completes
    r = cli("search", *common(tmp_path, space), "--trials", 2, "--trial-timeout", 180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert no_processes_left(str(out), timeout=10) == []
    study = load(storage)
    trials = study.get_trials()
    assert count_progress(trials) == 2
    interrupted = [t.number for t in trials if t.user_attrs.get("status") == "interrupted"]
    assert interrupted == [0, retry.number]
    assert "died" in by_number(study)[retry.number].user_attrs["error"]
    baselines = [t for t in trials if t.user_attrs.get("baseline") and t.user_attrs.get("status") != "interrupted"]
    assert len(baselines) == 1 and baselines[0].user_attrs["status"] == "ok"
    assert baselines[0].user_attrs["retry_of"] == retry.number
    counted_trials = [t for t in trials if counted(t)]
    assert len({tuple(sorted(t.params.items())) for t in counted_trials}) == len(counted_trials)


# --------------------------------------------------------------------------- many workers
@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_two_tuners_on_one_storage_add_up(tmp_path, cli, kind, no_processes_left):
    space = tmp_path / "space.yaml"
    space.write_text(SAFE_SPACE)
    storage = str(tmp_path / "study.log") if kind == "journal" else f"sqlite:///{tmp_path / 'study.db'}"
    args = [*common(tmp_path, space), "--trials", 3, "--trial-timeout", 300, "--storage", storage]
    tuners = [cli.popen("search", *args) for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in tuners]
    assert [p.returncode for p in tuners] == [0, 0], outs
    study = load(
        parse_storage(storage).url
        if kind == "sqlite"
        else optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))
    )
    trials = study.get_trials()
    counted_trials = [t for t in trials if counted(t)]
    assert len(counted_trials) == 3
    assert all(t.state.is_finished() for t in trials)
    owners = {t.user_attrs["owner"]["pid"] for t in counted_trials}
    assert owners == {p.pid for p in tuners} or len(owners) == 2  # both processes ran trials
    assert sum(1 for t in trials if t.user_attrs.get("baseline")) == 1
    assert len({tuple(sorted(t.params.items())) for t in counted_trials}) == 3  # distinct configs
    launched = [t for t in counted_trials if t.user_attrs.get("status") != "inferred_oom"]
    dirs = {Path(t.user_attrs["config_path"]).parent.name for t in launched}
    assert dirs == {str(t.number) for t in launched}
    assert no_processes_left(str(tmp_path / "out"), timeout=10) == []


def test_bad_space_exits_2_before_any_trial(tmp_path, cli):
    space = tmp_path / "bad.yaml"
    space.write_text("knobs:\n  actor_rollout_ref.actor.no_such_knob: {type: bool}\n")
    r = cli("search", TINY_BASE, "--space", space, "--trials", 3, "--out", tmp_path / "out")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert str(space) in line and "actor_rollout_ref.actor.no_such_knob" in line
    assert not (tmp_path / "out" / "trials").exists()


# --------------------------------------------------------------------------- the study, read by report and export
def test_report_and_export_on_the_real_fault_study(shared, tmp_path):
    """Every status of contracts.md §3 from REAL trials, read by report and export."""
    view = load_view(storage=shared.storage)
    statuses = {int(r["number"]): r["status"] for _, r in view.trials.iterrows()}
    assert {"ok", "oom", "inferred_oom", "hang", "crash", "duplicate"} <= set(statuses.values())
    assert main(["report", "--storage", shared.storage, "--out", str(tmp_path / "r")]) == 0
    check_report_dir(tmp_path / "r", len(statuses), statuses)
    text = (tmp_path / "r" / "report.html").read_text()
    reran = any("confirm_of" in t.user_attrs for t in shared.study.get_trials())  # see test_confirm_reruns_...
    assert ("confirms #" in text or not reran) and "same config as #" in text
    assert main(["export", "--storage", shared.storage, "--out", str(tmp_path / "e")]) == 0
    why = (tmp_path / "e" / "why.md").read_text()
    assert "nearest out-of-memory config is trial #" in why
