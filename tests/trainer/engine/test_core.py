"""Pure PPO math (trainer/engine/core.py): expected values computed by hand, fp64 where exact."""

import math

import pytest
import torch

from trainer.engine import core
from trainer.engine.core import (
    AdaptiveKLController,
    FixedKLController,
    agg_token_mean,
    apply_kl_in_reward,
    compute_entropy_loss,
    compute_gae_advantage_return,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_moments,
    masked_sum,
    moments_to_mean_var,
    whiten,
)

F64 = torch.float64


def t64(*rows):
    return torch.tensor(rows, dtype=F64)


def close(actual, expected, atol=1e-12):
    actual = torch.as_tensor(actual, dtype=F64)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def right_padded_mask(lengths, num_tokens):
    return (torch.arange(num_tokens)[None, :] < torch.tensor(lengths)[:, None]).to(F64)


def test_all_is_exported():
    for name in core.__all__:
        assert callable(getattr(core, name))


# ---------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean():
    x = t64([1.0, 2.0, 100.0], [3.0, 4.0, 5.0])
    mask = t64([1, 1, 0], [1, 0, 0])
    close(masked_sum(x, mask), 6.0)
    close(masked_mean(x, mask), 2.0)
    close(masked_mean(x, mask.bool()), 2.0)


# ---------------------------------------------------------------- GAE


def test_gae_by_hand_1x3():
    rewards = t64([0.0, 0.0, 1.0])
    values = t64([0.5, 0.6, 0.7])
    mask = t64([1, 1, 1])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=2: delta = 1 - 0.7 = 0.3                        A2 = 0.3
    # t=1: delta = 0.9*0.7 - 0.6 = 0.03                 A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0.9*0.6 - 0.5 = 0.04                 A0 = 0.04 + 0.72*0.246 = 0.21712
    close(adv, t64([0.21712, 0.246, 0.3]))
    close(ret, t64([0.71712, 0.846, 1.0]))


def test_gae_by_hand_1x3_with_padding():
    rewards = t64([0.0, 1.0, 5.0])  # the 5.0 sits on padding and must be ignored
    values = t64([0.5, 0.6, 0.7])
    mask = t64([1, 1, 0])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=2 masked: A2 = 0; t=1 terminal: delta = 1 - 0.6 = 0.4; t=0: 0.04 + 0.72*0.4 = 0.328
    close(adv, t64([0.328, 0.4, 0.0]))
    close(ret, t64([0.828, 1.0, 0.7]))


def reference_gae(rewards, values, lengths, gamma, lam):
    """Plain-Python GAE over each sequence's valid prefix only (padding never seen)."""
    batch, num_tokens = rewards.shape
    adv = [[0.0] * num_tokens for _ in range(batch)]
    for b in range(batch):
        r = rewards[b].tolist()
        v = values[b].tolist()
        n = lengths[b]
        last = 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            last = r[t] + gamma * next_v - v[t] + gamma * lam * last
            adv[b][t] = last
    return torch.tensor(adv, dtype=F64)


def test_gae_matches_reference_loop_and_padding_does_not_leak():
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 1, 4, 0, 5]
    batch, num_tokens = len(lengths), 7
    rewards = torch.randn(batch, num_tokens, generator=gen, dtype=F64)
    values = torch.randn(batch, num_tokens, generator=gen, dtype=F64)
    mask = right_padded_mask(lengths, num_tokens)
    gamma, lam = 0.97, 0.9

    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=lam)
    expected = reference_gae(rewards, values, lengths, gamma, lam)
    close(adv, expected)
    close(ret, expected + values)
    assert torch.all(adv[mask == 0] == 0)

    # Garbage in the padding changes nothing at valid positions.
    pad = mask == 0
    rewards2 = torch.where(pad, torch.full_like(rewards, 1e6), rewards)
    values2 = torch.where(pad, torch.full_like(values, -1e6), values)
    adv2, ret2 = compute_gae_advantage_return(rewards2, values2, mask, gamma=gamma, lam=lam)
    assert torch.equal(adv2, adv)
    assert torch.equal(ret2[~pad], ret[~pad])

    # bool masks give the same answer
    adv3, _ = compute_gae_advantage_return(rewards, values, mask.bool(), gamma=gamma, lam=lam)
    assert torch.equal(adv3, adv)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    rewards = t64([1.0, 2.0, 3.0, 9.0])
    values = t64([0.1, 0.2, 0.3, 0.4])
    mask = t64([1, 1, 1, 0])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    close(ret[0, :3], torch.tensor([6.0, 5.0, 3.0], dtype=F64))
    close(adv[0, :3], torch.tensor([5.9, 4.8, 2.7], dtype=F64))


