"""The shipped GPU space and example jobs (search_spaces/verl_gpu.yaml, configs/verl_gpu_{ppo,grpo}.yaml): each run
file composes with verl's own config (Hydra, in the verl venv) into a decision base that ``ppotune space check``
accepts with the GPU space; a trial's overrides from either side of the space (fixed micro-batches, token budgets)
compose with verl too and arrive as set, so every key of the space is verl 0.9.1's. The run files' paths are the
user's to replace (marked REPLACE): here they point at stand-in files. Without the verl venv: skipped, saying why."""

from __future__ import annotations

import random

import pytest

from support import REPO
from trainer.config import flatten
from trainer.verl_engine.adapter import compose_verl, decision_base, load_run
from trainer.verl_engine.overrides import verl_overrides
from tuner.space.load import load_space

VERL_PY = REPO / ".venv-verl" / "bin" / "python"
SPACE = REPO / "search_spaces" / "verl_gpu.yaml"
RUNS = {"ppo": REPO / "configs" / "verl_gpu_ppo.yaml", "grpo": REPO / "configs" / "verl_gpu_grpo.yaml"}
PLACEHOLDER = "/REPLACE/"


def _stand_in(run_file, tmp_path, preset):
    """The run file with its REPLACE paths under ``tmp_path``, each a link to the tiny verl preset's model or data
    file (the run file is read as the search reads it: its data files and model directories are checked first)."""
    text = run_file.read_text()
    assert PLACEHOLDER in text, f"{run_file}: the paths the user replaces are marked {PLACEHOLDER}"
    lines = [line.split("=", 1)[1] for line in text.splitlines() if PLACEHOLDER in line and "=" in line]
    assert lines, run_file
    for path in lines:
        target = tmp_path / path.strip().removeprefix(PLACEHOLDER)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            source = preset / "data" / "train.parquet" if target.suffix == ".parquet" else preset / "model"
            target.symlink_to(source)
    out = tmp_path / run_file.name
    out.write_text(text.replace(PLACEHOLDER, f"{tmp_path}/"))
    return out


@pytest.fixture(scope="module")
def preset(cli, tmp_path_factory, verl_python):
    """The tiny verl preset's model and data, standing in for the example jobs' (nothing runs them)."""
    d = tmp_path_factory.mktemp("stand_in") / "preset"
    r = cli("make-preset", "verl", "--out", d, timeout=300)
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def verl_python():
    if not VERL_PY.exists():
        reason = f"verl venv not installed ({VERL_PY} is missing: scripts/install_test_deps.sh)"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    return str(VERL_PY)


@pytest.mark.parametrize("job", ["ppo", "grpo"])
def test_each_example_job_composes_with_verl_and_passes_space_check(job, tmp_path, cli, verl_python, preset):
    run = _stand_in(RUNS[job], tmp_path, preset)
    spec = load_run(run, python=verl_python)
    nested = decision_base(spec, device="cuda")  # verl's ppo_trainer composed with the run file, read into ours
    assert nested["trainer"]["n_gpus_per_node"] == 8 and nested["data"]["max_response_length"] == 1024
    # the run file itself, as a user checks it: verl composes it, the space is checked against what it reads to
    r = cli("space", "check", run, "--space", SPACE, "--engine", "verl", "--engine-python", verl_python, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{SPACE}: OK" in r.stdout and "trainer config check: 64/64" in r.stdout, r.stdout
    critic_dropped = "dropped (" in r.stdout and "critic.ppo_micro_batch_size_per_gpu: no critic" in r.stdout
    assert critic_dropped == (job == "grpo"), r.stdout  # GRPO has no critic: its knobs drop out, and say so

    # a trial's overrides from both sides of the space compose with verl and arrive as set
    space, flat = load_space(SPACE), flatten(nested)
    rng, seen = random.Random(0), {}
    while len(seen) < 2:
        cand = space.sample(flat, rng)
        seen.setdefault(cand.overrides["actor_rollout_ref.actor.use_dynamic_bsz"], cand)
    for cand in seen.values():
        composed = flatten(compose_verl(spec, spec.overrides + verl_overrides(cand.overrides)))
        assert {k: composed.get(k) for k in cand.overrides} == cand.overrides


def test_every_key_of_the_gpu_space_is_an_execution_knob():
    """Loading the space checks it (tuner/space/registry.py): every knob and derived key listed there, ranges in
    range; and it has what issue 25 asks of it."""
    space = load_space(SPACE)
    keys = {k.key for k in space.knobs}
    rollout = "actor_rollout_ref.rollout."
    for name in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "free_cache_engine"):
        assert rollout + name in keys
    assert rollout + "enforce_eager" in keys and "actor_rollout_ref.actor.use_dynamic_bsz" in keys
    assert {"critic.ppo_micro_batch_size_per_gpu", "critic.fsdp.param_offload"} <= keys


def test_space_check_of_a_verl_run_file_refuses_what_search_refuses(cli, tmp_path):
    """No run file, or a space with ``fixed:`` keys (verl takes its settings from the run file): one line, exit 2,
    before verl is asked anything."""
    fixed = REPO / "tests" / "data" / "space_vllm_sleep.yaml"
    for args, says in (
        (("--space", SPACE, "--engine", "verl"), "--engine verl: give the verl run file"),
        ((RUNS["ppo"], "--space", fixed, "--engine", "verl"), "fixed: --engine verl takes its settings from"),
    ):
        r = cli("space", "check", *args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("ppotune space check: error: ") and says in r.stderr, r.stderr
