"""One PPO iteration on one rank, as numbered phases (torchtune's recipe style): :func:`ppo_step`. The passes its
phases run on the roles (forward passes, updates) are in trainer/engine/passes.py, re-exported here; the roles
themselves, and how a config builds them, in trainer/engine/roles.py.

No device read inside a micro-batch loop: a pass reads its batch's masks once, an update its statistics once,
and the step's own figures (rewards, statistics) are each read in one copy.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from trainer.engine import core, estimators
from trainer.engine.data import score_response
from trainer.engine.metrics import PhaseMeter
from trainer.engine.passes import (
    actor_loss,
    all_reduce_sum,
    compute_log_probs,
    compute_old_log_probs,
    compute_values,
    forward_backward,
    forward_response,
    optimizer_step,
    plan_micro_batches,
    update_actor,
    update_critic,
)
from trainer.engine.roles import Roles

__all__ = [
    "forward_response",
    "plan_micro_batches",
    "forward_backward",
    "optimizer_step",
    "actor_loss",
    "compute_log_probs",
    "compute_old_log_probs",
    "compute_values",
    "update_actor",
    "update_critic",
    "critic_update",
    "actor_update",
    "ppo_step",
    "assemble_batch",
    "compute_advantages",
]


def critic_update(roles: Roles, batch: dict, *, prompt_width: int, device: torch.device) -> dict:
    """:func:`update_critic` of ``roles.critic`` with this run's plan and settings."""
    s = roles.settings
    return update_critic(
        roles.critic,
        batch,
        roles.plans.critic,
        cliprange_value=s.cliprange_value,
        grad_clip=s.critic_grad_clip,
        mini_per_gpu=s.critic_mini_batch_size_per_gpu,
        epochs=s.critic_epochs,
        prompt_width=prompt_width,
        device=device,
        loss_agg_mode=s.actor_loss.loss_agg_mode,
        loss_scale_factor=s.actor_loss.loss_scale_factor,
    )


def actor_update(roles: Roles, batch: dict, *, prompt_width: int, device: torch.device) -> dict:
    """:func:`update_actor` of ``roles.actor`` with this run's plan and settings."""
    s = roles.settings
    return update_actor(
        roles.actor,
        batch,
        roles.plans.actor,
        s.actor_loss,
        mini_per_gpu=s.ppo_mini_batch_size_per_gpu,
        epochs=s.ppo_epochs,
        prompt_width=prompt_width,
        temperature=s.sampling.temperature,
        device=device,
        with_reference=roles.ref is not None,
    )