def test_gae_output_not_part_of_graph():
    values = torch.randn(2, 3, dtype=F64, requires_grad=True)
    adv, ret = compute_gae_advantage_return(torch.zeros(2, 3, dtype=F64), values, torch.ones(2, 3), gamma=1.0, lam=0.95)
    assert not adv.requires_grad and not ret.requires_grad


# ---------------------------------------------------------------- whitening


def reference_masked_whiten(x, mask, shift_mean=True):
    """Two-pass masked mean / unbiased variance, like verl's masked_whiten, then masked."""
    sel = x[mask.bool()]
    mean = sel.mean()
    var = sel.var(unbiased=True)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def test_masked_moments_and_mean_var():
    x = t64([1.0, 2.0, 50.0], [3.0, 6.0, -9.0])
    mask = t64([1, 1, 0], [1, 1, 0])
    total, total_sq, count = masked_moments(x, mask)
    close(total, 12.0)
    close(total_sq, 1 + 4 + 9 + 36)
    close(count, 4.0)
    mean, var = moments_to_mean_var(total, total_sq, count)
    close(mean, 3.0)
    close(var, (4 + 1 + 0 + 9) / 3)  # unbiased
    _, var_biased = moments_to_mean_var(total, total_sq, count, unbiased=False)
    close(var_biased, 14 / 4)
    # python numbers are accepted as well
    mean_f, var_f = moments_to_mean_var(12.0, 50.0, 4)
    close(mean_f, 3.0)
    close(var_f, 14 / 3)


