"""Run by torchrun from tests/trainer/invariance.py: one PPO update of actor and critic per knob variant.

Every variant starts from the same seeded weights and the same global batch (fixed random
responses, advantages and returns); each rank takes its slice. Rank 0 saves to OUT/<variant>.pt the
updated full parameters of actor and critic, their full gradients at every optimizer step, and the
update statistics.

The gradients are captured by an optimizer step pre-hook, so after ``clip_grad_norm``: every variant's
gradient is scaled by the same clip coefficient (its global norm is the same), and the norm before
clipping is compared through the ``grad_norm`` statistics.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from trainer.config import FSDP_SECTIONS, load_config
from trainer.engine.data import PromptDataset, left_pad, load_rows
from trainer.engine.models import load_tokenizer
from trainer.engine.parallel import Sharded, clean_state_dict, full_state_dict
from trainer.engine.roles import build_roles, resident
from trainer.engine.step import (
    actor_update,
    assemble_batch,
    compute_advantages,
    compute_log_probs,
    compute_old_log_probs,
    compute_values,
    critic_update,
)
from trainer.launch.proc import leave_rank
from trainer.rank.trial import rows_of_rank

BASE = "configs/tiny_cpu.yaml"
GLOBAL_BATCH = 16
#: Under every variant's own overrides: fp32 compute (the default is verl's bf16: a bf16 variant sets it
#: back), and a learning rate large enough that one update moves the weights far beyond the tolerance.
COMMON = {
    **{f"{section}.mixed_precision.param_dtype": "fp32" for section in FSDP_SECTIONS},
    "actor_rollout_ref.actor.optim.lr": 1e-4,
    "critic.optim.lr": 1e-4,
}


def fixed_batch(cfg, tokenizer, device):
    rows = load_rows(cfg.data, cfg.ppotune.synthetic)
    ds = PromptDataset.build(rows, tokenizer, max_prompt_length=cfg.data.max_prompt_length, truncation="error")
    g = torch.Generator().manual_seed(1234)
    idx = torch.randperm(len(ds), generator=g)[:GLOBAL_BATCH].tolist()
    prompt_ids, prompt_mask = left_pad(
        [ds.input_ids[i] for i in idx], cfg.data.max_prompt_length, tokenizer.pad_token_id
    )
    R = cfg.data.max_response_length
    lengths = torch.randint(1, R + 1, (GLOBAL_BATCH,), generator=g)
    mask = (torch.arange(R)[None] < lengths[:, None]).long()
    responses = torch.randint(5, len(tokenizer), (GLOBAL_BATCH, R), generator=g) * mask + tokenizer.pad_token_id * (
        1 - mask
    )
    batch = assemble_batch(prompt_ids, prompt_mask, responses, mask)
    batch["advantages"] = torch.randn(GLOBAL_BATCH, R, generator=g) * mask
    batch["return_noise"] = torch.randn(GLOBAL_BATCH, R, generator=g) * mask
    # a critic-free job's outcome scores (0, 0.5 or 1) on each response's last token
    scores = torch.randint(0, 3, (GLOBAL_BATCH,), generator=g).float() / 2
    batch["token_level_scores"] = torch.zeros(GLOBAL_BATCH, R).index_put_(
        (torch.arange(GLOBAL_BATCH), lengths - 1), scores
    )
    return {k: v.to(device) for k, v in batch.items()}


def full_gradients(sharded: Sharded, device: torch.device) -> dict:
    """The full (unsharded) gradient of every parameter, plain HF names, on CPU; every rank must call it."""
    if sharded.strategy == "fsdp":
        return clean_state_dict(_fsdp1_gradients(sharded.module))
    from torch.distributed.tensor import DTensor

    grads = {}
    for n, p in sharded.module.named_parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            # under CPUOffloadPolicy the shards are CPU tensors, which a GPU process group cannot gather
            local = g.to_local().to(device)
            g = DTensor.from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride()).full_tensor()
        grads[n] = g
    return clean_state_dict(grads)


def _fsdp1_gradients(root) -> dict:
    """FSDP1 with flat parameters (verl's ``use_orig_params=False``): each unit's flat gradient gathered from the
    ranks' shards (each shard padded to the same size), then cut into the original parameters it holds."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    prefixes = {id(m): name for name, m in root.named_modules()}
    grads = {}
    for unit in FSDP.fsdp_modules(root):
        handle = unit._handle
        if handle is None or handle.flat_param.grad is None:
            continue
        flat = handle.flat_param
        local = flat.grad.detach()
        if handle.uses_sharded_strategy and dist.get_world_size(handle.process_group) > 1:
            full = local.new_empty(local.numel() * dist.get_world_size(handle.process_group))
            dist.all_gather_into_tensor(full, local, group=handle.process_group)
        else:
            full = local
        prefix = prefixes[id(unit)]
        offset = 0
        for fqn, shape, numel in zip(flat._fqns, flat._shapes, flat._numels):
            grads[f"{prefix}.{fqn}" if prefix else fqn] = full[offset : offset + numel].view(shape).clone()
            offset += numel
    return grads


def capture_gradients(trainee, device: torch.device, into: list) -> None:
    """Append the full gradients to ``into`` before each optimizer step (after clipping)."""

    def hook(optimizer, args, kwargs):
        into.append(full_gradients(trainee.sharded, device))

    trainee.optimizer.register_step_pre_hook(hook)


def state_dict(trainee, device: torch.device) -> dict | None:
    """The full parameters on rank 0; with ``param_offload`` the shards are brought back to the device for
    the gather, as any phase does."""
    with resident(trainee, device):
        return full_state_dict(trainee.sharded, device=device)


def run_variant(overrides: dict, *, world: int, rank: int, device: torch.device) -> dict | None:
    """One PPO update of actor and critic; -> what rank 0 saves (None on the other ranks)."""
    cfg = load_config(BASE, {**COMMON, **overrides, "trainer.n_gpus_per_node": world, "ppotune.device": device.type})
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.path)
    # on a CPU too, every offload knob runs its mechanism (real copies, activation offload's hooks)
    roles, _ = build_roles(cfg, tokenizer, device, world, [], offload_on_cpu=True)
    full = fixed_batch(cfg, tokenizer, device)
    # rows as trainer/rank/trial.py takes them: blocks that split the actor's and the critic's mini-batches
    rows = torch.tensor(rows_of_rank(cfg, GLOBAL_BATCH, world, rank), device=device)
    batch = {k: v[rows] for k, v in full.items()}
    if roles.critic is None:
        return _critic_free_update(cfg, roles, batch, rows, rank=rank, device=device)
    grads = {"actor": [], "critic": []}
    capture_gradients(roles.actor, device, grads["actor"])
    capture_gradients(roles.critic, device, grads["critic"])
    init_actor, init_critic = state_dict(roles.actor, device), state_dict(roles.critic, device)
    P, s, plans = cfg.data.max_prompt_length, roles.settings, roles.plans
    batch["old_log_probs"], old_entropy = compute_old_log_probs(
        roles.actor, batch, plans.rollout_log_prob, prompt_width=P, temperature=s.sampling.temperature, device=device
    )
    batch["ref_log_probs"] = compute_log_probs(
        roles.ref, batch, plans.ref, prompt_width=P, temperature=s.sampling.temperature, device=device
    )
    batch["values"] = compute_values(roles.critic, batch, plans.critic_forward, prompt_width=P, device=device)
    batch["returns"] = batch["values"] + batch.pop("return_noise")
    critic_stats = critic_update(roles, batch, prompt_width=P, device=device)
    actor_stats = actor_update(roles, batch, prompt_width=P, device=device)
    # the old-log-prob pass's entropy (the actor/entropy metric): chunked or not, the same numbers
    mask = batch["response_mask"].double()
    totals = torch.stack([(old_entropy.double() * mask).sum(), mask.sum()])
    dist.all_reduce(totals)
    actor_stats["actor/old_entropy"] = (totals[0] / totals[1]).item()
    actor_sd, critic_sd = state_dict(roles.actor, device), state_dict(roles.critic, device)
    if rank != 0:
        return None
    return {
        "actor": clean_state_dict(actor_sd),
        "critic": clean_state_dict(critic_sd),
        "grads": grads,
        "stats": {**actor_stats, **critic_stats},
        # the activation offload hooks ran (built on first use), on a CPU as on a GPU
        "activation_offload_ran": roles.actor.sharded.activation_offload is not None,
        "init_actor": clean_state_dict(init_actor),
        "init_critic": clean_state_dict(init_critic),
    }