# --------------------------------------------------------------------------- one iteration
def assemble_batch(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
) -> dict:
    """verl's layout: [left-padded prompt | right-padded response], position ids counting valid tokens."""
    attn = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attn,
        "position_ids": (torch.cumsum(attn, dim=1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
    }


def ppo_step(
    roles: Roles,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    ground_truths: list[str],
    meter: PhaseMeter,
    device: torch.device,
    *,
    uids: Optional[torch.Tensor] = None,
) -> dict:
    """Rollout -> reward -> old/ref log-probs -> values -> advantages -> critic and actor updates; -> the step's
    metrics, with ``_sum_seqlen_sq`` and this rank's ``_lengths`` for the run to take out.

    ``uids`` (B,): the prompt each row's response came from, the same id on every rank (verl's ``uid``: the
    ``rollout.n`` responses of a prompt form one group of a critic-free estimator); None: each row its own
    prompt. Each phase runs under ``meter.phase(name)``, in the order of ``trainer.contracts.PHASES``; the
    reference model's pass runs only when a KL reads it and the critic's only with a critic (verl's
    need_reference_policy, need_critic): a phase that does not run takes no time in the result."""
    s = roles.settings
    P = prompt_ids.shape[1]
    temperature = s.sampling.temperature
    metrics: dict = {}
    if uids is None:
        uids = _own_prompts(prompt_ids.shape[0], device)

    # step 0. the rollout engine gets the actor's current weights (verl: update_weights)
    with meter.phase("update_weights"):
        roles.update_weights(device)

    # step 1. rollout: sample responses from the current policy (remax: and one greedy response per prompt)
    with meter.phase("gen"):
        # a profiled step records the first decode steps of an HF generate (meter.decode_window), not all of them
        responses, response_mask = roles.generate(prompt_ids, prompt_mask, device, streamer=meter.decode_window)
        greedy = _greedy_rollout(roles, prompt_ids, prompt_mask, uids, device) if s.adv_estimator == "remax" else None
        meter.sample()  # a vLLM engine is still awake: its KV cache and weights count in this phase
        roles.release_rollout()
        batch = assemble_batch(prompt_ids, prompt_mask, responses, response_mask)

    # step 2. rule-based reward on the last response token (remax: the greedy responses' too, the baselines)
    with meter.phase("reward"):
        seq_scores = _reward(batch, roles.tokenizer, ground_truths, device)
        if greedy is not None:
            batch["reward_baselines"] = _greedy_scores(greedy, roles.tokenizer, ground_truths, device)

    # step 3. log-probs of the behaviour policy (the actor before this update)
    with meter.phase("old_log_prob"):
        batch["old_log_probs"], entropy = compute_old_log_probs(
            roles.actor, batch, roles.plans.rollout_log_prob, prompt_width=P, temperature=temperature, device=device
        )

    # step 4. log-probs of the frozen reference policy, for the KL penalty (in the reward or as a loss)
    if roles.ref is not None:
        with meter.phase("ref"):
            batch["ref_log_probs"] = compute_log_probs(
                roles.ref, batch, roles.plans.ref, prompt_width=P, temperature=temperature, device=device
            )

    # step 5. critic values
    if roles.critic is not None:
        with meter.phase("values"):
            batch["values"] = compute_values(
                roles.critic, batch, roles.plans.critic_forward, prompt_width=P, device=device
            )

    # step 6. KL-regularized rewards, the estimator's advantages (GAE: whitened over the global batch)
    with meter.phase("adv"):
        metrics.update(compute_advantages(roles, batch, uids))

    # step 7. critic update (verl's order: critic, then actor)
    if roles.critic is not None:
        with meter.phase("update_critic"):
            metrics.update(critic_update(roles, batch, prompt_width=P, device=device))

    # step 8. actor update: clipped surrogate (+ KL loss, entropy bonus)
    with meter.phase("update_actor"):
        metrics.update(actor_update(roles, batch, prompt_width=P, device=device))

    # step 9. global batch statistics (one collective)
    metrics.update(_batch_statistics(batch, seq_scores, entropy, prompt_width=P, device=device))
    return metrics


def _own_prompts(num_rows: int, device: torch.device) -> torch.Tensor:
    """Each row its own prompt, ids distinct across ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.arange(num_rows, device=device) + rank * num_rows


def _greedy_rollout(roles: Roles, prompt_ids, prompt_mask, uids: torch.Tensor, device) -> tuple:
    """ReMax's baselines: one greedy response (do_sample off) for each prompt of this rank, as verl generates one
    per prompt beside the sampled ones; -> (the rows' prompt among them, responses, response mask)."""
    _, first, inverse = _first_rows(uids)
    sampling = dataclasses.replace(roles.settings.sampling, do_sample=False)
    responses, mask = roles.generate(prompt_ids[first], prompt_mask[first], device, sampling=sampling)
    return inverse, responses, mask


def _first_rows(uids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(distinct ids, the first row of each, each row's position among them)."""
    uniq, inverse = torch.unique(uids, return_inverse=True)
    rows = torch.arange(uids.numel(), device=uids.device)
    first = torch.full_like(uniq, uids.numel()).scatter_reduce(0, inverse, rows, reduce="amin")
    return uniq, first, inverse


def _greedy_scores(greedy: tuple, tokenizer, ground_truths: list[str], device) -> torch.Tensor:
    """Each row's baseline: its prompt's greedy response's score (B,)."""
    inverse, responses, mask = greedy
    first = _first_rows(inverse)[1].tolist()
    probe = {"responses": responses, "response_mask": mask}
    scores = _reward(probe, tokenizer, [ground_truths[i] for i in first], device)
    return scores[inverse]


def _reward(batch: dict, tokenizer, ground_truths: list[str], device: torch.device) -> torch.Tensor:
    """Each response's rule-based score on its last token (``batch["token_level_scores"]``, (B, R));
    -> the scores (B,)."""
    responses, response_mask = batch["responses"], batch["response_mask"]
    scores = torch.zeros_like(response_mask, dtype=torch.float32)
    lengths = response_mask.sum(-1)
    # the responses and their lengths read to the host in one copy (one per row would wait once per row)
    host = torch.cat([responses, lengths.unsqueeze(1).to(responses.dtype)], dim=1).tolist()
    texts = tokenizer.batch_decode([r[: r[-1]] for r in host], skip_special_tokens=True)
    seq_scores = torch.tensor(
        [score_response(t, g) for t, g in zip(texts, ground_truths)], dtype=torch.float32, device=device
    )
    scores[torch.arange(len(texts), device=device), (lengths - 1).clamp(min=0)] = seq_scores
    batch["token_level_scores"] = scores
    return seq_scores


def compute_advantages(roles: Roles, batch: dict, uids: torch.Tensor) -> dict:
    """``token_level_rewards`` (the scores, less the KL penalty with ``use_kl_in_reward``), ``advantages`` and
    ``returns`` into ``batch`` as verl's ``compute_advantage`` makes them for ``algorithm.adv_estimator``
    (trainer/engine/estimators.py); -> the KL metrics."""
    s, kl_ctrl = roles.settings, roles.kl_ctrl
    scores, response_mask = batch["token_level_scores"], batch["response_mask"]
    num_seqs = batch["responses"].shape[0]
    metrics = {"actor/kl_coef": kl_ctrl.value}  # the coefficient this step's rewards use
    if s.use_kl_in_reward:
        rewards, kl_mean = core.apply_kl_in_reward(
            scores,
            batch["old_log_probs"],
            batch["ref_log_probs"],
            response_mask,
            kl_coef=kl_ctrl.value,
            kl_penalty_type=s.kl_penalty,
        )
        kl_sum = all_reduce_sum(kl_mean.detach().to(torch.float64).reshape(1) * num_seqs)
        current_kl = float(kl_sum.item()) / (num_seqs * (dist.get_world_size() if dist.is_initialized() else 1))
        metrics["actor/reward_kl_penalty"] = current_kl
        # verl steps the controller by the number of responses in the batch (prompts x rollout.n)
        kl_ctrl.update(current_kl, n_steps=s.train_batch_size * s.rollout_n)
    else:
        rewards = scores
    batch["token_level_rewards"] = rewards
    estimator = estimators.ESTIMATORS[s.adv_estimator]
    whiten = estimator.whiten
    if estimator.kind == "gae":
        adv, returns = core.compute_gae_advantage_return(
            rewards, batch["values"], response_mask, gamma=s.gamma, lam=s.lam
        )
        whiten = True  # verl whitens GAE's advantages over the batch
    elif estimator.kind == "outcome":
        adv = returns = estimators.broadcast(
            _outcome_advantages(estimator, rewards, response_mask, uids, s), response_mask
        )
    elif estimator.kind == "returns":
        adv = returns = estimators.reinforce_plus_plus_returns(rewards, response_mask, gamma=s.gamma)
    else:
        adv, returns = estimators.remax_advantage_return(rewards, batch["reward_baselines"], response_mask)
    if whiten:  # over the global batch: the moments all-reduced
        moments = all_reduce_sum(torch.stack(core.masked_moments(adv, response_mask)).to(torch.float64))
        mean, var = core.moments_to_mean_var(moments[0], moments[1], moments[2])
        adv = core.whiten(adv, response_mask, mean=mean, var=var)
    batch["advantages"] = adv.to(torch.float32)
    batch["returns"] = returns
    return metrics


def _outcome_advantages(estimator, rewards, response_mask, uids: torch.Tensor, s) -> torch.Tensor:
    """An outcome estimator over the global batch (a prompt's responses may sit on several ranks): every rank's
    scores, lengths and prompt ids gathered in one collective, the estimator run on all of them (the same
    numbers on every rank), this rank's rows taken back; -> (B,)."""
    local = torch.stack([rewards.sum(-1).double(), response_mask.sum(-1).double(), uids.double()], dim=1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        every, offset = torch.cat(parts), dist.get_rank() * local.shape[0]
    else:
        every, offset = local, 0
    adv = estimator.fn(every[:, 0], every[:, 2].long(), every[:, 1], s.norm_adv_by_std_in_grpo)
    return adv[offset : offset + local.shape[0]].to(rewards.dtype)


def _batch_statistics(
    batch: dict, seq_scores: torch.Tensor, entropy: torch.Tensor, *, prompt_width: int, device: torch.device
) -> dict:
    """Reward, entropy, lengths and token counts over the global batch (one collective), and this rank's
    prompt and response lengths (the run gathers them: the length distribution the measurement saw)."""
    response_mask = batch["response_mask"]
    seq_lens = batch["attention_mask"].sum(-1)
    local = torch.stack(
        [
            seq_scores.sum().double(),
            torch.tensor(float(batch["responses"].shape[0]), dtype=torch.float64, device=device),
            batch["attention_mask"].sum().double(),
            response_mask.sum().double(),
            (seq_lens.double() ** 2).sum(),
            core.masked_sum(entropy.double(), response_mask),
        ]
    )
    n = response_mask.shape[0]
    # one host read: the global figures and this rank's prompt and response lengths
    lengths = torch.cat([batch["attention_mask"][:, :prompt_width].sum(-1), response_mask.sum(-1)]).double()
    values = torch.cat([all_reduce_sum(local), lengths]).tolist()
    glob = values[: local.shape[0]]
    metrics = {"actor/entropy": glob[5] / max(glob[3], 1.0)}  # token mean over the global batch
    metrics["critic/score/mean"] = metrics["reward/mean"] = glob[0] / glob[1]
    metrics["response_length/mean"] = glob[3] / glob[1]
    metrics["perf/total_num_tokens"] = int(glob[2])
    metrics["_sum_seqlen_sq"] = glob[4]
    lens = [int(v) for v in values[local.shape[0] :]]
    metrics["_lengths"] = (lens[:n], lens[n:])
    return metrics