def test_masked_moments_are_fp64_and_precise_with_large_mean():
    gen = torch.Generator().manual_seed(1)
    x = (1000.0 + 0.01 * torch.randn(64, 32, generator=gen)).float()
    mask = torch.ones_like(x)
    moments = masked_moments(x, mask)
    assert all(m.dtype == F64 and m.dim() == 0 for m in moments)
    _, var = moments_to_mean_var(*moments)
    torch.testing.assert_close(var, x.double().var(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_with_global_moments_equals_whiten_of_concatenation(shift_mean):
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 2, 8, 1, 6, 3, 8, 4]
    x = 3.0 + 2.0 * torch.randn(len(lengths), 8, generator=gen, dtype=F64)
    mask = right_padded_mask(lengths, 8)
    expected = reference_masked_whiten(x, mask, shift_mean=shift_mean)

    # "ranks" holding uneven shards of the batch
    shards = [(0, 1), (1, 4), (4, 8)]
    partial = [masked_moments(x[a:b], mask[a:b]) for a, b in shards]
    totals = [sum(p[i] for p in partial) for i in range(3)]  # the all-reduce SUM
    mean, var = moments_to_mean_var(*totals)
    out = torch.cat([whiten(x[a:b], mask[a:b], mean=mean, var=var, shift_mean=shift_mean) for a, b in shards])
    close(out, expected, atol=1e-10)
    assert torch.all(out[mask == 0] == 0)


def test_whiten_by_hand_with_float_moments():
    x = t64([1.0, 3.0, 7.0])
    mask = t64([1, 1, 0])
    out = whiten(x, mask, mean=2.0, var=4.0, eps=0.0)
    close(out, t64([-0.5, 0.5, 0.0]))
    out = whiten(x, mask, mean=2.0, var=4.0, eps=0.0, shift_mean=False)
    close(out, t64([1.5, 2.5, 0.0]))
    assert whiten(x.float(), mask, mean=torch.tensor(2.0, dtype=F64), var=4.0).dtype == torch.float32


# ---------------------------------------------------------------- KL estimators


LOGP = t64([-1.0, -2.0])
REF = t64([-1.5, -1.0])  # d = logp - ref = [0.5, -1.0]


@pytest.mark.parametrize(
    "names, expected",
    [
        (("kl", "k1"), [0.5, -1.0]),
        (("abs",), [0.5, 1.0]),
        (("mse", "k2"), [0.125, 0.5]),
        # ref - logp = [-0.5, 1.0]: exp(-0.5) + 0.5 - 1, exp(1) - 1 - 1
        (("low_var_kl", "k3"), [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_kl_estimators_by_hand(names, expected):
    for name in names:
        close(kl_penalty(LOGP, REF, name), t64(expected))


def test_low_var_kl_is_clamped_and_finite():
    logp = t64([-40.0, -1.0, -math.inf])
    ref = t64([-1.0, -40.0, -1.0])
    # ref - logp = 39 -> exp huge -> clamp 10; ref - logp = -39 -> exp(-39) + 39 - 1 -> clamp 10
    out = kl_penalty(logp, ref, "k3")
    close(out, t64([10.0, 10.0, 10.0]))


def test_kl_penalty_unknown_name():
    with pytest.raises(ValueError, match="bogus"):
        kl_penalty(LOGP, REF, "bogus")


def test_apply_kl_in_reward_by_hand():
    scores = t64([0.0, 0.0, 1.0], [0.0, 2.0, 7.0])
    logp = t64([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])
    ref = t64([-1.5, -0.5, -2.0], [-1.2, -1.4, -9.0])
    mask = t64([1, 1, 1], [1, 1, 0])
    # k1: [0.5, -0.5, 1.0] and [0.2, 0.4, (masked)]
    rewards, kl_mean = apply_kl_in_reward(scores, logp, ref, mask, kl_coef=0.1, kl_penalty_type="kl")
    close(rewards, t64([-0.05, 0.05, 0.9], [-0.02, 1.96, 7.0]))
    # per-sequence masked means: 1.0/3 and 0.6/2 = 0.3 -> batch mean
    close(kl_mean, (1.0 / 3 + 0.3) / 2)
    assert kl_mean.dim() == 0


# ---------------------------------------------------------------- KL controllers


def test_fixed_kl_controller():
    ctrl = FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=123.0, n_steps=256)
    assert ctrl.value == 0.05


def test_adaptive_kl_controller_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=6.6, n_steps=256)  # error 0.1, in range -> 1 + 0.1 * 0.0256
    assert ctrl.value == pytest.approx(0.1 * 1.00256, rel=1e-12)

    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=60.0, n_steps=256)  # error 9 -> clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * 1.00512, rel=1e-12)
    ctrl.update(current_kl=0.0, n_steps=256)  # error -1 -> clipped to -0.2
    assert ctrl.value == pytest.approx(0.1 * 1.00512 * 0.99488, rel=1e-12)

    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=1.0, horizon=100)
    ctrl.update(current_kl=0.9, n_steps=50)  # error -0.1 -> 1 - 0.05
    assert ctrl.value == pytest.approx(0.19, rel=1e-12)


def test_adaptive_kl_controller_rejects_bad_arguments():
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=0.0, horizon=10)


# ---------------------------------------------------------------- policy loss


