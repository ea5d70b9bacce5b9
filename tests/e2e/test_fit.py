"""``ppotune fit`` on REAL CPU probes under a real cap: the grid recording's job (benchmarks/data/grid_base.yaml: the
tiny model 128 wide, 32 padded sequences of <= 128 tokens per GPU, 1 process) with its fixed micro-batches under
0.15 GB (the recording's cap: micro-batch 32 runs out of memory there), the same job with token budgets and packed
sequences under 0.11 GB, and a GRPO verl run file through ``--engine verl`` (real verl 0.9.1 in .venv-verl).

What each asserts is the mechanism: every knob's fitted value ran within the limit with the others' (one probe of
the answer), its next value up ran out of memory or over the limit (or the ladder ends), in at most a third of the
runs an exhaustive sweep of the ladders takes; the exported config then trains 20 steps under the cap. That the
fitted values equal the sweep's is measured in benchmarks/bench_fit.py (the sweep is tens of runs per job).
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import yaml

from support import REPO
from trainer.contracts import Status, TrialRecord

pytestmark = pytest.mark.slow
GRID = REPO / "benchmarks" / "data" / "grid_base.yaml"
VERL_PY = REPO / ".venv-verl" / "bin" / "python"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
BUDGET = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"


def _fit(cli, out: Path, *args) -> dict:
    r = cli("fit", *args, "--out", out, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return json.loads((out / "fit.json").read_text())


def _probes(out: Path, name: str) -> list:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'study.db'}")
    return [TrialRecord.from_user_attrs(t.user_attrs) for t in study.get_trials()]


def _check_boundary(data: dict) -> None:
    """Every knob at a value that ran within the limit, the next one up out of memory or over (or no next)."""
    ladders = sum(len(k["ladder"]) for k in data["knobs"])
    assert 3 * data["probes"] <= ladders, (data["probes"], ladders)  # at most a third of an exhaustive sweep
    assert data["answer_probe"] is not None
    for k in data["knobs"]:
        assert k["value"] is not None and (k["peak_gb"] is None or k["peak_gb"] <= data["limit_gb"]), k
        assert (k["next_value"] is None) == (k["next_why"] == "top of the ladder"), k
        assert k["next_value"] is None or k["next_verdict"] in ("oom", "over", "predicted"), k


@pytest.fixture(scope="module")
def micro_fit(cli, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fit") / "micro"
    data = _fit(cli, out, GRID, "--memory-limit-gb", 0.15, "--report")
    return out, data


def test_fit_finds_the_largest_micro_batches_that_fit_the_worst_case(micro_fit, cli):
    out, data = micro_fit
    _check_boundary(data)
    values = data["values"]
    # under 0.135 GB (0.15 less the 10% headroom) the forward passes fit their whole batch, the updates do not
    assert values["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"] == 32
    rows = {k["key"]: k for k in data["knobs"]}
    assert rows[MICRO]["next_value"] == 2 * values[MICRO] and rows[MICRO]["next_verdict"] == "oom"
    # every probe is a trial of the study: a worst-case step, ok or out of memory under the cap
    probes = _probes(out, data["study"])
    assert len(probes) == data["probes"] and {p.status for p in probes} <= {Status.OK, Status.OOM}
    assert all(json.loads(Path(p.result_path).read_text())["config"]["ppotune"]["worst_case"] for p in probes)
    # the same command again resumes the finished fit: nothing probed, the same answer
    r = cli("fit", GRID, "--memory-limit-gb", 0.15, "--out", out, timeout=300)
    assert r.returncode == 0 and "(resumed)" in r.stdout, r.stdout[-2000:]
    # (the why lines may cite an earlier probe, "(probe #1)": the study's trials say whether one ran)
    assert len(_probes(out, data["study"])) == len(probes)
    assert json.loads((out / "fit.json").read_text())["values"] == values
    # the table, in why.md and in the report
    why = (out / "why.md").read_text()
    assert "| knob | what it sizes | base | **fitted** |" in why and f"**{values[MICRO]}**" in why
    page = (out / "report" / "report.html").read_text()
    assert "The largest per-GPU sizes that fit at the worst case" in page and "out of memory in update_" in page
    assert f"{MICRO}={values[MICRO]}" in (out / "verl_overrides.txt").read_text().splitlines()


def test_the_fitted_config_trains_20_steps_under_the_cap(micro_fit, cli, tmp_path):
    out, data = micro_fit
    fitted = yaml.safe_load((out / "fit.yaml").read_text())
    assert fitted["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] == data["values"][MICRO]
    r = cli("train", out / "fit.yaml", "--steps", 20, "--memory-limit-gb", 0.15, "--result", tmp_path / "r.json")
    res = json.loads((tmp_path / "r.json").read_text())
    assert r.returncode == 0 and res["status"] == "ok", (res["status"], res.get("error"), r.stderr[-2000:])
    assert len(res["steps"]) == 20


def test_fit_finds_the_largest_token_budgets_of_packed_sequences(cli, tmp_path):
    budgets = [
        "-o",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "-o",
        "actor_rollout_ref.model.use_remove_padding=true",
        "-o",
        "critic.model.use_remove_padding=true",
    ]
    data = _fit(cli, tmp_path, GRID, *budgets, "--memory-limit-gb", 0.11)
    _check_boundary(data)
    assert set(data["values"]) >= {BUDGET, "critic.ppo_max_token_len_per_gpu"}
    assert all(v % 128 == 0 for v in data["values"].values())  # whole worst-case sequences of 64 + 64 tokens


@pytest.fixture(scope="module")
def verl_grpo(cli, tmp_path_factory) -> Path:
    if not VERL_PY.is_file():
        status = REPO / ".test_deps" / "verl-venv.status"
        why = status.read_text().strip() if status.is_file() else "scripts/install_test_deps.sh was not run"
        pytest.skip(f"verl venv not installed (.venv-verl): {why}")
    d = tmp_path_factory.mktemp("verl_fit")
    r = cli("make-preset", "verl", "--out", d / "preset", timeout=300)
    assert r.returncode == 0, r.stderr
    overrides = yaml.safe_load((d / "preset" / "preset.yaml").read_text())["overrides"]
    grpo = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.use_kl_loss=true"]
    run = d / "grpo.yaml"
    run.write_text(yaml.safe_dump({"overrides": [*overrides, *grpo], "ppotune": {"python": str(VERL_PY)}}))
    return run


@pytest.mark.verl
def test_a_verl_grpo_run_file_is_fitted_through_verl(cli, verl_grpo, tmp_path):
    data = _fit(cli, tmp_path, verl_grpo, "--engine", "verl", "--engine-python", VERL_PY, "--nproc", 1)
    _check_boundary(data)
    # no critic in a GRPO job; verl's worst case (generated prompts at max_prompt_length, EOS ignored) within the
    # limit at the top of every ladder, found by the first probe (verl has no memory model: the top first)
    assert not any(k.startswith("critic.") for k in data["values"]) and data["probes"] == 1
    assert data["values"] == {k["key"]: k["ladder"][-1] for k in data["knobs"]}
    (probe,) = _probes(tmp_path, data["study"])
    ran = json.loads(Path(probe.result_path).read_text())["config"]
    assert "++actor_rollout_ref.rollout.ignore_eos=True" in ran["command"] and probe.engine == "verl"
    lines = (tmp_path / "verl_overrides.txt").read_text().splitlines()
    assert "algorithm.adv_estimator=grpo" in lines and f"{MICRO}={data['values'][MICRO]}" in lines
    fit_file = yaml.safe_load((tmp_path / "fit.yaml").read_text())
    assert fit_file["overrides"] == lines and fit_file["ppotune"]["python"] == str(VERL_PY)  # as named
