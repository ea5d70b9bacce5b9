"""tuner.memory_model with no process: parameter counts, the analytic terms by hand, the batching it
mirrors, the regularized fit on synthetic data, leave-one-out, projection, the gate, serialization."""

from __future__ import annotations

import json
import random

import pytest
from optuna.trial import TrialState, create_trial

from trainer.contracts import PHASES
from tuner.memory_model import (
    MIN_ERROR,
    Lengths,
    MemoryModel,
    ModelShape,
    Plan,
    Sample,
    flat_config,
    largest_micro_batch,
    param_counts,
    phase_terms,
    samples_from_trials,
)
from tuner.memory_model.fit import GB, PRIOR_WEIGHTS, fit_phase, prediction_factor
from tuner.memory_model.workload import packed_micro_batches

A, M = "actor_rollout_ref.actor.", "actor_rollout_ref.model."
QWEN25_05B = ModelShape.from_dict(
    {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
)
# a hand-countable shape: h 32, i 64, 2 layers, 2 heads of 16, 1 KV head, untied, no attention bias
SMALL = ModelShape(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    model_type="llama",
)
TYPICAL = Lengths(
    {"p10": 20.0, "p50": 26.0, "p90": 40.0, "max": 64.0}, {"p10": 12.0, "p50": 48.0, "p90": 64.0, "max": 64.0}
)


def small_config(**overrides) -> dict:
    """World 2, 4 sequences per GPU of width 8 + 8, bf16 compute over fp32 masters, padded micro-batches of 2."""
    return flat_config(
        {
            M + "path": "/checkpoints/small",  # a checkpoint of shape SMALL (not the tiny preset)
            "data.train_batch_size": 8,
            "data.max_prompt_length": 8,
            "data.max_response_length": 8,
            "trainer.n_gpus_per_node": 2,
            A + "ppo_mini_batch_size": 8,
            A + "ppo_micro_batch_size_per_gpu": 2,
            "critic.ppo_micro_batch_size_per_gpu": 2,
            M + "use_remove_padding": False,
            "critic.model.use_remove_padding": False,
            M + "enable_gradient_checkpointing": False,
            "critic.model.enable_gradient_checkpointing": False,
            "algorithm.use_kl_in_reward": True,  # the reference model runs (verl builds it only for a KL)
            "actor_rollout_ref.rollout.name": "hf",  # named: unnamed on a GPU is vLLM (trainer.config.rollout_name)
            **overrides,
        }
    )


# --------------------------------------------------------------------------- shapes
def test_param_counts_match_known_checkpoints():
    assert param_counts(QWEN25_05B).actor == 494_032_768  # Qwen2.5-0.5B's parameter count
    # the tiny preset as a demo trial recorded it (num_params counted by torch)
    tiny = ModelShape.from_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 104,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "tie_word_embeddings": False,
            "head_dim": 32,
            "num_params": 87616,
        }
    )
    assert param_counts(tiny).actor == tiny.num_params
    c = param_counts(SMALL)
    assert (c.embedding, c.block, c.actor, c.critic) == (3200, 9280, 24992, 21825)
    assert c.actor_root == 6432 and c.critic_root == 3265