def policy_case():
    # token: 0: A>0, ratio 1.5 (above 1+eps)      -> loss2 = -1.2 wins, clipped
    #        1: A<0, ratio 10 (far above)         -> max(10, 1.2) = 10, dual clip -> 3
    #        2: A>0, ratio 1                       -> -1, nothing clipped
    #        3: A<0, ratio 0.5 (below 1-eps)      -> max(0.5, 0.8) = 0.8, clipped
    #        4: padding with an absurd ratio       -> ignored
    old = t64([0.0, 0.0, 0.0, 0.0, 0.0])
    new = torch.log(t64([1.5, 10.0, 1.0, 0.5, 1e30]))
    adv = t64([1.0, -1.0, 1.0, -1.0, 5.0])
    mask = t64([1, 1, 1, 1, 0])
    return old, new, adv, mask


def test_policy_loss_clip_and_dual_clip_by_hand():
    old, new, adv, mask = policy_case()
    new = new.clone().requires_grad_(True)
    out = compute_policy_loss(
        old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, global_num_tokens=4
    )
    close(out["pg_loss"], (-1.2 + 3.0 - 1.0 + 0.8) / 4)
    close(out["pg_clipfrac"], 2 / 4)  # tokens 0 and 3
    close(out["pg_clipfrac_lower"], 1 / 4)  # token 1
    close(out["ppo_kl"], -(math.log(1.5) + math.log(10.0) + 0.0 + math.log(0.5)) / 4)
    assert all(v.dim() == 0 for v in out.values())
    assert not any(out[k].requires_grad for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"))

    # Only the unclipped token carries gradient: d(-A r / 4)/d log r = -A r / 4 = -0.25.
    (grad,) = torch.autograd.grad(out["pg_loss"], new)
    close(grad, t64([0.0, 0.0, -0.25, 0.0, 0.0]))


def test_policy_loss_asymmetric_clip():
    old = t64([0.0, 0.0])
    new = torch.log(t64([1.5, 0.5]))
    adv = t64([1.0, -2.0])
    mask = t64([1, 1])
    out = compute_policy_loss(
        old, new, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=3.0, global_num_tokens=2
    )
    # token 0: max(-1.5, -1.28) = -1.28; token 1: max(1.0, 2 * 0.9 = 1.8) = 1.8
    close(out["pg_loss"], (-1.28 + 1.8) / 2)
    close(out["pg_clipfrac"], 1.0)
    close(out["pg_clipfrac_lower"], 0.0)


def test_policy_loss_log_ratio_is_clamped():
    old = t64([0.0, 0.0])
    new = t64([50.0, -50.0]).requires_grad_(True)
    adv = t64([1.0, 1.0])
    out = compute_policy_loss(
        old, new, adv, t64([1, 1]), clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, global_num_tokens=2
    )
    # token 0 clipped at 1.2; token 1: ratio exp(-20), unclipped max(-e^-20, -0.8) = -e^-20
    close(out["pg_loss"], (-1.2 - math.exp(-20.0)) / 2)
    (grad,) = torch.autograd.grad(out["pg_loss"], new)
    assert torch.isfinite(grad).all()


def test_policy_loss_rejects_bad_dual_clip():
    old, new, adv, mask = policy_case()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(
            old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1.0, global_num_tokens=4
        )


# ---------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    values_old = t64([1.0, 1.0, 1.0, 1.0])
    vpreds = t64([1.5, 1.1, 0.0, 9.0]).requires_grad_(True)
    returns = t64([2.0, 0.0, 1.0, 0.0])
    mask = t64([1, 1, 1, 0])
    out = compute_value_loss(vpreds, returns, values_old, mask, cliprange_value=0.2, global_num_tokens=3)
    # 0: v_clip 1.2 -> max(0.25, 0.64) = 0.64 (clipped term larger)
    # 1: inside the range -> 1.21 both, not counted
    # 2: v_clip 0.8 -> max(1.0, 0.04) = 1.0
    close(out["vf_loss"], 0.5 * (0.64 + 1.21 + 1.0) / 3)
    close(out["vf_clipfrac"], 1 / 3)
    assert not out["vf_clipfrac"].requires_grad
    # gradient flows through the clipped term only via values_old: token 0 gets none
    (grad,) = torch.autograd.grad(out["vf_loss"], vpreds)
    close(grad, t64([0.0, 1.1 / 3, -1.0 / 3, 0.0]))


# ---------------------------------------------------------------- entropy / kl loss / agg


def test_entropy_and_kl_loss():
    entropy = t64([1.0, 2.0, 99.0], [3.0, 4.0, 99.0])
    mask = t64([1, 1, 0], [1, 1, 0])
    close(compute_entropy_loss(entropy, mask, global_num_tokens=4), 2.5)
    logp = t64([-1.0, -2.0])
    ref = t64([-1.5, -1.0])
    close(compute_kl_loss(logp, ref, t64([1, 1]), kl_loss_type="mse", global_num_tokens=2), (0.125 + 0.5) / 2)
    close(
        compute_kl_loss(logp, ref, t64([1, 0]), kl_loss_type="low_var_kl", global_num_tokens=1),
        math.exp(-0.5) - 0.5,
    )


def test_agg_token_mean_rejects_nonpositive_count():
    with pytest.raises(ValueError, match="global_num_tokens"):
        agg_token_mean(t64([1.0]), t64([1.0]), global_num_tokens=0)


SPLITS = [
    [6],
    [1, 5],
    [2, 2, 2],
    [3, 1, 2],
    [1, 1, 1, 1, 1, 1],
]


def _agg_problem():
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 1, 3, 5, 2, 4]
    x = torch.randn(6, 5, generator=gen, dtype=F64)
    w = torch.randn(5, generator=gen, dtype=F64).requires_grad_(True)
    mask = right_padded_mask(lengths, 5)
    return x, w, mask


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_agg_token_mean_is_split_invariant_in_value_and_gradient(split):
    x, w, mask = _agg_problem()
    num_tokens = int(mask.sum())

    def loss_mat(rows):
        return (x[rows] * w).sin() + (x[rows] * w) ** 2

    full = agg_token_mean(loss_mat(slice(None)), mask, global_num_tokens=num_tokens)
    (grad_full,) = torch.autograd.grad(full, w)
    close(full, masked_mean(loss_mat(slice(None)), mask))

    total, start = 0.0, 0
    for size in split:
        rows = slice(start, start + size)
        total = total + agg_token_mean(loss_mat(rows), mask[rows], global_num_tokens=num_tokens)
        start += size
    (grad_split,) = torch.autograd.grad(total, w)
    close(total, full)
    close(grad_split, grad_full)


