"""``ppotune validate``: the PASS/FAIL rule with hand-computed figures, bad input in one line, and one REAL
validation (the exported config of the session's real search against its baseline, interleaved, on the
tiny CPU preset: ``ppotune train`` in its own process group, nothing stands in for it)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import optuna
import pytest
import yaml

from support import make_demo_study
from tuner.cli import main
from tuner.results.validation import StudyFigures, length_warnings, verdict
from tuner.rules.finalists import CONFIRMATION_ATTR, entry_of

STUDY = StudyFigures(
    trial=3,
    baseline=0,
    ratio=1.40,
    ratio_ci=(1.30, 1.50),
    peak_memory_gb=10.0,
    confirmed=True,
    memory_source="nvml",
)


# --------------------------------------------------------------------------- the rule
def test_a_ratio_within_5_percent_passes():
    v = verdict(ratio=1.35, ratio_ci=(1.28, 1.41), study=STUDY, peak_memory_gb=10.4)  # 1.35 / 1.40 = -3.6%
    assert v.passed
    assert v.lines[0].startswith("PASS  ratio to the baseline: measured 1.35x (90% interval 1.28–1.41)")
    assert "-3.6%, within ±5%" in v.lines[0]
    assert v.lines[1].startswith("PASS  peak memory: measured 10.400 GB") and "allowed up to 10.500 GB" in v.lines[1]


def test_a_ratio_off_by_more_passes_only_within_noise():
    v = verdict(ratio=1.25, ratio_ci=(1.10, 1.32), study=STUDY, peak_memory_gb=9.0)  # -10.7%, 1.32 >= 1.30
    assert v.passed and "the intervals overlap (within noise)" in v.lines[0]
    v = verdict(ratio=1.10, ratio_ci=(1.05, 1.15), study=STUDY, peak_memory_gb=9.0)  # -21.4%, 1.15 < 1.30
    assert not v.passed and v.lines[0].startswith("FAIL") and "do not overlap" in v.lines[0]
    v = verdict(ratio=1.30, ratio_ci=None, study=STUDY, peak_memory_gb=9.0)  # one round: the ±5% band only
    assert not v.passed
    unconfirmed = StudyFigures(3, 0, 1.40, None, 10.0, False, "nvml")  # a point: the interval must hold it
    assert verdict(ratio=1.25, ratio_ci=(1.15, 1.41), study=unconfirmed, peak_memory_gb=9.0).passed
    assert not verdict(ratio=1.25, ratio_ci=(1.15, 1.39), study=unconfirmed, peak_memory_gb=9.0).passed


def test_memory_over_5_percent_fails_a_failed_run_fails():
    v = verdict(ratio=1.40, ratio_ci=None, study=STUDY, peak_memory_gb=10.6)
    assert not v.passed and v.lines[1].startswith("FAIL  peak memory") and "+6.0%" in v.lines[1]
    # a small CPU figure: the noise floor (0.05 GB) is the tolerance, not 5% of 0.2 GB
    small = StudyFigures(3, 0, 1.40, None, 0.2, False, "rss_above_start")
    assert verdict(ratio=1.40, ratio_ci=None, study=small, peak_memory_gb=0.24, memory_floor_gb=0.05).passed
    assert not verdict(ratio=1.40, ratio_ci=None, study=small, peak_memory_gb=0.26, memory_floor_gb=0.05).passed
    # measured another way (the study's NVML vs this machine's RSS): said, not judged
    v = verdict(ratio=1.40, ratio_ci=None, study=STUDY, peak_memory_gb=99.0, memory_comparable=False)
    assert v.passed and v.lines[1].startswith("n/a   peak memory") and "not compared" in v.lines[1]
    v = verdict(ratio=1.40, ratio_ci=None, study=STUDY, peak_memory_gb=9.0, failed_runs=1)
    assert not v.passed and v.lines[0] == "FAIL  1 run(s) of the config did not end ok"
    assert not verdict(ratio=None, ratio_ci=None, study=STUDY, peak_memory_gb=9.0).passed


def test_length_warnings_flag_a_p50_or_p90_off_by_more_than_20_percent():
    study = {"prompt": {"p10": 40, "p50": 100, "p90": 200, "max": 400}, "response": {"p50": 50, "p90": 80}}
    seen = {"prompt": {"p10": 10, "p50": 115, "p90": 260, "max": 900}, "response": {"p50": 39, "p90": 80}}
    assert length_warnings(study, seen) == [
        "prompt length p90: 260 tokens here vs 200 in the study (+30%)",
        "response length p50: 39 tokens here vs 50 in the study (-22%)",
    ]  # p10 and max are not compared: a few long outliers are no different data
    assert length_warnings(study, {}) == [] and length_warnings({}, seen) == []


# --------------------------------------------------------------------------- bad input: exit 2, one line
def test_bad_input_is_one_line_naming_the_file_or_key(tmp_path, capsys):
    make_demo_study(f"sqlite:///{tmp_path / 'study.db'}")
    good = yaml.safe_load((Path(__file__).parents[2] / "configs" / "tiny_cpu.yaml").read_text())
    foreign = tmp_path / "foreign.yaml"
    foreign.write_text(yaml.safe_dump({**good, "critic": {**good["critic"], "ppo_micro_batch_size_per_gpu": 1}}))
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: many\n")
    cases = [
        ([str(tmp_path / "missing.yaml"), "--steps", "3"], "missing.yaml"),
        ([str(bad), "--steps", "3"], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
        ([str(foreign), "--steps", "3"], "its knobs match no measured trial of study 'demo'"),
        ([str(foreign), "--steps", "3", "--rounds", "0"], "--rounds must be >= 1"),
        ([str(foreign), "--steps", "1"], "--steps 1 must be more than the warm-up steps (1)"),
    ]
    for argv, needle in cases:
        assert main(["validate", *argv, "--out", str(tmp_path)]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("ppotune validate: ") and "\n" not in err and needle in err, (argv, err)
    assert not (tmp_path / "validate").exists() or not any((tmp_path / "validate").iterdir())


# --------------------------------------------------------------------------- a real validation
@pytest.mark.slow
def test_validate_runs_the_exported_config_against_the_baseline_interleaved(
    real_search, tmp_path, cli, no_processes_left
):
    db = real_search / "study.db"
    storage = f"sqlite:///{db}"
    before = [(t.number, t.state, t.user_attrs) for t in optuna.load_study(study_name=None, storage=storage).trials]
    r = cli("export", "--storage", storage, "--out", tmp_path / "exp")
    if r.returncode == 2 and "no feasible trial" in r.stderr:
        pytest.skip(f"the small real search found nothing feasible: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    r = cli("validate", tmp_path / "exp" / "best_config.yaml", "--steps", 2, "--rounds", 2, "--storage", storage)
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("ppotune validate: PASS" if r.returncode == 0 else "ppotune validate: FAIL"), r.stdout

    # the runs, interleaved and rotated, under <the config's dir>/validate/1, each a real trial's files
    d = tmp_path / "exp" / "validate" / "1"
    runs = sorted(p.name for p in d.iterdir() if p.is_dir())
    assert runs == ["01-round1-config", "02-round1-baseline", "03-round2-baseline", "04-round2-config"]
    thr = {}
    for name in runs:
        res = json.loads((d / name / "result.json").read_text())
        assert res["status"] == "ok", (name, res.get("error"))
        assert (d / name / "train.log").is_file()
        thr[name] = res["summary"]["throughput"]
    assert no_processes_left(str(d), timeout=10) == []

    # the figures: paired within each round, by hand from the runs' own results
    out = json.loads((d / "validate.json").read_text())
    ratios = [thr["01-round1-config"] / thr["02-round1-baseline"], thr["04-round2-config"] / thr["03-round2-baseline"]]
    assert out["measured"]["ratios"] == pytest.approx(ratios)
    assert out["measured"]["ratio"] == pytest.approx(statistics.median(ratios))
    assert out["passed"] is (r.returncode == 0)
    study = optuna.load_study(study_name=None, storage=storage)
    chosen = out["trial"]
    confirmed = entry_of(study.user_attrs.get(CONFIRMATION_ATTR), chosen)
    fig = out["study_figures"]
    if confirmed is not None and confirmed.get("ratio") is not None:  # what the search confirmed
        assert fig["confirmed"] and fig["ratio"] == pytest.approx(confirmed["ratio"])
    else:  # the two single trials
        by = {t.number: t.user_attrs for t in study.trials}
        assert fig["ratio"] == pytest.approx(by[chosen]["throughput"] / by[fig["baseline"]]["throughput"])
    assert f"vs the study's {fig['ratio']:.2f}x" in r.stdout
    # the same data as the study's trials: the prompts are the same, so no prompt-length warning
    assert set(out["measured"]["lengths"]) == {"prompt", "response"}
    assert not any(w.startswith("prompt length") for w in out["length_warnings"])
    # the study is only read
    after = [(t.number, t.state, t.user_attrs) for t in study.trials]
    assert after == before
