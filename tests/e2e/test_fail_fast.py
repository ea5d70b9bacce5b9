"""Fail fast: an input that cannot work is refused before any rank starts (exit 2, one line naming the file and
the key), and a search that cannot work stops with its reason (never "done" with every trial crashed).

The missing-column case is the reviewer's: the verl preset (`ppotune make-preset verl`) with its train parquet
rewritten without verl's ``reward_model`` column, for both engines (ours reads verl parquet too). The search
cases run real trials on the embedded tiny model: a base config whose every run crashes (``ppotune.fault``), and
three crashes in a row after a measured baseline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml

from support import REPO, TINY_BASE
from tuner.space import space_from_dict

pytestmark = pytest.mark.slow
VERL_PY = REPO / ".venv-verl" / "bin" / "python"
FAULT, MICRO = "ppotune.fault", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


@pytest.fixture(scope="module")
def preset(tmp_path_factory, cli) -> Path:
    """The verl preset, and beside it ``broken.parquet``: its train data without the ``reward_model`` column."""
    d = tmp_path_factory.mktemp("fail_fast")
    r = cli("make-preset", "verl", "--out", d / "preset", timeout=300)
    assert r.returncode == 0, r.stderr
    pd.read_parquet(d / "preset" / "data" / "train.parquet").drop(columns=["reward_model"]).to_parquet(
        d / "broken.parquet"
    )
    return d


def _missing(path: Path) -> str:
    return f"{path}: data.train_files: missing column 'reward_model' (verl's RL format needs prompt and reward_model"


def _verl_run_file(preset: Path, **replace: str) -> Path:
    overrides = yaml.safe_load((preset / "preset" / "preset.yaml").read_text())["overrides"]
    overrides = [f"{o.split('=', 1)[0]}={replace.get(o.split('=', 1)[0], o.split('=', 1)[1])}" for o in overrides]
    run = preset / f"run_{len(list(preset.glob('run_*.yaml')))}.yaml"
    run.write_text(yaml.safe_dump({"overrides": overrides}))
    return run


def _base(tmp_path: Path, **flat) -> Path:
    base = yaml.safe_load(TINY_BASE.read_text())
    for key, value in flat.items():
        node = base
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def test_train_refuses_the_file_before_any_rank_starts(preset, tmp_path, cli):
    broken = preset / "broken.parquet"
    r = cli("train", TINY_BASE, f"data.train_files={broken}", "--nproc", 2, "--result", tmp_path / "r.json")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().startswith(f"ppotune train: error: {_missing(broken)}"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "rank" not in r.stdout + r.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["status"] == "error" and result["error"].startswith(f"config: {_missing(broken)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no rank directory was made


def test_check_refuses_it_too(preset, cli):
    broken = preset / "broken.parquet"
    r = cli("check", TINY_BASE, f"data.train_files={broken}")
    assert r.returncode == 2 and r.stderr.strip().startswith(f"ppotune check: error: {_missing(broken)}"), r.stderr


def test_the_verl_engine_refuses_it_before_verl_starts(preset, cli):
    if not VERL_PY.is_file():
        pytest.skip("verl venv not installed (.venv-verl): scripts/install_test_deps.sh")
    broken = preset / "broken.parquet"
    run = _verl_run_file(preset, **{"data.train_files": str(broken)})
    r = cli("train", "--engine", "verl", run, "--engine-python", VERL_PY, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr
    assert r.stderr.strip() == f"ppotune train: error: {_missing(broken)}; the file has {_columns(broken)})"
    assert "verl.trainer.main_ppo" not in r.stdout  # verl was never started


def _columns(path: Path) -> str:
    return ", ".join(pd.read_parquet(path).columns)


def test_a_model_without_weights_is_refused(preset, tmp_path, cli):
    model = tmp_path / "model"
    shutil.copytree(preset / "preset" / "model", model)
    for f in model.glob("*.safetensors"):
        f.unlink()
    r = cli("check", TINY_BASE, f"actor_rollout_ref.model.path={model}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith(
        f"ppotune check: error: {TINY_BASE}: actor_rollout_ref.model.path: {model}: no weights"
    )
    r = cli("check", TINY_BASE, f"actor_rollout_ref.model.path={preset / 'preset' / 'model'}")
    assert r.returncode == 0, r.stderr  # the preset's own model passes: a config, weights, a tokenizer, a template


@pytest.mark.parametrize("engine", ["ppotune", "verl"])
def test_a_search_on_it_stops_before_anything_is_created(preset, tmp_path, cli, engine):
    broken = preset / "broken.parquet"
    out = tmp_path / "out"
    if engine == "verl":
        if not VERL_PY.is_file():
            pytest.skip("verl venv not installed (.venv-verl): scripts/install_test_deps.sh")
        base = _verl_run_file(preset, **{"data.train_files": str(broken)})
        extra = ["--engine", "verl", "--engine-python", VERL_PY, "--space", "search_spaces/verl_cpu.yaml"]
    else:
        base = _base(tmp_path, **{"data.train_files": str(broken)})
        extra = ["--space", "search_spaces/tiny_cpu.yaml", "--nproc", 2]
    r = cli("search", base, *extra, "--trials", 2, "--out", out, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr
    assert r.stderr.strip().startswith(f"ppotune search: error: {_missing(broken)}"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def _search(base: Path, space: Path, out: Path, trials: int) -> list:
    return [
        *("search", base, "--space", space, "--trials", trials, "--nproc", 2, "--steps", 2, "--warmup", 1),
        *("--out", out, "--seed", 0, "--confirm", 0, "--probe", 0, "--kill-grace", 3, "--trial-timeout", 240),
    ]


def test_a_crashing_baseline_stops_the_search_at_once(tmp_path, cli):
    """Every trial would run the base config's fault: the baseline's crash stops the search, exit 1, not 'done'."""
    base = _base(tmp_path, **{FAULT: "crash"})
    space = tmp_path / "space.yaml"
    space.write_text(f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 4, memory: increasing}}\n")
    r = cli(*_search(base, space, tmp_path / "out", 3), timeout=600)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("ppotune search: stopped: the baseline trial #0 (the base config as written) ended crash:")
    assert line.endswith("| 1 trials: crash 1") and "ppotune search: done" not in r.stdout
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    assert len(study.get_trials()) == 1
    # the same command again: the study it would resume cannot work either; said at once, nothing launched
    r = cli(*_search(base, space, tmp_path / "out", 3), timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "its baseline trial #0 ended crash (" in r.stderr and "start another study (--study NAME)" in r.stderr
    assert len(optuna.load_study(study_name=None, storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}").trials) == 1


def test_the_same_failure_three_times_stops_the_search(tmp_path, cli):
    """After a measured baseline, three configs that crash alike: the search stops there (of 10 trials asked)."""
    space = tmp_path / "space.yaml"
    text = f"""
knobs:
  {FAULT}: {{type: categorical, choices: [none, crash]}}
  {MICRO}: {{type: pow2, low: 1, high: 4, memory: increasing}}
"""
    space.write_text(text)
    out = tmp_path / "out"
    r = cli(*_search(TINY_BASE, space, out, 1), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    storage = f"sqlite:///{out / 'study.db'}"
    study = optuna.load_study(study_name=None, storage=storage)
    parsed = space_from_dict(yaml.safe_load(text))
    for micro in (1, 4, 2):
        study.enqueue_trial(parsed.to_params({FAULT: "crash", MICRO: micro}))
    r = cli(*_search(TINY_BASE, space, out, 10), timeout=900)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("ppotune search: stopped: 3 trials in a row (the last #3) ended crash with the same error:")
    assert "(--max-failures-in-a-row 3) | 4 trials: crash 3, ok 1" in line and "ppotune search: done" not in r.stdout