def test_naive_micro_batch_mean_would_depend_on_split():
    # Guards the test above: a per-micro-batch mean differs, so the invariance is not trivial.
    x, w, mask = _agg_problem()
    lm = (x * w) ** 2
    naive = (masked_mean(lm[:1], mask[:1]) + masked_mean(lm[1:], mask[1:])) / 2
    assert not torch.allclose(naive, masked_mean(lm, mask))


def test_agg_token_mean_across_ranks_with_world_size_scaling():
    x, w, mask = _agg_problem()
    num_tokens = int(mask.sum())
    full = agg_token_mean((x * w) ** 2, mask, global_num_tokens=num_tokens)
    (grad_full,) = torch.autograd.grad(full, w)

    world_size = 2
    rank_rows = [[slice(0, 1), slice(1, 2)], [slice(2, 6)]]  # rank 0: two micro-batches, rank 1: one
    rank_grads = []
    for micro_batches in rank_rows:
        loss = sum(agg_token_mean((x[r] * w) ** 2, mask[r], global_num_tokens=num_tokens) for r in micro_batches)
        (g,) = torch.autograd.grad(loss * world_size, w)
        rank_grads.append(g)
    close(sum(rank_grads) / world_size, grad_full)  # what the data-parallel AVG all-reduce does


def test_policy_and_value_metrics_sum_over_micro_batches():
    gen = torch.Generator().manual_seed(4)
    lengths = [4, 2, 6, 1]
    mask = right_padded_mask(lengths, 6)
    old = 0.3 * torch.randn(4, 6, generator=gen, dtype=F64)
    new = old + 0.4 * torch.randn(4, 6, generator=gen, dtype=F64)
    adv = torch.randn(4, 6, generator=gen, dtype=F64)
    n = int(mask.sum())
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, global_num_tokens=n)
    full = compute_policy_loss(old, new, adv, mask, **kw)
    parts = [compute_policy_loss(old[r], new[r], adv[r], mask[r], **kw) for r in (slice(0, 1), slice(1, 4))]
    for key, value in full.items():
        close(sum(p[key] for p in parts), value)

    vf_kw = dict(cliprange_value=0.1, global_num_tokens=n)
    vfull = compute_value_loss(new, adv, old, mask, **vf_kw)
    vparts = [compute_value_loss(new[r], adv[r], old[r], mask[r], **vf_kw) for r in (slice(0, 3), slice(3, 4))]
    for key, value in vfull.items():
        close(sum(p[key] for p in vparts), value)


