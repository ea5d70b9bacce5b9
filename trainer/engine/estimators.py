"""verl's critic-free advantage estimators as pure functions (the PPO math beside trainer/engine/core.py's GAE).

Each is verl 0.9.1's ``trainer/ppo/core_algos.py`` function of the same name, computed the same way (which
group statistics, which corner cases: a prompt with one response, a group of equal scores), on tensors:
nothing here knows ranks, configs or devices, and nothing reads a tensor back to the host.

Outcome estimators work on one score per response, ``scores = token_level_rewards.sum(-1)``, and ``index``,
the prompt each response came from (verl's ``uid``: the ``rollout.n`` responses of a prompt share one): they
return one advantage per response, ``(N,)``; verl's ``(N, T)`` advantages are that times the response mask
(:func:`broadcast`), and its ``returns`` the same tensor. They run on the whole global batch (a group may
span ranks): the step gathers the scores first. The token-level ones (``reinforce_plus_plus``, ``remax``)
work on ``(B, T)`` rows alone; reinforce++'s whitening over the global batch is the step's (as for GAE).

References: GRPO https://arxiv.org/abs/2402.03300 (Dr. GRPO, no std: https://arxiv.org/abs/2503.20783);
RLOO https://arxiv.org/abs/2402.14740; REINFORCE++ https://arxiv.org/abs/2501.03262; ReMax
https://arxiv.org/abs/2310.10505; OPO https://arxiv.org/abs/2505.23585; GPG https://arxiv.org/abs/2504.02546;
Pass@k https://arxiv.org/abs/2503.19595.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = [
    "group_index",
    "group_mean_std",
    "grpo_outcome_advantage",
    "grpo_passk_outcome_advantage",
    "rloo_outcome_advantage",
    "rloo_vectorized_outcome_advantage",
    "opo_outcome_advantage",
    "gpg_outcome_advantage",
    "group_baseline_advantage",
    "broadcast",
    "reinforce_plus_plus_returns",
    "remax_advantage_return",
    "Estimator",
    "ESTIMATORS",
]

EPSILON = 1e-6  # verl's default ``epsilon`` of every outcome estimator


def group_index(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Any prompt ids ``(N,)`` -> (group of each response in ``0..G-1``, G)."""
    uniq, inverse = torch.unique(index, return_inverse=True)
    return inverse, uniq.numel()


def _group_sum(values: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, gid, values)


