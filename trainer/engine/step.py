"""One PPO iteration on one rank, as numbered phases (torchtune's recipe style): :func:`ppo_step`, and the
forward passes and updates its phases run on the roles (trainer/engine/roles.py: what a role is, and how a
config builds them).

The per-GPU knobs enter only through :class:`~trainer.engine.roles.MicroBatching`, ``rmpad`` and the sharding:
losses are token means over the GLOBAL mini-batch (the token count is all-reduced once per
mini-batch), so the update does not depend on how the batch is split across micro-batches or
ranks. No ``.item()`` inside micro-batch loops: statistics stay on device and are read once per
mini-batch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from trainer.engine import core
from trainer.engine.attention import packed_attention_kwargs
from trainer.engine.batching import (
    fixed_micro_batches,
    min_num_micro_batches,
    pack,
    pad_packed,
    response_positions,
    token_budget_micro_batches,
    unpack_response,
)
from trainer.engine.data import score_response
from trainer.engine.metrics import PhaseMeter
from trainer.engine.parallel import (
    activation_offload_context,
    clip_grad_norm,
    compute_autocast,
    gradient_sync,
)
from trainer.engine.roles import ActorLoss, MicroBatching, Roles, Trainee, resident

__all__ = [
    "forward_response",
    "compute_log_probs",
    "compute_values",
    "update_actor",
    "update_critic",
    "critic_update",
    "actor_update",
    "ppo_step",
    "assemble_batch",
]


# --------------------------------------------------------------------------- forward passes
def forward_response(
    module: torch.nn.Module,
    mb: dict,
    *,
    kind: str,
    rmpad: bool,
    prompt_width: int,
    temperature: float = 1.0,
    entropy_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    pad_to_multiple: Optional[int] = None,
) -> dict:
    """Per-response-token outputs of one micro-batch: ``log_prob`` (+ ``entropy`` with an ``entropy_fn``)
    or ``values``, each (b, R).

    rmpad: the valid tokens of all rows are packed into one row (no pad token enters the forward),
    padded at the tail to a multiple of ``pad_to_multiple`` if given (verl's ``pad_to_length``).
    padded: rows keep the [left-padded prompt | right-padded response] layout.
    """
    ids, attn, pos, resp = mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb["responses"]
    R = resp.shape[1]
    if rmpad:
        packed_ids, packed_pos, _ = pack(ids, attn, pos)
        if pad_to_multiple:
            packed_ids, packed_pos = pad_packed(packed_ids, packed_pos, pad_to_multiple)
        # sequence boundaries for the attention layers: no T x T mask (trainer/engine/attention.py)
        varlen = packed_attention_kwargs(packed_pos)
        out = module(input_ids=packed_ids, position_ids=packed_pos, use_cache=False, **varlen).logits[0]  # (T, V or 1)
        idx, resp_mask = response_positions(attn, mb["response_mask"], prompt_width)
        rows = out[idx]  # (N, V or 1)
        if kind == "critic":
            return {"values": unpack_response(rows[:, 0].float(), resp_mask)}
        labels = resp[resp_mask]
        logits = rows.float() / temperature
        result = {"log_prob": unpack_response(core.logprobs_from_logits(logits, labels), resp_mask)}
        if entropy_fn is not None:
            result["entropy"] = unpack_response(entropy_fn(logits), resp_mask)
        return result
    out = module(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    rows = out[:, prompt_width - 1 : prompt_width - 1 + R]  # logits that predict each response token
    if kind == "critic":
        return {"values": rows[..., 0].float() * mb["response_mask"]}
    logits = rows.float() / temperature
    result = {"log_prob": core.logprobs_from_logits(logits, resp) * mb["response_mask"]}
    if entropy_fn is not None:
        result["entropy"] = entropy_fn(logits) * mb["response_mask"]
    return result


def _select(batch: dict, idx: list[int]) -> dict:
    index = torch.tensor(idx, dtype=torch.long, device=batch["input_ids"].device)
    return {k: v.index_select(0, index) for k, v in batch.items()}


def plan_micro_batches(batch: dict, idx: list[int], plan: MicroBatching) -> list[list[int]]:
    """Micro-batches (lists of row indices) of the rows ``idx``; with a token budget the number is
    all-reduced (MAX) so every rank runs the same number of FSDP passes (some may be empty)."""
    if not plan.dynamic:
        return [[idx[i] for i in chunk] for chunk in fixed_micro_batches(len(idx), plan.micro_batch_size)]
    lengths = batch["attention_mask"][idx].sum(-1).tolist()
    k = torch.tensor([min_num_micro_batches(lengths, plan.max_token_len)], dtype=torch.long)
    if dist.is_initialized():
        k = k.to(batch["input_ids"].device)
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
    bins = token_budget_micro_batches(lengths, plan.max_token_len, int(k.item()))
    return [[idx[i] for i in b] for b in bins]


def _forward_only(
    trainee: Trainee,
    batch: dict,
    plan: MicroBatching,
    *,
    kind: str,
    prompt_width: int,
    temperature: float,
    device: torch.device,
    entropy: bool = False,
) -> dict:
    keys = ["values"] if kind == "critic" else ["log_prob"] + (["entropy"] if entropy else [])
    n = batch["input_ids"].shape[0]
    out = {k: torch.zeros_like(batch["responses"], dtype=torch.float32) for k in keys}
    module = trainee.sharded.module
    with torch.no_grad(), resident(trainee, device), compute_autocast(trainee.sharded, device.type):
        for mb_idx in plan_micro_batches(batch, list(range(n)), plan):
            # an empty micro-batch still runs (on row 0) so FSDP's collectives line up across ranks
            rows = mb_idx or [0]
            res = forward_response(
                module,
                _select(batch, rows),
                kind=kind,
                rmpad=trainee.rmpad,
                prompt_width=prompt_width,
                temperature=temperature,
                entropy_fn=trainee.entropy_fn if entropy else None,
                pad_to_multiple=trainee.pad_to_multiple,
            )
            if mb_idx:
                index = torch.tensor(mb_idx, device=device)
                for k in keys:
                    out[k][index] = res[k]
    return out


def compute_log_probs(
    trainee: Trainee, batch: dict, plan: MicroBatching, *, prompt_width: int, temperature: float, device: torch.device
) -> torch.Tensor:
    """Per-token log-probs (B, R) of the responses (the reference model's, or the actor's)."""
    return _forward_only(
        trainee, batch, plan, kind="actor", prompt_width=prompt_width, temperature=temperature, device=device
    )["log_prob"]


def compute_old_log_probs(
    trainee: Trainee, batch: dict, plan: MicroBatching, *, prompt_width: int, temperature: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour policy's log-probs and, without autograd, its entropy (verl's old-log-prob pass
    computes the ``actor/entropy`` metric there, so the update need not unless entropy is in the loss)."""
    out = _forward_only(
        trainee,
        batch,
        plan,
        kind="actor",
        prompt_width=prompt_width,
        temperature=temperature,
        device=device,
        entropy=True,
    )
    return out["log_prob"], out["entropy"]


def compute_values(
    trainee: Trainee, batch: dict, plan: MicroBatching, *, prompt_width: int, device: torch.device
) -> torch.Tensor:
    return _forward_only(
        trainee, batch, plan, kind="critic", prompt_width=prompt_width, temperature=1.0, device=device
    )["values"]


# --------------------------------------------------------------------------- updates
def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _optimizer_step(trainee: Trainee, grad_clip: float, device: torch.device) -> torch.Tensor:
    grad_norm = clip_grad_norm(trainee.sharded, grad_clip, device)
    if torch.isfinite(grad_norm):  # verl skips the step on a non-finite norm
        trainee.optimizer.step()
    trainee.optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach()


def _minibatch_loop(
    trainee: Trainee,
    batch: dict,
    *,
    mini_per_gpu: int,
    epochs: int,
    plan: MicroBatching,
    loss_fn,
    stat_names: list[str],
    grad_clip: float,
    device: torch.device,
) -> dict:
    """epochs x mini-batches x micro-batches, gradient accumulation; returns mean stats over mini-batches."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    n = batch["input_ids"].shape[0]
    totals: dict[str, float] = {k: 0.0 for k in stat_names + ["grad_norm"]}
    num_updates = 0
    module = trainee.sharded.module
    with resident(trainee, device, update=True):
        for _ in range(epochs):
            for start in range(0, n, mini_per_gpu):
                idx = list(range(start, min(start + mini_per_gpu, n)))
                num_tokens = _all_reduce_sum(batch["response_mask"][idx].sum().to(torch.float64))
                global_tokens = num_tokens.clamp(min=1.0)
                acc = torch.zeros(len(stat_names), dtype=torch.float64, device=device)
                micro = plan_micro_batches(batch, idx, plan)
                for i, mb_idx in enumerate(micro):
                    weight = 1.0 if mb_idx else 0.0  # an empty micro-batch runs on row 0 with zero weight
                    mb = _select(batch, mb_idx or [idx[0]])
                    sync = i == len(micro) - 1 or not trainee.no_sync
                    with gradient_sync(trainee.sharded, sync):
                        with activation_offload_context(trainee.activation_offload, device):
                            with compute_autocast(trainee.sharded, device.type):
                                loss, stats = loss_fn(module, mb, global_tokens)
                        # FSDP averages gradients over ranks; x world makes the sum of token losses / global
                        # tokens exact.
                        (loss * (weight * world)).backward()
                    acc += torch.stack([stats[k].detach().to(torch.float64) for k in stat_names]) * weight
                grad_norm = _optimizer_step(trainee, grad_clip, device)
                acc = _all_reduce_sum(acc)
                values = acc.tolist()  # one device sync per mini-batch, not per micro-batch
                for k, v in zip(stat_names, values):
                    totals[k] += v
                totals["grad_norm"] += float(grad_norm)
                num_updates += 1
    return {k: v / max(num_updates, 1) for k, v in totals.items()}


def update_actor(
    trainee: Trainee,
    batch: dict,
    plan: MicroBatching,
    loss_cfg: ActorLoss,
    *,
    mini_per_gpu: int,
    epochs: int,
    prompt_width: int,
    temperature: float,
    device: torch.device,
) -> dict:
    """PPO update of the actor. The entropy is computed under autograd only when it is in the loss
    (``entropy_coeff`` != 0) or asked for (``calculate_entropy``), as verl does: otherwise no
    (N, V) softmax is kept for backward; the ``actor/entropy`` metric comes from the old-log-prob pass."""
    with_entropy = bool(loss_cfg.entropy_coeff) or loss_cfg.calculate_entropy

    def loss_fn(module, mb, global_tokens):
        out = forward_response(
            module,
            mb,
            kind="actor",
            rmpad=trainee.rmpad,
            prompt_width=prompt_width,
            temperature=temperature,
            entropy_fn=trainee.entropy_fn if with_entropy else None,
            pad_to_multiple=trainee.pad_to_multiple,
        )
        mask = mb["response_mask"]
        pg = core.compute_policy_loss(
            mb["old_log_probs"],
            out["log_prob"],
            mb["advantages"],
            mask,
            clip_ratio_low=loss_cfg.clip_ratio_low,
            clip_ratio_high=loss_cfg.clip_ratio_high,
            clip_ratio_c=loss_cfg.clip_ratio_c,
            global_num_tokens=global_tokens,
        )
        loss = pg["pg_loss"]
        if with_entropy:
            entropy = core.compute_entropy_loss(out["entropy"], mask, global_num_tokens=global_tokens)
            loss = loss - loss_cfg.entropy_coeff * entropy
        kl = core.compute_kl_loss(
            out["log_prob"],
            mb["ref_log_probs"],
            mask,
            kl_loss_type=loss_cfg.kl_loss_type,
            global_num_tokens=global_tokens,
        )
        if loss_cfg.use_kl_loss:
            loss = loss + loss_cfg.kl_loss_coef * kl
        stats = {
            "pg_loss": pg["pg_loss"],
            "pg_clipfrac": pg["pg_clipfrac"],
            "pg_clipfrac_lower": pg["pg_clipfrac_lower"],
            "ppo_kl": pg["ppo_kl"],
            "kl_loss": kl,
        }
        if with_entropy:
            stats["entropy_loss"] = entropy
        return loss, stats

    names = ["pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss"] + (
        ["entropy_loss"] if with_entropy else []
    )
    stats = _minibatch_loop(
        trainee,
        batch,
        mini_per_gpu=mini_per_gpu,
        epochs=epochs,
        plan=plan,
        loss_fn=loss_fn,
        stat_names=names,
        grad_clip=loss_cfg.grad_clip,
        device=device,
    )
    return {f"actor/{k}": v for k, v in stats.items()}


def update_critic(
    trainee: Trainee,
    batch: dict,
    plan: MicroBatching,
    *,
    cliprange_value: float,
    grad_clip: float,
    mini_per_gpu: int,
    epochs: int,
    prompt_width: int,
    device: torch.device,
) -> dict:
    def loss_fn(module, mb, global_tokens):
        vpreds = forward_response(module, mb, kind="critic", rmpad=trainee.rmpad, prompt_width=prompt_width)["values"]
        vf = core.compute_value_loss(
            vpreds,
            mb["returns"],
            mb["values"],
            mb["response_mask"],
            cliprange_value=cliprange_value,
            global_num_tokens=global_tokens,
        )
        return vf["vf_loss"], vf

    stats = _minibatch_loop(
        trainee,
        batch,
        mini_per_gpu=mini_per_gpu,
        epochs=epochs,
        plan=plan,
        loss_fn=loss_fn,
        stat_names=["vf_loss", "vf_clipfrac"],
        grad_clip=grad_clip,
        device=device,
    )
    return {f"critic/{k}": v for k, v in stats.items()}


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
    texts = tokenizer.batch_decode([r[: int(n)].tolist() for r, n in zip(responses, lengths)], skip_special_tokens=True)
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
        kl_sum = _all_reduce_sum(kl_mean.detach().to(torch.float64).reshape(1) * num_seqs)
        current_kl = float(kl_sum.item()) / (num_seqs * (dist.get_world_size() if dist.is_initialized() else 1))
        metrics["actor/reward_kl_penalty"] = current_kl
        # verl steps the controller by the number of responses in the batch (prompts x rollout.n)
        kl_ctrl.update(current_kl, n_steps=s.train_batch_size * s.rollout_n)
    else:
        rewards = scores
    batch["token_level_rewards"] = rewards
    adv, returns = core.compute_gae_advantage_return(rewards, batch["values"], response_mask, gamma=s.gamma, lam=s.lam)
    moments = _all_reduce_sum(torch.stack(core.masked_moments(adv, response_mask)).to(torch.float64))
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
    glob = _all_reduce_sum(local).tolist()
    metrics = {"actor/entropy": glob[5] / max(glob[3], 1.0)}  # token mean over the global batch
    metrics["critic/score/mean"] = metrics["reward/mean"] = glob[0] / glob[1]
    metrics["response_length/mean"] = glob[3] / glob[1]
    metrics["perf/total_num_tokens"] = int(glob[2])
    metrics["_sum_seqlen_sq"] = glob[4]
    metrics["_lengths"] = (
        batch["attention_mask"][:, :prompt_width].sum(-1).tolist(),
        response_mask.sum(-1).tolist(),
    )
    return metrics
