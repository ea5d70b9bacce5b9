"""PPO math as pure functions: tensors and python scalars in, tensors out.

Nothing here knows about ranks, configs or devices. Shapes use ``B`` (sequences),
``T`` (response tokens, right padded) and ``V`` (vocabulary). Masks are 0/1 tensors
of shape ``(B, T)`` (bool or floating). Loss helpers divide by ``global_num_tokens``
(the number of valid tokens in the whole mini-batch, all micro-batches and all ranks)
so that the result does not depend on how the mini-batch was split -- the property
the tuner relies on (design decision 2: tuned knobs never change the algorithm).

No function here reads a tensor back to the host: a device sync per micro-batch would skew the very
throughput the tuner measures. Metrics come back as 0-d tensors; the caller syncs once.

References:
- PPO: Schulman et al. 2017, https://arxiv.org/abs/1707.06347
- GAE: Schulman et al. 2015, https://arxiv.org/abs/1506.02438
- Dual clip: Ye et al. 2020, https://arxiv.org/abs/1912.09729
- KL-regularized reward and the adaptive KL controller: Ziegler et al. 2019,
  https://arxiv.org/abs/1909.08593
- KL estimators k1/k2/k3: J. Schulman, "Approximating KL divergence", 2020,
  http://joschu.net/blog/kl-approx.html
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = [
    "logprobs_from_logits",
    "entropy_from_logits",
    "masked_sum",
    "masked_mean",
    "compute_gae_advantage_return",
    "whiten",
    "masked_moments",
    "moments_to_mean_var",
    "kl_penalty",
    "apply_kl_in_reward",
    "FixedKLController",
    "AdaptiveKLController",
    "agg_token_mean",
    "agg_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "compute_entropy_loss",
    "compute_kl_loss",
]

Scalar = Union[float, int, torch.Tensor]

# Bound on |log pi - log pi_old| (and |ref - logp| in k3) before exp: exp(20) ~ 4.9e8 is
# finite in fp32, whereas an unbounded exp overflows to inf and inf - inf gives NaN.
_LOG_RATIO_BOUND = 20.0
_KL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
_SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _upcast_low_precision(x: torch.Tensor) -> torch.Tensor:
    # softmax over a large vocabulary in bf16/fp16 loses several bits of the log-prob,
    # enough to bias the importance ratio; fp32/fp64 inputs are kept as they are.
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``.

    Args:
        logits: ``(..., V)``; bf16/fp16 are upcast to fp32.
        labels: ``(...)`` integer token ids.

    Returns:
        ``(...)`` in fp32 (fp64 if the logits are fp64).
    """
    logits = _upcast_low_precision(logits)
    # gather - logsumexp avoids materializing a second (..., V) log_softmax tensor.
    picked = torch.gather(logits, -1, labels.unsqueeze(-1).long()).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)``, which stays finite when some
    probabilities underflow to 0 (``p * log p`` would give ``0 * -inf``).

    Args:
        logits: ``(..., V)``; bf16/fp16 are upcast to fp32.

    Returns:
        ``(...)`` in fp32 (fp64 if the logits are fp64).
    """
    logits = _upcast_low_precision(logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(x * mask)`` over all elements. ``x``, ``mask``: same shape -> 0-d tensor."""
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)`` -> 0-d tensor (NaN if the mask is empty).

    This is a *local* mean; for a loss that must not depend on the micro-batch
    split use :func:`agg_token_mean`.
    """
    return (x * mask).sum() / mask.sum()


@torch.no_grad()  # advantages and returns are regression/score targets, never differentiated
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2015, https://arxiv.org/abs/1506.02438).

    ``delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t`` and
    ``A_t = (delta_t + gamma * lam * A_{t+1}) * m_t``, with ``V_T = A_T = 0``.
    A masked position is treated as terminal: the last response token bootstraps from
    0 (as verl's ``nextvalues * mask``), and whatever the padding holds (rewards,
    values) cannot reach an earlier token. The mask is meant to be right padding;
    a 0 inside a response would cut the episode there.

    Args:
        token_level_rewards: ``(B, T)``.
        values: ``(B, T)`` critic values of the response tokens.
        response_mask: ``(B, T)``, 1 on response tokens, 0 on the right padding.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``(B, T)``, not whitened (see :func:`whiten`).
        ``advantages`` is 0 where the mask is 0; ``returns = advantages + values``
        (so equals ``values`` on padding, which every loss masks out).
    """
    mask = response_mask.to(values.dtype)
    # Value of the next token, 0 past the end of the response (terminal).
    next_values = torch.zeros_like(values)
    next_values[:, :-1] = values[:, 1:] * mask[:, 1:]
    deltas = token_level_rewards + gamma * next_values - values

    num_tokens = values.shape[-1]
    advantages_reversed = []
    last_gae = torch.zeros_like(values[:, 0])
    for t in reversed(range(num_tokens)):
        # Multiplying by m_t zeroes padding, which then contributes nothing to t-1.
        last_gae = (deltas[:, t] + gamma * lam * last_gae) * mask[:, t]
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=-1)
    returns = advantages + values
    return advantages, returns


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    mean: Scalar,
    var: Scalar,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Normalize ``x`` with a given mean and variance, zero where ``mask`` is 0.

    ``(x - mean) * rsqrt(var + eps)``, plus ``mean`` again if ``shift_mean`` is False
    (scale only). The moments are arguments so the caller can take them over the
    global batch (:func:`masked_moments` on each rank, all-reduce,
    :func:`moments_to_mean_var`): whitening per rank or per micro-batch would make the
    advantages depend on the data-parallel split.

    Args:
        x: ``(B, T)``.
        mask: ``(B, T)``.
        mean, var: 0-d tensors or python floats.

    Returns:
        ``(B, T)`` in ``x.dtype``.
    """
    mean_t = torch.as_tensor(mean, dtype=x.dtype, device=x.device)
    var_t = torch.as_tensor(var, dtype=x.dtype, device=x.device)
    whitened = (x - mean_t) * torch.rsqrt(var_t + eps)
    if not shift_mean:
        whitened = whitened + mean_t
    return whitened * mask.to(whitened.dtype)


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial sums for a global masked mean/variance.

    Sum them across ranks (all-reduce SUM of the three, e.g. stacked) and pass the totals
    to :func:`moments_to_mean_var`.

    Args:
        x: ``(B, T)`` (any shape).
        mask: same shape as ``x``.

    Returns:
        ``(sum, sum_of_squares, count)`` as 0-d fp64 tensors. fp64 because the variance
        is later formed as ``E[x^2] - E[x]^2``, which cancels badly in fp32 when
        ``|mean| >> std``; three scalars cost nothing to reduce in fp64.
    """
    x64 = x.detach().double()
    m64 = mask.detach().double()
    return (x64 * m64).sum(), (x64 * x64 * m64).sum(), m64.sum()


