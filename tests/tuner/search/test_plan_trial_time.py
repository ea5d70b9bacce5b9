"""A GPU trial's time reckoned from the job (tuner/search/trial_time.py): it grows with the model's parameters, the
lengths and the batch, shrinks with the world and a faster device; the hang limits are a margin over it, never below
the fixed defaults, and a flag wins; the device figures are trainer/engine/metrics.py's own table."""

from __future__ import annotations

import dataclasses

import pytest

from trainer import device_specs
from tuner.memory_model.shape import ModelShape, param_counts
from tuner.search import plan
from tuner.search.trial_time import (
    ASSUMED_MFU,
    DEFAULT_GPU,
    Job,
    gpu_named,
    hang_limits,
    trial_time,
)
from tuner.trials.launch import HANG_MARGIN, STARTUP_TIMEOUT_S, STEP_TIMEOUT_S

#: Qwen2.5-7B-Instruct's config.json fields (configs/verl_gpu_grpo.yaml's model)
QWEN_7B = dict(
    model_type="qwen2",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
N_7B = param_counts(ModelShape.from_dict(QWEN_7B)).actor
# the GRPO job: 128 prompts x 8 responses, prompts <= 512, responses <= 1024, one node of 8 GPUs, KL loss
GRPO_7B = Job(
    num_params=N_7B, prompt_length=512, response_length=1024, sequences=1024, world=8, reference=True, recompute=True
)
H100 = gpu_named("NVIDIA H100 80GB HBM3")


def _time(job: Job, gpu=H100):
    return trial_time(job, gpu, fixed_startup_s=90.0)


def test_the_7b_shape_counts_its_checkpoints_parameters():
    assert 7.6e9 < N_7B < 7.65e9  # Qwen2.5-7B: 7.61B parameters


def test_a_step_by_hand():
    """The training passes: (8·N update with checkpointing + 2·N old log-probs + 2·N reference) x tokens over the
    node's FLOP/s at the assumed MFU; the generation: 1024 decode steps, each a read of the bf16 weights."""
    t = _time(GRPO_7B)
    tokens = 1024 * (512 + 1024)
    node = 8 * 989e12 * ASSUMED_MFU
    assert t.step_parts["update"] == pytest.approx(8 * N_7B * tokens / node)
    assert t.step_parts["log_probs"] == pytest.approx(4 * N_7B * tokens / node)
    decode = 1024 * 2 * N_7B / (3.35e12 * 0.5)
    assert decode < t.step_parts["gen"] < decode * 1.5  # plus the prefill
    assert t.startup_parts == {"fixed": 90.0, "weights": pytest.approx(2 * 2 * N_7B / 1e9), "engine": 60.0}


def test_it_grows_with_the_models_parameters_and_the_response_length():
    base = _time(GRPO_7B)
    bigger = _time(dataclasses.replace(GRPO_7B, num_params=2 * N_7B))
    longer = _time(dataclasses.replace(GRPO_7B, response_length=4096))
    assert bigger.step_s == pytest.approx(2 * base.step_s) and bigger.startup_s > base.startup_s
    assert longer.step_s > 2 * base.step_s and longer.step_parts["gen"] > 3 * base.step_parts["gen"]
    # more sequences, more work; more GPUs, less each; a critic adds its passes
    assert _time(dataclasses.replace(GRPO_7B, sequences=2048)).step_s > base.step_s
    assert _time(dataclasses.replace(GRPO_7B, world=16, sequences=2048)).step_s == pytest.approx(base.step_s)
    assert _time(dataclasses.replace(GRPO_7B, critic_params=N_7B)).step_s > base.step_s


def test_a_slower_device_takes_longer_and_the_limits_follow():
    a100 = gpu_named("NVIDIA A100-SXM4-80GB")
    fast, slow = _time(GRPO_7B), _time(GRPO_7B, a100)
    assert slow.step_s > 2.5 * fast.step_s
    # this job on H100s fits in the floors; on A100s its step limit is the margin over the estimate
    assert hang_limits(fast.startup_s, fast.step_s).step_s == STEP_TIMEOUT_S
    limits = hang_limits(slow.startup_s, slow.step_s)
    assert limits.step_s == pytest.approx(HANG_MARGIN * slow.step_s) and limits.step_s > STEP_TIMEOUT_S
    assert limits.startup_s == pytest.approx(HANG_MARGIN * (slow.startup_s + slow.step_s))


def test_the_limits_never_go_below_the_floors_and_a_flag_wins():
    tiny = hang_limits(15.0, 3.0)
    assert (tiny.startup_s, tiny.step_s) == (STARTUP_TIMEOUT_S, STEP_TIMEOUT_S)
    given = hang_limits(500.0, 400.0, startup_flag=60.0, step_flag=30.0)
    assert (given.startup_s, given.step_s, given.startup_given, given.step_given) == (60.0, 30.0, True, True)
    assert "60 s (your --startup-timeout)" in given.line()


def test_device_figures_come_from_the_trainers_table():
    """One definition: the estimate's figures and the trainer's MFU read the same data sheets
    (trainer.device_specs)."""
    metrics = pytest.importorskip("trainer.engine.metrics")
    assert metrics.peak_flops is device_specs.peak_flops
    assert H100.name == "H100" and H100.peak_flops == metrics.peak_flops("NVIDIA H100 80GB HBM3")
    assert gpu_named("NVIDIA H100 PCIe").hbm_bytes_per_s < H100.hbm_bytes_per_s  # PCIe's HBM2e
    assert gpu_named("NVIDIA A100-SXM4-80GB", dtype="fp32").peak_flops == metrics.peak_flops("A100", "fp32")
    for unknown in (None, "Tesla T4"):
        g = gpu_named(unknown)
        assert g.assumed and g.name == DEFAULT_GPU
    assert "Tesla T4 is not in the device tables" in _time(GRPO_7B, gpu_named("Tesla T4")).assumptions()


def test_the_plan_uses_it_and_says_its_assumptions():
    runs = plan.runs_of(trials=8, done=0, confirm=1, probe=1, finalists=2)
    t = _time(GRPO_7B)
    est = plan.estimate(runs, parallel=1, device="cuda", steps=4, engine="verl", timing=t)
    assert est.per_run_s == pytest.approx(t.startup_s + 4 * t.step_s) and not est.measured
    assert "4 steps x ~73 s (generation 13, log-probs 20, updates 40" in est.line()
    assert "30% MFU" in t.assumptions() and "3.35 TB/s HBM" in t.assumptions()
    # the study's own measured trials still win
    assert plan.estimate(runs, parallel=1, device="cuda", steps=4, durations=[100.0], timing=t).per_run_s == 100.0
    # on a CPU (no timing): the measured per-device guesses, as before
    cpu = plan.estimate(runs, parallel=1, device="cpu", steps=8)
    assert cpu.per_run_s == plan.STARTUP_GUESS_S["cpu"] + 8 * plan.STEP_GUESS_S["cpu"]