# ---------------------------------------------------------------- logits -> logprobs / entropy


def test_logprobs_and_entropy_match_categorical_fp64():
    gen = torch.Generator().manual_seed(5)
    logits = 3.0 * torch.randn(2, 7, 11, generator=gen, dtype=F64)
    labels = torch.randint(0, 11, (2, 7), generator=gen)
    dist = torch.distributions.Categorical(logits=logits)
    lp = logprobs_from_logits(logits, labels)
    ent = entropy_from_logits(logits)
    assert lp.shape == (2, 7) and ent.shape == (2, 7)
    close(lp, dist.log_prob(labels))
    close(ent, dist.entropy())


def test_logprobs_and_entropy_upcast_bf16_to_fp32():
    gen = torch.Generator().manual_seed(6)
    logits = (4.0 * torch.randn(3, 5, 50, generator=gen)).bfloat16()
    labels = torch.randint(0, 50, (3, 5), generator=gen)
    lp = logprobs_from_logits(logits, labels)
    ent = entropy_from_logits(logits)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    dist = torch.distributions.Categorical(logits=logits.double())  # same bf16 values, exact math
    torch.testing.assert_close(lp.double(), dist.log_prob(labels), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), dist.entropy(), atol=1e-5, rtol=0)


def test_entropy_finite_with_extreme_logits():
    logits = t64([0.0, -1e4, -1e4], [50.0, 0.0, -1e30])
    ent = entropy_from_logits(logits)
    assert torch.isfinite(ent).all()
    close(ent[0], 0.0, atol=1e-10)


def test_core_stays_pure():
    # No device sync per micro-batch and no collectives: see docs in trainer/engine/core.py.
    source = open(core.__file__, encoding="utf-8").read()
    assert ".item(" not in source
    assert "torch.distributed" not in source
    assert "import trainer.config" not in source and "from trainer" not in source and "from ." not in source


# ---------------------------------------------------------------- KL "+" variants, verl's loss aggregation


@pytest.mark.parametrize("name", ["kl+", "k1+", "abs+", "k2+", "mse+", "low_var_kl+", "k3+"])
def test_kl_plus_keeps_the_value_and_takes_k2s_gradient(name):
    """verl's straight-through trick: the value of the base estimator, the gradient of 0.5 d^2 (= d)."""
    logp = LOGP.clone().requires_grad_(True)
    value = kl_penalty(logp, REF, name)
    close(value, kl_penalty(LOGP, REF, name[:-1]))
    (grad,) = torch.autograd.grad(value.sum(), logp)
    close(grad, LOGP - REF)  # d = [0.5, -1.0]


