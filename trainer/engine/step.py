"""One PPO iteration on one rank, as numbered phases (torchtune's recipe style): :func:`ppo_step`. The passes its
phases run on the roles (forward passes, updates) are in trainer/engine/passes.py, re-exported here; the roles
themselves, and how a config builds them, in trainer/engine/roles.py.

No device read inside a micro-batch loop: a pass reads its batch's masks once, an update its statistics once,
and the step's own figures (rewards, statistics) are each read in one copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.engine import core
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
) -> dict:
    """Rollout -> reward -> old/ref log-probs -> values -> advantages -> critic and actor updates; -> the step's
    metrics, with ``_sum_seqlen_sq`` and this rank's ``_lengths`` for the run to take out.

    Each phase runs under ``meter.phase(name)``, in the order of ``trainer.contracts.PHASES``."""
    s = roles.settings
    P = prompt_ids.shape[1]
    temperature = s.sampling.temperature
    metrics: dict = {}

    # step 0. the rollout engine gets the actor's current weights (verl: update_weights)
    with meter.phase("update_weights"):
        roles.update_weights(device)

    # step 1. rollout: sample responses from the current policy
    with meter.phase("gen"):
        responses, response_mask = roles.generate(prompt_ids, prompt_mask, device)
        meter.sample()  # a vLLM engine is still awake: its KV cache and weights count in this phase
        roles.release_rollout()
        batch = assemble_batch(prompt_ids, prompt_mask, responses, response_mask)

    # step 2. rule-based reward on the last response token
    with meter.phase("reward"):
        seq_scores = _reward(batch, roles.tokenizer, ground_truths, device)

    # step 3. log-probs of the behaviour policy (the actor before this update)
    with meter.phase("old_log_prob"):
        batch["old_log_probs"], entropy = compute_old_log_probs(
            roles.actor, batch, roles.plans.rollout_log_prob, prompt_width=P, temperature=temperature, device=device
        )

    # step 4. log-probs of the frozen reference policy, for the KL penalty
    with meter.phase("ref"):
        batch["ref_log_probs"] = compute_log_probs(
            roles.ref, batch, roles.plans.ref, prompt_width=P, temperature=temperature, device=device
        )

    # step 5. critic values
    with meter.phase("values"):
        batch["values"] = compute_values(roles.critic, batch, roles.plans.critic_forward, prompt_width=P, device=device)

    # step 6. KL-regularized rewards, GAE, advantages whitened over the global batch
    with meter.phase("adv"):
        metrics.update(_advantages(roles, batch))

    # step 7. critic update (verl's order: critic, then actor)
    with meter.phase("update_critic"):
        metrics.update(critic_update(roles, batch, prompt_width=P, device=device))

    # step 8. actor update: clipped surrogate (+ KL loss, entropy bonus)
    with meter.phase("update_actor"):
        metrics.update(actor_update(roles, batch, prompt_width=P, device=device))

    # step 9. global batch statistics (one collective)
    metrics.update(_batch_statistics(batch, seq_scores, entropy, prompt_width=P, device=device))
    return metrics


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


def _advantages(roles: Roles, batch: dict) -> dict:
    """``token_level_rewards`` (the scores, less the KL penalty with ``use_kl_in_reward``), ``advantages`` (GAE,
    whitened over the global batch) and ``returns`` into ``batch``; -> the KL metrics."""
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
    adv, returns = core.compute_gae_advantage_return(rewards, batch["values"], response_mask, gamma=s.gamma, lam=s.lam)
    moments = all_reduce_sum(torch.stack(core.masked_moments(adv, response_mask)).to(torch.float64))
    mean, var = core.moments_to_mean_var(moments[0], moments[1], moments[2])
    batch["advantages"] = core.whiten(adv, response_mask, mean=mean, var=var)
    batch["returns"] = returns
    return metrics


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
