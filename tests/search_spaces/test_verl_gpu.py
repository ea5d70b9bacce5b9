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
    critic_dropped = "dropped (" in r.stdout and "critic.fsdp.param_offload: no critic" in r.stdout
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


def test_every_key_of_the_gpu_space_is_an_execution_knob_verl_reads():
    """Loading the space checks it (tuner/space/registry.py): every knob and derived key listed there, ranges in
    range; it has what issues 25 and 34 ask of it, and none of the keys verl 0.9.1 does not read."""
    from tuner.space.registry import VERL_NO_OPS
    from tuner.trials.verl import check_verl_space

    space = load_space(SPACE)
    keys = {k.key for k in space.knobs}
    rollout = "actor_rollout_ref.rollout."
    for name in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "free_cache_engine"):
        assert rollout + name in keys
    assert rollout + "enforce_eager" in keys and "actor_rollout_ref.actor.use_dynamic_bsz" in keys
    fsdp = "actor_rollout_ref.actor.fsdp_config."
    assert {"actor_rollout_ref.actor.strategy", fsdp + "forward_prefetch", fsdp + "reshard_after_forward"} <= keys
    assert {"actor_rollout_ref.actor.entropy_from_logits_with_chunking", "critic.fsdp.param_offload"} <= keys
    assert not (keys | {d.key for d in space.derived}) & set(VERL_NO_OPS)
    check_verl_space(space)


def test_vllm_knobs_are_sized_to_what_one_engine_sees():
    """max_num_seqs never above the requests one engine gets: train_batch_size x rollout.n over the engines (the
    GPUs at tensor parallel 1), 64 for the PPO example's 512 x 1 over 8, 128 for the GRPO one's 128 x 8 over 8."""
    space = load_space(SPACE)
    base = {
        "data.train_batch_size": 512,
        "actor_rollout_ref.rollout.n": 1,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "trainer.n_gpus_per_node": 8,
        "trainer.nnodes": 1,
    }
    (cap,) = [c for c in space.constraints if "max_num_seqs <=" in c.expr.text]
    seqs = "actor_rollout_ref.rollout.max_num_seqs"
    holds = lambda values: cap.expr(values.__getitem__)  # noqa: E731
    assert holds({**base, seqs: 64}) and not holds({**base, seqs: 128})
    grpo = {**base, "data.train_batch_size": 128, "actor_rollout_ref.rollout.n": 8}
    assert holds({**grpo, seqs: 128}) and not holds({**grpo, seqs: 256})


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


@pytest.mark.parametrize("no_op", ["critic.ppo_micro_batch_size_per_gpu", "critic.use_dynamic_bsz"])
def test_a_verl_space_that_varies_a_key_verl_does_not_read_is_refused(cli, tmp_path, no_op):
    """Issue 34: verl 0.9.1's critic reads its batching from critic.fsdp and critic.ppo_infer_max_token_len_per_gpu;
    a space varying critic.ppo_micro_batch_size_per_gpu (or critic.use_dynamic_bsz) would measure noise. One line
    naming the key that acts, exit 2, before verl is asked anything (search and space check alike)."""
    spec = "{type: pow2, low: 1, high: 4}" if "micro" in no_op else "{type: bool}"
    space = tmp_path / "space.yaml"
    space.write_text(
        f"knobs:\n  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: {{type: pow2, low: 1, high: 2}}\n"
        f"  {no_op}: {spec}\n"
    )
    acts = {"critic.ppo_micro_batch_size_per_gpu": "critic.fsdp.micro_batch_size_per_gpu"}.get(
        no_op, "critic.fsdp.use_dynamic_bsz"
    )
    for args in (
        ("space", "check", RUNS["ppo"], "--space", space, "--engine", "verl"),
        ("search", RUNS["ppo"], "--space", space, "--engine", "verl", "--trials", 2, "--dry-run", "--out", tmp_path),
    ):
        r = cli(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert (
            f"{space}: {no_op}: verl 0.9.1 does not read it" in r.stderr and f"the key that acts is {acts}" in r.stderr
        )
