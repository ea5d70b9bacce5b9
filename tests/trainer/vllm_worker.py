"""Run by torchrun from tests/trainer/engine/test_vllm_rollout.py: a real vLLM engine per rank, colocated with the
real FSDP actor (gloo), driven by the trainer's own code (build_roles, Roles.update_weights, ppo_step).

Greedy decoding throughout, so vLLM and HF ``generate`` must agree token for token:

1. push the actor's weights, generate with vLLM and with HF ``generate`` from the same sharded actor;
2. one real PPO step (its own push, rollout and update) with a large learning rate;
3. push the updated weights: vLLM's output changes, and still equals HF ``generate``'s;
4. push the weights saved before the step: the first outputs come back.

Rank 0 writes OUT (JSON): the responses of each stage per rank, and the run's notes.
"""

import json
import sys

import torch
import torch.distributed as dist

from trainer.config import load_config
from trainer.engine.data import PromptDataset, left_pad, load_rows
from trainer.engine.metrics import PhaseMeter
from trainer.engine.models import load_tokenizer
from trainer.engine.parallel import iter_full_params
from trainer.engine.roles import build_roles, resident
from trainer.engine.rollout import generate_responses
from trainer.engine.step import ppo_step
from trainer.launch.proc import leave_rank

BASE = "configs/tiny_cpu.yaml"
PER_RANK = 4


def main(out: str, strategy: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    cfg = load_config(
        BASE,
        {
            "actor_rollout_ref.actor.strategy": strategy,
            "actor_rollout_ref.rollout.name": "vllm",
            "actor_rollout_ref.rollout.dtype": "float32",
            # FSDP1's engine compiles (verl's default, enforce_eager=false): pushed weights must reach the compiled
            # graph; FSDP2's runs eager, the push into a plain module (and ~15 s shorter on 2 cores)
            "actor_rollout_ref.rollout.enforce_eager": strategy == "fsdp2",
            "actor_rollout_ref.rollout.do_sample": False,
            "actor_rollout_ref.rollout.max_num_seqs": 4,  # fewer slots than prompts: the scheduler queues
            "actor_rollout_ref.actor.optim.lr": 0.05,  # one step must change the greedy tokens
            "ppotune.vllm_cpu_memory_gb": 0.25,
            "data.train_batch_size": PER_RANK * world,
            "actor_rollout_ref.actor.ppo_mini_batch_size": PER_RANK * world,
            "trainer.n_gpus_per_node": world,
            "ppotune.device": "cpu",
        },
    )
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.path)
    notes: list[str] = []
    roles, _ = build_roles(cfg, tokenizer, device, world, notes)
    rows = load_rows(cfg.data, cfg.ppotune.synthetic)
    ds = PromptDataset.build(rows, tokenizer, max_prompt_length=cfg.data.max_prompt_length, truncation="error")
    mine = list(range(rank * PER_RANK, (rank + 1) * PER_RANK))
    prompt_ids, prompt_mask = left_pad(
        [ds.input_ids[i] for i in mine], cfg.data.max_prompt_length, tokenizer.pad_token_id
    )

    def both() -> dict:
        roles.update_weights(device)
        v_resp, v_mask = roles.generate(prompt_ids, prompt_mask, device)
        with resident(roles.actor, device):
            h_resp, h_mask = generate_responses(roles.actor.sharded, prompt_ids, prompt_mask, roles.settings.sampling)
        return {
            "vllm": v_resp.tolist(),
            "vllm_mask": v_mask.tolist(),
            "hf": h_resp.tolist(),
            "hf_mask": h_mask.tolist(),
        }

    before = both()
    saved = [(name, t.clone()) for name, t in iter_full_params(roles.actor.sharded, device)]
    meter = PhaseMeter(device)
    metrics = ppo_step(roles, prompt_ids, prompt_mask, ["0"] * PER_RANK, meter, device)
    after = both()
    roles.rollout.update_weights(iter(saved))  # the old weights, pushed back
    restored, _ = roles.generate(prompt_ids, prompt_mask, device)
    result = {
        "rank": rank,
        "before": before,
        "after": after,
        "restored": restored.tolist(),
        "timing": dict(meter.timing),
        "grad_norm": metrics.get("actor/grad_norm"),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ranks": gathered, "notes": notes}, f)
    dist.barrier()
    leave_rank()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