# --------------------------------------------------------------------------- terms by hand
def test_terms_by_hand_on_a_gpu():
    t = phase_terms(small_config(), SMALL, TYPICAL, on_gpu=True)
    ua = t["update_actor"]
    # actor: 24992 / 2 ranks x 4 B x (params + grads + 2 Adam moments); critic: 21825 / 2 x 4 B x 3; ref offloaded
    assert ua["states"] == pytest.approx(12496 * 16 + 10912.5 * 12)
    # root unit 6432 + one block 9280 gathered in bf16, plus their fp32 gradients before the reduce-scatter
    assert ua["buffers"] == pytest.approx((6432 + 9280) * 2 + (6432 + 9280) * 4)
    # 2 padded rows x 16 tokens; per token 2 layers x (2 B (6·32 + 4·16 + 4·64) + 4 B · 2·32), one more layer's
    # gradients in backward, and outside the layers 2 B·2·32 + 4 B·32
    assert ua["activations"] == pytest.approx(32 * (3 * 1280 + 256))
    # the padded mask, 2 x 16 x 16 bf16, kept by both layers + one being built
    assert ua["attention"] == pytest.approx(3 * 2 * 16 * 16 * 2)
    # bf16 logits of 32 tokens, kept once (the log-prob's gradient goes into them), and one chunk's fp32 work over
    # the 2 x 8 response rows (one chunk here: trainer.engine.logits.chunk_rows)
    assert ua["logits"] == pytest.approx(32 * 100 * 2 + 16 * 100 * (2 + 8))
    values = t["values"]
    assert values["states"] == pytest.approx(12496 * 12 + 10912.5 * 12)  # no gradients outside an update
    assert values["activations"] == pytest.approx(32 * (2 * (3 * 32 + 3 * 64) + 4 * 32))  # one layer's transient
    assert values["logits"] == 0  # the critic's head is one wide
    assert t["ref"]["buffers"] == pytest.approx((6432 + 9280) * 2)  # the host-resident ref's units copied in
    # gen: FSDP1 summons the fp32 masters; the KV cache of 4 rows x (8 + longest response 8) x 2 layers x K,V x 16
    assert t["gen"]["buffers"] == pytest.approx(24992 * 4)
    assert t["gen"]["kv_cache"] == pytest.approx(4 * 16 * 2 * 2 * 16 * 2)
    assert t["reward"]["activations"] == 0 and t["adv"]["buffers"] == 0


def test_a_role_the_run_does_not_build_holds_no_memory():
    """A critic-free estimator builds no critic, a run with no KL no reference model (verl's need_critic,
    need_reference_policy): their phases and states are 0, the actor's terms unchanged."""
    gae = phase_terms(small_config(), SMALL, TYPICAL, on_gpu=True)
    grpo = phase_terms(small_config(**{"algorithm.adv_estimator": "grpo"}), SMALL, TYPICAL, on_gpu=True)
    assert grpo["update_actor"]["states"] == pytest.approx(12496 * 16)  # the actor's alone
    # the critic's phases hold what a phase that runs nothing holds (the actor's resident states)
    assert grpo["values"] == grpo["update_critic"] == grpo["adv"] and grpo["adv"]["states"] == 12496 * 12
    assert grpo["update_actor"]["activations"] == gae["update_actor"]["activations"]
    no_kl = phase_terms(small_config(**{"algorithm.use_kl_in_reward": False}), SMALL, TYPICAL, on_gpu=True)
    assert no_kl["ref"] == no_kl["adv"] and gae["ref"]["buffers"] > 0


def test_terms_follow_the_knobs():
    base = phase_terms(small_config(), SMALL, TYPICAL, on_gpu=True)
    ckpt = phase_terms(small_config(**{M + "enable_gradient_checkpointing": True}), SMALL, TYPICAL, on_gpu=True)
    # checkpointing keeps each layer's input (h x 2 B) plus one layer recomputed (and its gradients)
    assert ckpt["update_actor"]["activations"] == pytest.approx(32 * (2 * 32 * 2 + 2 * 1280 + 256))
    prefetch = phase_terms(small_config(**{A + "fsdp_config.forward_prefetch": True}), SMALL, TYPICAL, on_gpu=True)
    assert prefetch["old_log_prob"]["buffers"] - base["old_log_prob"]["buffers"] == pytest.approx(9280 * 2)
    offload = phase_terms(
        small_config(**{A + "fsdp_config.param_offload": True, A + "fsdp_config.optimizer_offload": True}),
        SMALL,
        TYPICAL,
        on_gpu=True,
    )
    assert offload["values"]["states"] == pytest.approx(10912.5 * 12)  # the actor is in host memory
    assert offload["update_actor"]["states"] == base["update_actor"]["states"]  # ... but not during its update
    cpu = phase_terms(
        small_config(**{A + "fsdp_config.param_offload": True}), SMALL, TYPICAL, on_gpu=False
    )  # no device apart: every state (and the reference model) counts in every phase
    assert cpu["values"]["states"] == pytest.approx(12496 * 12 + 10912.5 * 12 + 12496 * 4)
    assert cpu["update_critic"]["states"] - cpu["values"]["states"] == pytest.approx(10912.5 * 4)