# loss [[1, 2, (9)], [3, (9), (9)]]: sequence sums 3 and 3, token means 1.5 and 3, 3 tokens, 2 sequences
AGG_LOSS, AGG_MASK = t64([1.0, 2.0, 9.0], [3.0, 9.0, 9.0]), t64([1, 1, 0], [1, 0, 0])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 6.0 / 3),
        ("token-sum", 6.0),
        ("seq-mean-token-sum", (3.0 + 3.0) / 2),
        ("seq-mean-token-mean", (1.5 + 3.0) / 2),
        ("seq-mean-token-sum-norm", (3.0 + 3.0) / 2 / 3),  # loss_scale_factor 3
    ],
)
def test_agg_loss_by_hand_and_split_invariant(mode, expected):
    kw = dict(loss_agg_mode=mode, global_num_tokens=3, global_num_seqs=2, loss_scale_factor=3)
    close(core.agg_loss(AGG_LOSS, AGG_MASK, **kw), expected, atol=1e-7)  # seq-mean-token-mean: / (tokens + 1e-8)
    # one micro-batch per sequence: the parts add up to the whole (the update does not see the split)
    parts = sum(core.agg_loss(AGG_LOSS[i : i + 1], AGG_MASK[i : i + 1], **kw) for i in range(2))
    close(parts, expected, atol=1e-7)


def test_agg_loss_seq_modes_skip_empty_sequences_but_count_them():
    """verl: a sequence with no token contributes nothing, the divisor is the global mini-batch's size."""
    loss = torch.cat([AGG_LOSS, t64([5.0, 5.0, 5.0])])
    mask = torch.cat([AGG_MASK, t64([0, 0, 0])])
    out = core.agg_loss(loss, mask, loss_agg_mode="seq-mean-token-sum", global_num_tokens=3, global_num_seqs=3)
    close(out, 6.0 / 3)


def test_policy_kl_and_entropy_losses_take_the_aggregation():
    logp, old, adv = t64([-1.0, -1.0], [-1.0, -1.0]), t64([-1.0, -1.0], [-1.0, -1.0]), t64([1.0, 2.0], [4.0, 0.0])
    mask = t64([1, 1], [1, 0])
    kw = dict(loss_agg_mode="seq-mean-token-sum", global_num_tokens=3, global_num_seqs=2)
    pg = compute_policy_loss(old, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, **kw)
    close(pg["pg_loss"], -(1.0 + 2.0 + 4.0) / 2)  # ratio 1: -A summed per sequence, / 2 sequences
    close(pg["ppo_kl"], 0.0)  # the metrics stay token means
    close(compute_entropy_loss(adv, mask, **kw), (3.0 + 4.0) / 2)
    close(compute_kl_loss(logp, logp - 1.0, mask, kl_loss_type="k1", **kw), (2.0 + 1.0) / 2)


# ---------------------------------------------------------------- critic-free estimators (trainer/engine/estimators.py)
# scores of 5 responses: prompt 7 twice (1, 0), prompt 3 twice (1, 1), prompt 9 once (0.5)
SCORES, UIDS = t64(1.0, 0.0, 1.0, 1.0, 0.5), torch.tensor([7, 7, 3, 3, 9])
EPS = 1e-6
STD_10 = math.sqrt(0.5)  # unbiased std of (1, 0)


def test_grpo_by_hand():
    from trainer.engine.estimators import grpo_outcome_advantage

    # (s - mean) / (std + eps); a group of equal scores gets 0; a singleton has mean 0, std 1
    expected = [0.5 / (STD_10 + EPS), -0.5 / (STD_10 + EPS), 0.0, 0.0, 0.5 / (1.0 + EPS)]
    close(grpo_outcome_advantage(SCORES, UIDS), expected)
    close(grpo_outcome_advantage(SCORES, UIDS, norm_adv_by_std=False), [0.5, -0.5, 0.0, 0.0, 0.5])  # Dr. GRPO