def moments_to_mean_var(
    total: Scalar, total_sq: Scalar, count: Scalar, *, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance from :func:`masked_moments` totals.

    ``mean = total / count``; ``var = (total_sq - total * mean) / (count - 1)``
    (Bessel-corrected like verl's ``masked_var``) or ``/ count`` if not ``unbiased``.
    The caller must ensure ``count >= 2`` when unbiased (NaN/inf otherwise; no check
    here because it would sync the device).

    Returns:
        ``(mean, var)`` as 0-d tensors (fp64 for fp64 inputs).
    """
    total = torch.as_tensor(total, dtype=torch.float64)
    total_sq = torch.as_tensor(total_sq, dtype=torch.float64, device=total.device)
    count = torch.as_tensor(count, dtype=torch.float64, device=total.device)
    mean = total / count
    # Rounding can leave a tiny negative sum of squared deviations for constant data.
    centered_sq = (total_sq - total * mean).clamp_min(0.0)
    var = centered_sq / (count - 1.0) if unbiased else centered_sq / count
    return mean, var


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of ``pi`` (verl's ``core_algos.kl_penalty``).

    With ``d = logprob - ref_logprob``:
    ``"kl"``/``"k1"``: ``d`` (unbiased, high variance, can be negative);
    ``"abs"``: ``|d|``; ``"mse"``/``"k2"``: ``0.5 * d^2``;
    ``"low_var_kl"``/``"k3"``: ``exp(-d) + d - 1`` (unbiased, always >= 0), clamped to
    ``[-10, 10]`` like verl so one very unlikely token cannot dominate the loss.
    A ``"+"`` suffix (``"k3+"``, ...): the same value with k2's gradient (straight through: k1 and k3 estimate
    the KL without bias but not its gradient; k2's gradient is the right one).
    See http://joschu.net/blog/kl-approx.html.

    Args:
        logprob, ref_logprob: ``(B, T)``.
        kl_penalty: estimator name (verl's ``algorithm.kl_penalty`` / ``actor.kl_loss_type`` values).

    Returns:
        ``(B, T)``, unmasked.

    Raises:
        ValueError: unknown estimator name.
    """
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward = _kl_forward(logprob, ref_logprob, base, kl_penalty)
    if not kl_penalty.endswith("+"):
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str, spelled: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if name in ("low_var_kl", "k3"):
        log_ratio = (ref_logprob - logprob).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl_penalty: unknown estimator {spelled!r}; expected one of {_KL_NAMES} (or with '+')")


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_penalty_type: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-regularized reward (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    Args:
        token_level_scores: ``(B, T)`` reward-model / rule scores.
        logprob, ref_logprob: ``(B, T)`` old-policy and reference log-probs.
        response_mask: ``(B, T)``.
        kl_coef: current coefficient (the KL controller's ``.value``).
        kl_penalty_type: see :func:`kl_penalty`.

    Returns:
        ``(token_level_rewards, kl_mean)``: rewards ``(B, T)`` =
        ``scores - kl_coef * kl * mask``; ``kl_mean`` a 0-d tensor, the batch mean of
        each sequence's masked-mean KL (what the adaptive controller consumes). A
        sequence with no response token counts as KL 0 rather than NaN.
    """
    mask = response_mask.to(logprob.dtype)
    kl = kl_penalty(logprob, ref_logprob, kl_penalty_type) * mask
    token_level_rewards = token_level_scores - kl_coef * kl
    per_seq_kl = kl.sum(dim=-1) / mask.sum(dim=-1).clamp_min(1.0)
    return token_level_rewards, per_seq_kl.mean()


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op kept for a common interface."""

    def __init__(self, *, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional KL controller (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593, sec. 2.2).

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``;
    ``value *= 1 + e * n_steps / horizon``. The clip bounds how fast the coefficient can
    move when the measured KL is far off target.
    """

    def __init__(self, *, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """``current_kl``: a python float (the caller syncs once per step);
        ``n_steps``: samples (sequences) in the step, as verl passes the batch size."""
        proportional_error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def agg_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, *, global_num_tokens: Scalar) -> torch.Tensor:
    """Token-mean over the whole mini-batch, computed one micro-batch at a time.

    ``sum(loss_mat * mask) / global_num_tokens``, where ``global_num_tokens`` is the
    count of valid tokens in the whole mini-batch (all micro-batches, all ranks).
    Summing the results over micro-batches gives exactly the mini-batch token mean and
    its gradient whatever the split, because each token is weighted by the same
    ``1 / global_num_tokens``. A per-micro-batch mean would instead weight tokens by
    ``1 / tokens_in_that_micro_batch``, so the update would change with the micro-batch
    size or dynamic-bsz packing -- exactly the knobs being tuned. With data parallelism,
    multiply by the world size before the gradient all-reduce averages over ranks.

    Args:
        loss_mat: ``(B, T)`` per-token values.
        mask: ``(B, T)``.
        global_num_tokens: python number or 0-d tensor.

    Returns:
        0-d tensor.
    """
    if isinstance(global_num_tokens, (int, float)) and global_num_tokens <= 0:
        raise ValueError(f"global_num_tokens must be > 0, got {global_num_tokens}")
    return (loss_mat * mask).sum() / global_num_tokens


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str,
    global_num_tokens: Scalar,
    global_num_seqs: Scalar = 1,
    loss_scale_factor: Scalar = 1,
) -> torch.Tensor:
    """verl's ``agg_loss`` over the whole mini-batch, one micro-batch at a time: the results of every micro-batch
    (and rank) add up to the mini-batch's loss, whatever the split.

    ``token-mean``: :func:`agg_token_mean`; ``token-sum``: ``sum(l * m)``; ``seq-mean-token-sum``: each sequence's
    token sum, summed over the sequences that have a token, ``/ global_num_seqs``; ``seq-mean-token-mean``: each
    sequence's token mean (``/ (tokens + 1e-8)``) likewise; ``seq-mean-token-sum-norm``: ``seq-mean-token-sum /
    loss_scale_factor`` (Dr. GRPO, https://arxiv.org/abs/2503.20783). verl divides a sequence mode by the global
    mini-batch's sequence count (``ppo_mini_batch_size x rollout.n``), so does ``global_num_seqs``. With data
    parallelism the caller multiplies by the world size, as verl's ``dp_size`` does.

    Args:
        loss_mat, mask: ``(B, T)``.
        global_num_tokens: valid tokens of the whole mini-batch (token-mean).
        global_num_seqs: sequences of the whole mini-batch (the seq-mean modes).
        loss_scale_factor: the divisor of ``seq-mean-token-sum-norm``.

    Returns:
        0-d tensor.
    """
    if loss_agg_mode == "token-mean":
        return agg_token_mean(loss_mat, mask, global_num_tokens=global_num_tokens)
    if loss_agg_mode == "token-sum":
        return (loss_mat * mask).sum()
    if loss_agg_mode not in _SEQ_MODES:
        raise ValueError(f"loss_agg_mode: unknown mode {loss_agg_mode!r}")
    mask = mask.to(loss_mat.dtype)
    seq_sums, seq_tokens = (loss_mat * mask).sum(dim=-1), mask.sum(dim=-1)
    seq_losses = seq_sums / (seq_tokens + 1e-8) if loss_agg_mode == "seq-mean-token-mean" else seq_sums
    loss = (seq_losses * (seq_tokens > 0).to(seq_losses.dtype)).sum() / global_num_seqs
    return loss / loss_scale_factor if loss_agg_mode == "seq-mean-token-sum-norm" else loss


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    global_num_tokens: Scalar,
    loss_agg_mode: str = "token-mean",
    global_num_seqs: Scalar = 1,
    loss_scale_factor: Scalar = 1,
) -> dict[str, torch.Tensor]:
    """PPO clipped surrogate (https://arxiv.org/abs/1707.06347) with dual clip (Ye et al. 2020,
    https://arxiv.org/abs/1912.09729).

    Per token, with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``:
    ``l1 = -A r``, ``l2 = -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)``,
    ``l = max(l1, l2)``; for ``A < 0`` additionally ``l = min(l, -A * clip_ratio_c)``, which
    bounds the loss of a negative-advantage token whose ratio has exploded.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(B, T)``.
        clip_ratio_low, clip_ratio_high: the (possibly asymmetric) trust region.
        clip_ratio_c: dual-clip bound, > 1.
        global_num_tokens: see :func:`agg_token_mean`.
        loss_agg_mode, global_num_seqs, loss_scale_factor: how ``pg_loss`` is aggregated (:func:`agg_loss`).

    Returns:
        Dict of 0-d tensors that sum over micro-batches: ``pg_loss`` (differentiable, :func:`agg_loss`);
        detached metrics, each a token mean (:func:`agg_token_mean`, as verl's are): ``pg_clipfrac``
        (fraction of tokens with ``l2 > l1``), ``pg_clipfrac_lower`` (fraction where the
        dual clip bites) and ``ppo_kl`` (mean of ``old_log_prob - log_prob``).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0, got {clip_ratio_c}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_bound = -advantages * clip_ratio_c
    negative_adv = advantages < 0
    per_token_loss = torch.where(negative_adv, torch.minimum(loss_ppo, loss_dual_bound), loss_ppo)

    with torch.no_grad():
        clipped = (loss_clipped > loss_unclipped).to(per_token_loss.dtype)
        dual_clipped = ((loss_ppo > loss_dual_bound) & negative_adv).to(per_token_loss.dtype)
        neg_log_ratio = -log_ratio

    def agg(x: torch.Tensor) -> torch.Tensor:
        return agg_token_mean(x, response_mask, global_num_tokens=global_num_tokens)

    pg_loss = agg_loss(
        per_token_loss,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return {
        "pg_loss": pg_loss,
        "pg_clipfrac": agg(clipped),
        "pg_clipfrac_lower": agg(dual_clipped),
        "ppo_kl": agg(neg_log_ratio),
    }


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values_old: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    global_num_tokens: Scalar,
    **agg: Union[str, Scalar],
) -> dict[str, torch.Tensor]:
    """Clipped value loss (as in OpenAI baselines' PPO2 and verl).

    ``v_clip = clamp(vpreds, values_old - c, values_old + c)``; per token
    ``0.5 * max((vpreds - R)^2, (v_clip - R)^2)`` -- the pessimistic of the two keeps the
    critic from moving far from ``values_old`` in one update.

    Args:
        vpreds, returns, values_old, response_mask: ``(B, T)``.
        cliprange_value: ``c``.
        global_num_tokens: see :func:`agg_token_mean`.

    Returns:
        Dict of 0-d tensors aggregated with :func:`agg_token_mean`: ``vf_loss``
        (differentiable) and detached ``vf_clipfrac`` (fraction of tokens where the
        clipped term is strictly larger).
    """
    # verl's form: clamp(vpreds, old - c, old + c) is vpreds itself, bit for bit, when nothing is clipped
    # (old + (vpreds - old) can differ by one ulp, which would count as a clip in vf_clipfrac)
    vpreds_clipped = torch.clamp(vpreds, values_old - cliprange_value, values_old + cliprange_value)
    loss_unclipped = (vpreds - returns).square()
    loss_clipped = (vpreds_clipped - returns).square()
    per_token_loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    with torch.no_grad():
        clipped = (loss_clipped > loss_unclipped).to(per_token_loss.dtype)
    return {
        # aggregated like the actor's loss (verl's critic.loss_agg_mode follows the actor's; ``agg`` as in
        # compute_entropy_loss, token-mean by default)
        "vf_loss": agg_loss(
            per_token_loss, response_mask, global_num_tokens=global_num_tokens, **{"loss_agg_mode": "token-mean", **agg}
        ),
        "vf_clipfrac": agg_token_mean(clipped, response_mask, global_num_tokens=global_num_tokens),
    }


def compute_entropy_loss(
    entropy: torch.Tensor, response_mask: torch.Tensor, *, global_num_tokens: Scalar, **agg: Union[str, Scalar]
) -> torch.Tensor:
    """Entropy aggregated like the policy loss (``agg``: :func:`agg_loss`'s ``loss_agg_mode``,
    ``global_num_seqs``, ``loss_scale_factor``; token-mean by default) ``(B, T) -> 0-d``; the caller subtracts
    ``entropy_coeff`` times it."""
    return agg_loss(
        entropy, response_mask, global_num_tokens=global_num_tokens, **{"loss_agg_mode": "token-mean", **agg}
    )


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_loss_type: str,
    global_num_tokens: Scalar,
    **agg: Union[str, Scalar],
) -> torch.Tensor:
    """KL to the reference policy as a loss term (GRPO-style, verl's ``use_kl_loss``): ``kl_penalty(kl_loss_type)``
    aggregated like the policy loss (``agg`` as in :func:`compute_entropy_loss`), ``(B, T) -> 0-d``."""
    kl = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
    return agg_loss(kl, response_mask, global_num_tokens=global_num_tokens, **{"loss_agg_mode": "token-mean", **agg})