def _critic_free_update(cfg, roles, batch: dict, rows: torch.Tensor, *, rank: int, device: torch.device) -> dict | None:
    """A GRPO-style update: old and reference log-probs, the estimator's advantages from the scores grouped by
    prompt over the global batch (the step's own function: a prompt's responses may sit on both ranks), the
    actor's update with the KL loss; -> what rank 0 saves (actor only)."""
    grads = {"actor": []}
    capture_gradients(roles.actor, device, grads["actor"])
    init_actor = state_dict(roles.actor, device)
    P, s, plans = cfg.data.max_prompt_length, roles.settings, roles.plans
    batch["old_log_probs"], _ = compute_old_log_probs(
        roles.actor, batch, plans.rollout_log_prob, prompt_width=P, temperature=s.sampling.temperature, device=device
    )
    if roles.ref is not None:  # a KL reads it
        batch["ref_log_probs"] = compute_log_probs(
            roles.ref, batch, plans.ref, prompt_width=P, temperature=s.sampling.temperature, device=device
        )
    batch["advantages"] = None  # replaced by the estimator's
    compute_advantages(roles, batch, rows // cfg.actor_rollout_ref.rollout.n)
    actor_stats = actor_update(roles, batch, prompt_width=P, device=device)
    actor_sd = state_dict(roles.actor, device)
    if rank != 0:
        return None
    return {
        "actor": clean_state_dict(actor_sd),
        "grads": grads,
        "stats": actor_stats,
        "init_actor": clean_state_dict(init_actor),
    }


def main():
    out_dir, variants = sys.argv[1], json.loads(open(sys.argv[2]).read())
    use_cuda = os.environ.get("PPOTUNE_TEST_DEVICE") == "cuda"
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # cuBLAS must be deterministic for exact comparisons across runs
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    for name, overrides in variants.items():
        t0 = time.perf_counter()
        saved = run_variant(overrides, world=world, rank=rank, device=device)
        if saved is not None:
            torch.save(saved, f"{out_dir}/{name}.pt")
            print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


if __name__ == "__main__":
    main()
