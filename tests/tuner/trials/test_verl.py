"""One reading of a verl run file (issue 34, item 5): ``space check --engine verl``, ``search`` and its ``--dry-run``
compose the run file the same way (:func:`tuner.trials.verl.verl_search`), with the keys a trial on this machine adds
(the CPU shim's on a CPU), so the check and the search judge the same config. Real Hydra composition in the verl
venv (no verl run); without the venv: skipped, saying why."""

from __future__ import annotations

import pytest
import yaml

from support import REPO, verl_preset_run
from trainer.config import flatten
from trainer.verl_engine.adapter import load_run, run_device
from tuner.trials.verl import verl_search

VERL_PY = REPO / ".venv-verl" / "bin" / "python"
SPACE = REPO / "search_spaces" / "verl_cpu.yaml"


@pytest.fixture(scope="module")
def preset_run(cli, tmp_path_factory):
    if not VERL_PY.exists():
        reason = f"verl venv not installed ({VERL_PY} is missing: scripts/install_test_deps.sh)"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    return verl_preset_run(cli, tmp_path_factory.mktemp("verl_run_file"), VERL_PY)


def test_space_check_search_and_dry_run_read_the_preset_alike(cli, preset_run):
    """The preset (``ppotune make-preset verl``) leaves the rollout to the machine: on a CPU the check composes it
    with the CPU keys, as the search does, instead of failing on verl's mandatory ``rollout.name``."""
    assert run_device(load_run(preset_run)) == "cpu"  # no GPU here: what a trial runs on
    r = cli("space", "check", preset_run, "--space", SPACE, "--engine", "verl", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{SPACE}: OK" in r.stdout
    nested, engine, _ = verl_search(preset_run, python=None, nproc=None, steps=3, warmup=1, memory_limit_gb=None)
    flat = flatten(nested)
    # the CPU shim's keys are in the config both judge (trainer.verl_engine.adapter.CPU_KEYS)
    assert flat["actor_rollout_ref.rollout.name"] == "hf" and flat["actor_rollout_ref.actor.strategy"] == "fsdp2"
    assert flat["actor_rollout_ref.model.use_remove_padding"] is False
    # the base printed by space check is the search's
    assert f"[base: {flat['actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu']!r}]" in r.stdout
    dry = cli(
        "search", preset_run, "--engine", "verl", "--space", SPACE, "--trials", 2, "--dry-run", "--out",
        preset_run.parent / "dry", timeout=300,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert not (preset_run.parent / "dry" / "study.db").exists()  # nothing launched or written
    # in-run sweeps (the run file's default sweep_settings) share verl's start-up: the estimate and the runs say so
    sweep = load_run(preset_run).sweep_settings
    assert sweep > 1 and f"in-run sweeps: up to {sweep} settings a verl run" in dry.stdout
    assert f"up to {sweep - 1} trials past --trials 2" in dry.stdout and "as low as ~" in dry.stdout
    # what a trial runs is the same base: the engine's overrides are the run file's (export writes them)
    assert list(engine.base_overrides) == load_run(preset_run).overrides


def test_a_run_file_that_names_its_device_is_composed_for_it(preset_run, tmp_path):
    """``ppotune.device: cuda`` (a GPU run file checked on a laptop): composed as the GPU runs it, no CPU keys."""
    run = yaml.safe_load(preset_run.read_text())
    run["overrides"] += [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    ]
    run["ppotune"]["device"] = "cuda"
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text(yaml.safe_dump(run))
    nested, _, _ = verl_search(gpu, python=None, nproc=None, steps=3, warmup=1, memory_limit_gb=None)
    assert nested["actor_rollout_ref"]["rollout"]["name"] == "vllm"