# --------------------------------------------------------------------------- micro-batches
def test_largest_micro_batch_fixed_and_worst_case():
    kw = dict(num_rows=32, max_prompt_length=64, max_response_length=64)
    one = largest_micro_batch(TYPICAL, Plan(False, 1, 0), remove_padding=True, **kw)
    assert (one.tokens, one.response_tokens, one.rows) == (128, 64, 1)  # the longest sequence
    padded = largest_micro_batch(TYPICAL, Plan(False, 8, 0), remove_padding=False, **kw)
    assert (padded.tokens, padded.response_tokens) == (8 * 128, 8 * 64)  # rows x padded width, whatever the lengths
    packed = largest_micro_batch(TYPICAL, Plan(False, 8, 0), remove_padding=True, **kw)
    assert 8 * 60 < packed.tokens < 8 * 128
    worst = Lengths.worst_case(64, 64)
    assert largest_micro_batch(worst, Plan(False, 8, 0), remove_padding=True, **kw).tokens == 8 * 128
    # 32 sequences of 128 under 1000 tokens: ceil(4096 / 1000) = 5 micro-batches of 6 or 7 sequences, the largest
    # 7 x 128 = 896 tokens: the packing's actual micro-batch, not the budget
    filled = largest_micro_batch(worst, Plan(True, None, 1000), remove_padding=True, **kw)
    assert (filled.tokens, filled.response_tokens, filled.rows) == (7 * 128, 7 * 64, 7)
    assert largest_micro_batch(worst, Plan(True, None, 1000), remove_padding=False, **kw).tokens == 7 * 128
    # 8 of 128 under 1000: 2 micro-batches of 4 would hold 512 each, but ceil(1024 / 1000) = 2 is what verl tries
    # first and it fits
    few = largest_micro_batch(worst, Plan(True, None, 1000), remove_padding=True, **{**kw, "num_rows": 8})
    assert few.tokens == 4 * 128
    # 8 of 120 under 200: ceil(960 / 200) = 5 parts would put two sequences (240) in one; verl repartitions up to
    # 8 micro-batches of one sequence each: 120 tokens, not the 200 of a budget filled to its cap
    tight = largest_micro_batch(
        Lengths.worst_case(60, 60),
        Plan(True, None, 200),
        num_rows=8,
        max_prompt_length=60,
        max_response_length=60,
        remove_padding=True,
    )
    assert (tight.tokens, tight.rows) == (120, 1)
    typical = largest_micro_batch(TYPICAL, Plan(True, None, 1000), remove_padding=True, **kw)
    assert typical.tokens <= 1000
    padded = largest_micro_batch(TYPICAL, Plan(True, None, 1000), remove_padding=True, pad_multiple=256, **kw)
    assert padded.tokens == -(-typical.tokens // 256) * 256 and padded.rows == typical.rows


def test_packed_micro_batches_are_the_engines():
    """What the memory model sizes is what our engine's step runs: its plan_micro_batches over a batch's host
    masks (the engine's own path, one rank) makes the same micro-batches from the same lengths."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("torch")  # trainer.engine imports it
    import torch

    from trainer.engine.batching import HostMasks
    from trainer.engine.passes import plan_micro_batches
    from trainer.engine.roles import MicroBatching

    rng = random.Random(0)
    for _ in range(100):
        lengths = [rng.randint(10, 128) for _ in range(rng.randint(1, 40))]
        budget = rng.choice([128, 256, 384, 1000, 4096])
        attention = np.zeros((len(lengths), 128), dtype=bool)
        for i, n in enumerate(lengths):
            attention[i, 128 - n :] = True
        masks = HostMasks(attention, attention[:, 64:], 64)
        rows = list(range(len(lengths)))
        (engine,) = plan_micro_batches(masks, [rows], MicroBatching(True, None, budget), torch.device("cpu"))
        assert packed_micro_batches([float(x) for x in lengths], budget) == engine


# --------------------------------------------------------------------------- the fit
KNOB_SETS = [
    {
        A + "use_dynamic_bsz": dyn,
        **({A + "ppo_max_token_len_per_gpu": m} if dyn else {A + "ppo_micro_batch_size_per_gpu": m}),
    }
    for dyn, m in [(False, 1), (False, 2), (False, 4), (False, 8), (False, 16), (True, 256), (True, 512), (True, 2048)]
]
WIDE = ModelShape(1000, 128, 384, 2, 4, 2, 32, model_type="qwen2")


def grid_config(i: int) -> dict:
    """Distinct configs of one study: per-GPU batch 16 x (64 + 64), knobs varied (the critic follows the actor)."""
    knobs = dict(KNOB_SETS[i % len(KNOB_SETS)])
    rm, gc = bool(i // len(KNOB_SETS) % 2), bool(i // (2 * len(KNOB_SETS)) % 2)
    if not knobs[A + "use_dynamic_bsz"]:
        knobs["critic.ppo_micro_batch_size_per_gpu"] = knobs[A + "ppo_micro_batch_size_per_gpu"]
    else:
        knobs["critic.ppo_max_token_len_per_gpu"] = knobs[A + "ppo_max_token_len_per_gpu"]
    return flat_config(
        {
            M + "path": "/checkpoints/wide",  # a checkpoint of shape WIDE (not the tiny preset)
            "actor_rollout_ref.rollout.name": "hf",  # HF generate's terms in gen (unnamed on a GPU: vLLM)
            "data.train_batch_size": 32,
            "data.max_prompt_length": 64,
            "data.max_response_length": 64,
            "trainer.n_gpus_per_node": 2,
            A + "ppo_mini_batch_size": 32,
            "critic.ppo_mini_batch_size": 32,
            M + "use_remove_padding": rm,
            "critic.model.use_remove_padding": rm,
            M + "enable_gradient_checkpointing": gc,
            "critic.model.enable_gradient_checkpointing": gc,
            **knobs,
        }
    )


TRUE_WEIGHTS = {"activations": 1.4, "logits": 0.7, "carry": 0.3}  # states, buffers, attention: 1 (the prior)
TRUE_CONSTANT_GB = 0.02


def truth() -> MemoryModel:
    m = MemoryModel.analytic(WIDE, on_gpu=True, lengths=TYPICAL)
    for p in PHASES:
        m.weights[p] = {**m.weights[p], **TRUE_WEIGHTS}
        m.constants_gb[p] = TRUE_CONSTANT_GB
    return m


def synthetic(indices, noise: float, seed: int = 0) -> list[Sample]:
    """Samples whose peaks are the true model's, times (1 + noise x N(0, 1))."""
    rng, m = random.Random(seed), truth()
    out = []
    for i in indices:
        cfg = grid_config(i)
        pred = m.predict(cfg)
        by_phase = {p: v * (1 + noise * rng.gauss(0, 1)) for p, v in pred.by_phase_gb.items()}
        out.append(Sample(cfg, WIDE, TYPICAL, by_phase, max(by_phase.values()), on_gpu=True, number=i))
    return out


def test_fit_recovers_known_weights_from_noisy_synthetic_data():
    exact = MemoryModel.calibrate(synthetic(range(32), noise=0.0), noise_rel=0.001)
    for term, weight in TRUE_WEIGHTS.items():  # noiseless: the weights themselves
        assert exact.weights["update_actor"][term] == pytest.approx(weight, abs=0.01)
    # 1 % noise, every config twice, σ as the data's: within the estimate's noise
    model = MemoryModel.calibrate(synthetic(list(range(32)) * 2, noise=0.01), noise_rel=0.01)
    w = model.weights["update_actor"]
    assert w["activations"] == pytest.approx(1.4, abs=0.15)  # from the prior's 1
    assert w["logits"] == pytest.approx(0.7, abs=0.15)
    assert w["states"] == pytest.approx(1.0, abs=0.05)  # constant within the study: held at the prior
    assert model.weights["adv"]["carry"] == pytest.approx(0.3, abs=0.05)
    assert model.constants_gb["reward"] == pytest.approx(TRUE_CONSTANT_GB, rel=0.2)
    # leave-one-out: the error of 1 % noise, stated per phase and for the peak
    assert model.error["peak"]["n"] == 64 and model.error["peak"]["max"] < 0.05
    assert set(model.error["by_phase"]) == set(PHASES)


def test_leave_one_out_error_bounds_held_out_configs():
    model = MemoryModel.calibrate(synthetic(range(0, 32, 3), noise=0.03, seed=1))
    held = synthetic([i for i in range(32) if i % 3], noise=0.03, seed=2)
    errors = sorted(abs(model.predict(s.config).peak_gb - s.peak_gb) / s.peak_gb for s in held)
    assert errors[len(errors) // 2] <= model.error["peak"]["max"]  # the median held-out error is within it
    assert errors[-1] <= 2 * model.gate_error


def test_one_or_two_samples_stay_at_the_prior():
    (one,) = synthetic([5], noise=0.0)
    model = MemoryModel.calibrate([one])
    assert model.error is None and model.gate_error is None  # no stated error: the gate stays open
    for p in PHASES:
        assert model.weights[p] == pytest.approx(PRIOR_WEIGHTS, abs=0.01)  # the analytic model ...
    assert model.predict(one.config).by_phase_gb["update_actor"] == pytest.approx(
        one.by_phase_gb["update_actor"], rel=1e-3
    )
    other = model.predict(grid_config(12)).peak_gb  # ... shifted by the constant: finite elsewhere
    assert 0 < other < 10 * one.peak_gb
    assert not model.over_limit(100.0, 1.0)
    # the same config measured twice, 20 % apart: nothing to learn a slope from, nothing explodes
    twice = [
        one,
        Sample(one.config, WIDE, TYPICAL, {p: 1.2 * v for p, v in one.by_phase_gb.items()}, 1.2 * one.peak_gb, True),
    ]
    model = MemoryModel.calibrate(twice)
    assert all(0 <= w <= 2 for p in PHASES for w in model.weights[p].values())
    assert one.peak_gb < model.predict(one.config).peak_gb < 1.2 * one.peak_gb


def test_fit_phase_weights_are_non_negative():
    # peaks that fall as a feature grows: least squares would give it a negative weight
    xs = [{**dict.fromkeys(PRIOR_WEIGHTS, 0.0), "activations": a} for a in (0.1, 0.2, 0.3, 0.4)]
    weights, constant = fit_phase(xs, [1.0, 0.9, 0.8, 0.7])
    assert weights["activations"] == 0.0 and 0.7 < constant < 1.0


# --------------------------------------------------------------------------- projection, gate, storage
def test_projection_to_a_larger_world_halves_the_sharded_states():
    model = MemoryModel.calibrate(synthetic(range(0, 32, 2), noise=0.01))
    cfg = grid_config(3)
    at2, at4 = model.predict(cfg), model.predict(cfg, world=4)
    assert (at2.world, at4.world) == (2, 4)
    for p in PHASES:
        assert at4.state_gb[p] == pytest.approx(at2.state_gb[p] / 2)
        # per-GPU batch preserved: only the states move
        assert at2.by_phase_gb[p] - at4.by_phase_gb[p] == pytest.approx(at2.state_gb[p] / 2)
    hsdp = {**cfg, **{f"{s}.fsdp_size": 2 for s in ("actor_rollout_ref.actor.fsdp_config", "critic.fsdp")}}
    assert model.predict(hsdp, world=8).state_gb == pytest.approx(model.predict(hsdp).state_gb)  # shard group stays 2


def test_worst_case_is_at_least_the_typical_peak():
    model = MemoryModel.calibrate(synthetic(range(16), noise=0.01))
    for i in range(16):
        cfg = grid_config(i)
        assert model.predict(cfg, worst_case=True).peak_gb >= model.predict(cfg).peak_gb - 1e-12
    dyn = grid_config(15)  # packed, token budget 2048 > the typical mini-batch's 16 sequences
    assert (
        model.predict(dyn, worst_case=True).terms_gb["update_actor"]["activations"]
        > (model.predict(dyn).terms_gb["update_actor"]["activations"])
    )


def test_gate_says_over_only_beyond_the_error():
    model = MemoryModel.calibrate(synthetic(range(12), noise=0.03))
    err = model.gate_error
    assert err >= MIN_ERROR
    limit = 1.0
    assert model.over_limit(limit * (1 + err) * 1.01, limit)
    assert not model.over_limit(limit * (1 + err) * 0.99, limit)
    assert model.limit_margin(2 * limit * (1 + err), limit) == pytest.approx(1.0)  # graded: twice over
    assert model.near_limit(limit * 1.01, limit) and not model.near_limit(limit * 2 * (1 + err), limit)


def test_stated_errors_follow_the_leave_one_out_spread():
    model = MemoryModel.analytic(WIDE, on_gpu=True)
    k6 = prediction_factor(6)
    stats = lambda mx, rms, n=6: {"median": rms, "max": mx, "rms": rms, "n": n}  # noqa: E731
    model.error = {
        "peak": stats(0.08, 0.01),
        "phases": stats(0.1, 0.03, 54),
        "by_phase": {"adv": stats(0.3, 0.1), "gen": stats(0.05, 0.01)},
    }
    assert model.gate_error == pytest.approx(0.08)  # the worst leave-one-out error ...
    model.error["peak"] = stats(0.08, 0.04)
    assert model.gate_error == pytest.approx(k6 * 0.04)  # ... or k(n) x the RMS, when larger
    model.error["peak"] = stats(0.01, 0.005)
    assert model.gate_error == MIN_ERROR
    assert model.phase_error() == pytest.approx(k6 * 0.03)  # every phase pooled, counted as 6 trials, not 54
    assert model.phase_error("adv") == pytest.approx(k6 * 0.1)  # a phase's own spread, when larger
    assert model.phase_error("gen") == pytest.approx(k6 * 0.03)


def test_prediction_factor_is_students_t_for_one_new_trial():
    # two-sided 99 % t quantiles (tables): 4.604 at 4 degrees of freedom, 4.032 at 5, 3.250 at 9, 2.750 at 30
    for n, t in ((5, 4.604), (6, 4.032), (10, 3.250), (31, 2.750)):
        assert prediction_factor(n) == pytest.approx(t * (1 + 1 / n) ** 0.5, rel=0.015)
    assert prediction_factor(10_000) == pytest.approx(2.576, rel=0.001)  # the normal limit
    factors = [prediction_factor(n) for n in range(5, 40)]
    assert factors == sorted(factors, reverse=True)  # fewer trials, a wider statement


def test_serialization_round_trip():
    model = MemoryModel.calibrate(synthetic(range(10), noise=0.02))
    text = json.dumps(model.to_dict())  # JSON-safe: a study user attr
    again = MemoryModel.from_dict(json.loads(text))
    cfg = grid_config(13)
    assert again.predict(cfg).by_phase_gb == pytest.approx(model.predict(cfg).by_phase_gb)
    assert again.error == model.error and again.gate_error == model.gate_error
    with pytest.raises(ValueError, match="schema"):
        MemoryModel.from_dict({**model.to_dict(), "schema": 99})


def test_samples_from_trials_take_ok_trials_with_phase_peaks():
    shape = {**WIDE.to_dict(), "num_params": None}
    lengths = TYPICAL.to_dict()
    ok = dict(
        status="ok",
        memory={"by_phase_gb": {"update_actor": 0.3, "gen": 0.2}},
        memory_source="rss_above_start",
        model_shape=shape,
        lengths={"prompt": lengths["prompt"], "response": lengths["response"]},
        peak_memory_gb=0.3,
    )

    def trial(number, **attrs):
        t = create_trial(state=TrialState.COMPLETE, values=[1.0, 1.0], user_attrs=attrs)
        t.number = number
        return t

    micro = {A + "ppo_micro_batch_size_per_gpu": 4}
    trials = [
        trial(0, overrides=micro, **ok),
        trial(1, overrides={}, **{**ok, "status": "oom"}),
        trial(2, overrides={}, **{**ok, "memory": {}}),
        trial(3, overrides={}, **{**ok, "model_shape": None}),
    ]
    base = {"data": {"train_batch_size": 32}, "actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 2}}}
    (s,) = samples_from_trials(trials, base)
    assert s.number == 0 and not s.on_gpu and s.peak_gb == 0.3
    assert s.config[A + "ppo_micro_batch_size_per_gpu"] == 4 and s.config["data.train_batch_size"] == 32
    assert s.by_phase_gb == {"update_actor": 0.3, "gen": 0.2}
    assert s.lengths == TYPICAL and s.shape == WIDE


def test_a_verl_gpu_trials_rollout_windows_are_its_generation_and_push_and_vllm_counts_once():
    """A verl trial on a GPU: the plugin's allocator peaks cover the training passes; vLLM's servers are in the
    tuner's timeline over the rollout's windows (memory.external_by_phase_gb). Those become the gen and
    update_weights phases, so the objective's offset over the largest phase is the context, not vLLM again."""
    shape = {**WIDE.to_dict(), "num_params": None}
    lengths = TYPICAL.to_dict()
    attrs = dict(
        status="ok",
        memory={
            "by_phase_gb": {"old_log_prob": 12.0, "update_actor": 26.0},
            "external_by_phase_gb": {"generation": 34.0, "weight_sync": 36.0, "update_actor": 26.5},
        },
        memory_source="nvml",
        model_shape=shape,
        lengths={"prompt": lengths["prompt"], "response": lengths["response"]},
        peak_memory_gb=36.5,
    )
    t = create_trial(state=TrialState.COMPLETE, values=[1.0, 36.5], user_attrs={**attrs, "overrides": {}})
    (s,) = samples_from_trials([t], {"data": {"train_batch_size": 32}})
    passes = {"old_log_prob": 12.0, "update_actor": 26.0}
    assert s.on_gpu and s.by_phase_gb == {**passes, "gen": 34.0, "update_weights": 36.0}
    assert s.peak_gb - max(s.by_phase_gb.values()) == 0.5  # the objective's gap: not vLLM's 10 GB again
    on_cpu = {**attrs, "memory_source": "rss_above_start"}  # a CPU's timeline is another basis: left out
    t = create_trial(state=TrialState.COMPLETE, values=[1.0, 36.5], user_attrs={**on_cpu, "overrides": {}})
    (s,) = samples_from_trials([t], {"data": {"train_batch_size": 32}})
    assert "gen" not in s.by_phase_gb


def test_units_are_gib():
    t = phase_terms(small_config(), SMALL, TYPICAL, on_gpu=True)
    pred = MemoryModel.analytic(SMALL, on_gpu=True, lengths=TYPICAL).predict(small_config())
    assert pred.by_phase_gb["update_actor"] == pytest.approx(
        sum(t["update_actor"].values()) / GB + pred.terms_gb["update_actor"]["carry"]
    )
