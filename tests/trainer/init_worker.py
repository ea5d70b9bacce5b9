"""Run by torchrun from engine/test_models.py: build actor, ref and critic from a checkpoint whose LM head is
tied to its embedding (rank 0 loads, the others build on the meta device) and report, per strategy,
whether the tie survived sharding and whether every rank holds the same full weights; then how many
process groups three hybrid-sharded builds leave."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from trainer.config import FSDP_SECTIONS, load_config
from trainer.engine.models import load_tokenizer
from trainer.engine.roles import build_roles
from trainer.launch.proc import leave_rank


def check(ckpt: str, strategy: str) -> dict:
    over = {"actor_rollout_ref.model.path": ckpt, "actor_rollout_ref.actor.strategy": strategy}
    cfg = load_config(sys.argv[3], over)
    roles, _ = build_roles(cfg, load_tokenizer(ckpt), torch.device("cpu"), dist.get_world_size(), [])
    m = roles.actor.sharded.module
    if strategy == "fsdp":
        with FSDP.summon_full_params(m):
            tied = m.module.lm_head.weight is m.module.model.embed_tokens.weight
            full = m.module.lm_head.weight.detach().clone()
    else:
        tied = m.lm_head.weight is m.model.embed_tokens.weight
        full = m.lm_head.weight.full_tensor().detach().clone()
    every = [torch.zeros_like(full) for _ in range(dist.get_world_size())]
    dist.all_gather(every, full)
    return {"tied": tied, "ranks_agree": all(torch.equal(every[0], w) for w in every)}


def groups_after_rewraps(ckpt: str) -> list[int]:
    """Process groups alive after each of three builds of every role with hybrid sharding (as a warm job
    re-wraps per trial): a mesh per wrapped model would add groups every time."""
    over = {"actor_rollout_ref.model.path": ckpt, "actor_rollout_ref.actor.strategy": "fsdp2"}
    over["critic.strategy"] = "fsdp2"
    over |= {f"{section}.fsdp_size": 1 for section in FSDP_SECTIONS}
    cfg = load_config(sys.argv[3], over)
    counts = []
    for _ in range(3):
        build_roles(cfg, load_tokenizer(ckpt), torch.device("cpu"), dist.get_world_size(), [])
        counts.append(len(dist.distributed_c10d._world.pg_map))
    return counts


def main():
    dist.init_process_group("gloo")
    ckpt, out = sys.argv[1], sys.argv[2]
    got = {s: check(ckpt, s) for s in ("fsdp", "fsdp2")}
    got["groups_after_rewraps"] = groups_after_rewraps(ckpt)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(got, f)
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


if __name__ == "__main__":
    main()