def test_rloo_by_hand():
    from trainer.engine.estimators import rloo_outcome_advantage, rloo_vectorized_outcome_advantage

    scores, uids = t64(3.0, 0.0, 0.0, 2.0), torch.tensor([0, 0, 0, 1])
    # each against the mean of the others: 3 - 0, 0 - 1.5, 0 - 1.5; a singleton keeps its score (loop version)
    close(rloo_outcome_advantage(scores, uids), [3.0, -1.5, -1.5, 2.0])
    close(rloo_vectorized_outcome_advantage(scores, uids), [3.0, -1.5, -1.5, 0.0])  # ... or 0 (vectorized)


def test_opo_gpg_and_group_baseline_by_hand():
    from trainer.engine.estimators import gpg_outcome_advantage, group_baseline_advantage, opo_outcome_advantage

    # OPO: baseline sum(len s) / sum(len) = (3 * 1 + 1 * 0) / 4 = 0.75; 1, 1 -> 1; singleton baseline 0
    close(opo_outcome_advantage(SCORES, UIDS, t64(3.0, 1.0, 2.0, 2.0, 5.0)), [0.25, -0.75, 0.0, 0.0, 0.5])
    # GPG: alpha = 5 responses / 4 nonzero scores
    close(gpg_outcome_advantage(SCORES, UIDS), [1.25 * 0.5, -1.25 * 0.5, 0.0, 0.0, 1.25 * 0.5])
    close(group_baseline_advantage(SCORES, UIDS), [0.5, -0.5, 0.0, 0.0, 0.5])


def test_grpo_passk_by_hand():
    from trainer.engine.estimators import grpo_passk_outcome_advantage

    scores, uids = t64(1.0, 0.0, 2.0, 3.0, 2.0, 2.0, 1.0), torch.tensor([0, 0, 1, 1, 2, 2, 2])
    # only each group's best: r_max - r_second (/ std + eps); a tie at the top gives 0
    close(grpo_passk_outcome_advantage(scores, uids, norm_adv_by_std=False), [1.0, 0, 0, 1.0, 0, 0, 0])
    close(
        grpo_passk_outcome_advantage(scores, uids),
        [1.0 / (STD_10 + EPS), 0, 0, 1.0 / (STD_10 + EPS), 0, 0, 0],
    )


def test_reinforce_plus_plus_returns_by_hand():
    from trainer.engine.estimators import reinforce_plus_plus_returns

    rewards = t64([0.0, 0.0, 1.0], [0.0, 0.0, 1.0])
    # gamma 0.5: 0.25, 0.5, 1; a masked (observation) token passes the running return through
    out = reinforce_plus_plus_returns(rewards, t64([1, 1, 1], [1, 0, 1]), gamma=0.5)
    close(out, t64([0.25, 0.5, 1.0], [0.5, 0.0, 1.0]))


def test_remax_by_hand():
    from trainer.engine.estimators import remax_advantage_return

    adv, returns = remax_advantage_return(t64([0.0, 1.0, 0.0]), t64(0.25), t64([1, 1, 0]))
    close(returns, t64([1.0, 1.0, 0.0]))
    close(adv, t64([0.75, 0.75, 0.0]))


def test_every_configured_estimator_is_registered():
    from trainer.config.rules import ADV_ESTIMATORS
    from trainer.engine.estimators import ESTIMATORS

    assert set(ESTIMATORS) == set(ADV_ESTIMATORS)


def test_value_loss_takes_the_aggregation():
    vpreds, returns = t64([1.0, 2.0], [3.0, 0.0]), t64([0.0, 0.0], [0.0, 0.0])
    mask = t64([1, 1], [1, 0])
    out = compute_value_loss(
        vpreds,
        returns,
        vpreds,
        mask,
        cliprange_value=0.5,
        global_num_tokens=3,
        loss_agg_mode="seq-mean-token-sum",
        global_num_seqs=2,
    )
    close(out["vf_loss"], 0.5 * ((1.0 + 4.0) + 9.0) / 2)  # 0.5 (v - R)^2 summed per sequence, / 2 sequences
