"""Run by torchrun from tests/test_invariance.py: one PPO update of actor and critic per knob variant.

Every variant starts from the same seeded weights and the same global batch (fixed random
responses, advantages and returns); each rank takes its slice. Rank 0 saves the updated full
parameters of actor and critic to OUT/<variant>.pt.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from trainer.batching import rank_rows
from trainer.config import load_config
from trainer.data import PromptDataset, left_pad, load_rows
from trainer.models import load_tokenizer
from trainer.parallel import clean_state_dict, full_state_dict
from trainer.run import build_roles
from trainer.step import assemble_batch, compute_log_probs, compute_values, update_actor, update_critic

BASE = "configs/tiny_cpu.yaml"
GLOBAL_BATCH = 16


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
    return {k: v.to(device) for k, v in batch.items()}


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
        cfg = load_config(
            BASE,
            {
                **overrides,
                "trainer.n_gpus_per_node": world,
                "ppotune.device": device.type,
                "actor_rollout_ref.actor.optim.lr": 1e-4,
                "critic.optim.lr": 1e-4,
            },
        )
        tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.path)
        roles, _ = build_roles(cfg, tokenizer, device, world, [])
        full = fixed_batch(cfg, tokenizer, device)
        rows = torch.tensor(rank_rows(GLOBAL_BATCH, cfg.actor_rollout_ref.actor.ppo_mini_batch_size, world, rank))
        batch = {k: v[rows] for k, v in full.items()}
        init_actor = full_state_dict(roles.actor.sharded, device=device)
        P, s, plans = cfg.data.max_prompt_length, roles.settings, roles.plans
        batch["old_log_probs"] = compute_log_probs(
            roles.actor, batch, plans.rollout_log_prob, prompt_width=P, temperature=s.temperature
        )
        batch["ref_log_probs"] = compute_log_probs(
            roles.ref, batch, plans.ref, prompt_width=P, temperature=s.temperature
        )
        batch["values"] = compute_values(roles.critic, batch, plans.critic_forward, prompt_width=P)
        batch["returns"] = batch["values"] + batch.pop("return_noise")
        update_critic(
            roles.critic,
            batch,
            plans.critic,
            cliprange_value=s.cliprange_value,
            grad_clip=s.critic_grad_clip,
            mini_per_gpu=s.critic_mini_batch_size_per_gpu,
            epochs=s.critic_epochs,
            prompt_width=P,
            device=device,
        )
        stats = update_actor(
            roles.actor,
            batch,
            plans.actor,
            s.actor_loss,
            mini_per_gpu=s.ppo_mini_batch_size_per_gpu,
            epochs=s.ppo_epochs,
            prompt_width=P,
            temperature=s.temperature,
            device=device,
        )
        actor_sd = full_state_dict(roles.actor.sharded, device=device)
        critic_sd = full_state_dict(roles.critic.sharded, device=device)
        if rank == 0:
            torch.save(
                {
                    "actor": clean_state_dict(actor_sd),
                    "critic": clean_state_dict(critic_sd),
                    "stats": stats,
                    "init_actor": clean_state_dict(init_actor),
                },
                f"{out_dir}/{name}.pt",
            )
        del roles
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