def group_mean_std(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each response's group mean, unbiased standard deviation (``torch.std``) and size, ``(N,)`` each; a prompt
    with one response has mean 0 and std 1 (verl's convention for a singleton)."""
    gid, num_groups = group_index(index)
    count = _group_sum(torch.ones_like(scores), gid, num_groups)
    mean = _group_sum(scores, gid, num_groups) / count
    centered = scores - mean[gid]
    var = _group_sum(centered * centered, gid, num_groups) / (count - 1.0).clamp_min(1.0)
    single = count <= 1.0
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(var), var.sqrt())
    return mean[gid], std[gid], count[gid]


@torch.no_grad()
def grpo_outcome_advantage(
    scores: torch.Tensor, index: torch.Tensor, *, norm_adv_by_std: bool = True, epsilon: float = EPSILON
) -> torch.Tensor:
    """GRPO: ``(s - mean_g) / (std_g + epsilon)``, or ``s - mean_g`` without the std (Dr. GRPO). verl's
    ``compute_grpo_outcome_advantage`` (and ``grpo_vectorized``: the same statistics). ``(N,) -> (N,)``."""
    mean, std, _ = group_mean_std(scores, index)
    return (scores - mean) / (std + epsilon) if norm_adv_by_std else scores - mean


@torch.no_grad()
def grpo_passk_outcome_advantage(
    scores: torch.Tensor, index: torch.Tensor, *, norm_adv_by_std: bool = True, epsilon: float = EPSILON
) -> torch.Tensor:
    """Pass@k: only the best response of each group gets an advantage, ``r_max - r_second`` (over ``std_g +
    epsilon``); the others 0. Every group needs two responses (verl raises otherwise; the config refuses
    ``rollout.n`` < 2). The best is the first of the group's maxima, in batch order. ``(N,) -> (N,)``."""
    gid, num_groups = group_index(index)
    n = scores.numel()
    order = torch.arange(n, device=scores.device)
    top = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    top = top.scatter_reduce(0, gid, scores, reduce="amax")
    is_top = scores == top[gid]
    first = torch.full((num_groups,), n, dtype=order.dtype, device=scores.device)
    first = first.scatter_reduce(0, gid, torch.where(is_top, order, n), reduce="amin")
    best = order == first[gid]
    rest = torch.where(best, torch.full_like(scores, float("-inf")), scores)
    second = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    second = second.scatter_reduce(0, gid, rest, reduce="amax")
    advantage = top - second
    if norm_adv_by_std:
        _, std, _ = group_mean_std(scores, index)
        group_std = torch.zeros_like(top).scatter_reduce(0, gid, std, reduce="amax")
        advantage = advantage / (group_std + epsilon)
    return torch.where(best, advantage[gid], torch.zeros_like(scores))


@torch.no_grad()
def rloo_outcome_advantage(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """RLOO: each response against the mean of the others, ``(s - mean_g) * c / (c - 1)``; a prompt with one
    response keeps its score (verl's loop version). ``(N,) -> (N,)``."""
    mean, _, count = group_mean_std(scores, index)
    scale = count / (count - 1.0).clamp_min(1.0)
    return torch.where(count > 1, scores * scale - mean * scale, scores)


@torch.no_grad()
def rloo_vectorized_outcome_advantage(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """RLOO as verl's ``rloo_vectorized``: ``(c s - sum_g) / (c - 1)``; a prompt with one response gets 0 (the
    loop version keeps its score). ``(N,) -> (N,)``."""
    gid, num_groups = group_index(index)
    count = _group_sum(torch.ones_like(scores), gid, num_groups)[gid]
    total = _group_sum(scores, gid, num_groups)[gid]
    return (count * scores - total) / (count - 1.0).clamp_min(1.0) * (count > 1).to(scores.dtype)


@torch.no_grad()
def opo_outcome_advantage(scores: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """OPO: the baseline is the group's length-weighted mean score ``sum(len s) / sum(len)``; 0 for a prompt with
    one response. ``lengths``: each response's token count. ``(N,) -> (N,)``."""
    gid, num_groups = group_index(index)
    lengths = lengths.to(scores.dtype)
    count = _group_sum(torch.ones_like(scores), gid, num_groups)
    baseline = _group_sum(lengths * scores, gid, num_groups) / _group_sum(lengths, gid, num_groups)
    baseline = torch.where(count > 1, baseline, torch.zeros_like(baseline))
    return scores - baseline[gid]


@torch.no_grad()
def gpg_outcome_advantage(scores: torch.Tensor, index: torch.Tensor, *, f_norm: float = 1.0) -> torch.Tensor:
    """GPG: ``alpha (s - mean_g) / f_norm`` with ``alpha = N / max(#nonzero scores, 1)`` over the whole batch
    (verl's ``f_norm`` default 1). ``(N,) -> (N,)``."""
    mean, _, _ = group_mean_std(scores, index)
    alpha = scores.numel() / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    return alpha * (scores - mean) / f_norm


@torch.no_grad()
def group_baseline_advantage(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``s - mean_g`` (0 for a singleton's mean): reinforce_plus_plus_baseline's first step, before the
    advantages are whitened over the global batch. ``(N,) -> (N,)``."""
    mean, _, _ = group_mean_std(scores, index)
    return scores - mean


def broadcast(per_response: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One value per response ``(B,)`` over its tokens: ``(B,) x (B, T) -> (B, T)``, 0 on padding."""
    return per_response.unsqueeze(-1) * response_mask.to(per_response.dtype)


@torch.no_grad()
def reinforce_plus_plus_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float
) -> torch.Tensor:
    """REINFORCE++'s discounted returns ``R_t = r_t + gamma R_{t+1}`` on response tokens; a masked token passes
    the running return through unchanged (verl's loop). The advantages are these whitened over the global
    batch (the caller's: the moments are all-reduced). ``(B, T) -> (B, T)``."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        new = token_level_rewards[:, t] + gamma * running
        returns[:, t] = new * mask[:, t]
        running = new * mask[:, t] + running * (1 - mask[:, t])
    return returns


@torch.no_grad()
def remax_advantage_return(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: returns-to-go less the reward of the prompt's greedy response (``reward_baselines``, ``(B,)``);
    -> (advantages, returns), ``(B, T)`` each."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.unsqueeze(-1) * mask, returns


class Estimator(NamedTuple):
    """How the step computes an ``algorithm.adv_estimator``: ``kind`` ``gae`` (the critic's values), ``outcome``
    (``fn(scores, index, lengths, norm_adv_by_std) -> (N,)`` over the global batch; ``whiten``: then whitened
    over it), ``returns`` (reinforce++: discounted returns, whitened) or ``remax`` (a greedy baseline)."""

    kind: str
    fn: Callable | None = None
    whiten: bool = False


#: verl's registry names that ppotune's engine runs (trainer.config.rules.ADV_ESTIMATORS lists the same).
ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator("gae"),
    "grpo": Estimator("outcome", lambda s, i, ln, norm: grpo_outcome_advantage(s, i, norm_adv_by_std=norm)),
    "grpo_vectorized": Estimator("outcome", lambda s, i, ln, norm: grpo_outcome_advantage(s, i, norm_adv_by_std=norm)),
    "grpo_passk": Estimator("outcome", lambda s, i, ln, norm: grpo_passk_outcome_advantage(s, i, norm_adv_by_std=norm)),
    "rloo": Estimator("outcome", lambda s, i, ln, norm: rloo_outcome_advantage(s, i)),
    "rloo_vectorized": Estimator("outcome", lambda s, i, ln, norm: rloo_vectorized_outcome_advantage(s, i)),
    "opo": Estimator("outcome", lambda s, i, ln, norm: opo_outcome_advantage(s, i, ln)),
    "gpg": Estimator("outcome", lambda s, i, ln, norm: gpg_outcome_advantage(s, i)),
    "reinforce_plus_plus_baseline": Estimator(
        "outcome", lambda s, i, ln, norm: group_baseline_advantage(s, i), whiten=True
    ),
    "reinforce_plus_plus": Estimator("returns", whiten=True),
    "remax": Estimator("remax"),
}
