"""Run by torchrun from engine/test_offload_matrix.py / engine/test_gpu.py: real PPO steps per config variant.

argv: OUT_JSON SPEC_JSON, SPEC = {"base": config path, "steps": N, "variants": {name: {dotted: value}}}.
Every variant builds actor, ref and critic with its knobs (on the meta device on ranks > 0), counts the
all-gathers of one generate call, runs N full PPO steps, and reports per phase the peak memory. A
variant that fails is recorded as data (``error``) and the next one runs on a fresh process group state.
"""

import gc
import itertools
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torchrun import ROOT, torchrun

from trainer.config import ConfigError, load_config
from trainer.contracts import PHASES
from trainer.engine.data import PromptDataset, left_pad, load_rows
from trainer.engine.metrics import PhaseMeter
from trainer.engine.models import load_tokenizer
from trainer.engine.roles import build_roles
from trainer.engine.step import ppo_step
from trainer.launch.proc import leave_rank
from trainer.rank.trial import rows_of_rank

BASE = ROOT / "configs" / "tiny_cpu.yaml"
OFFLOAD_FLAGS = ("param_offload", "optimizer_offload", "offload_policy")


def offload_matrix() -> dict[str, dict]:
    """verl's three offload flags (actor and critic alike) x FSDP1/FSDP2: {name: overrides}, 16 of them."""
    out = {}
    for strategy in ("fsdp", "fsdp2"):
        for values in itertools.product([False, True], repeat=3):
            over = {"actor_rollout_ref.actor.strategy": strategy}
            for section in ("actor_rollout_ref.actor.fsdp_config", "critic.fsdp"):
                over.update({f"{section}.{flag}": v for flag, v in zip(OFFLOAD_FLAGS, values)})
            out[f"{strategy}-" + ("-".join(f for f, v in zip(OFFLOAD_FLAGS, values) if v) or "none")] = over
    return out


def run_step_worker(
    out_dir: Path, variants: dict, *, nproc: int, steps: int = 2, relocate: bool = False, env: dict | None = None
) -> dict:
    """torchrun this worker over ``variants`` on the base config; -> {variant: result}. Prints each variant's line."""
    spec, out = out_dir / "spec.json", out_dir / "out.json"
    spec.write_text(json.dumps({"base": str(BASE), "steps": steps, "variants": variants, "relocate": relocate}))
    proc = torchrun(__file__, out, spec, nproc=nproc, env=env)
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("[variant]")))
    return json.loads(out.read_text())


def refusal(overrides: dict) -> str | None:
    """Config validation's one-line refusal of these overrides on the base config, or None."""
    try:
        load_config(BASE, overrides)
    except ConfigError as e:
        return str(e)
    return None


def gathers_per_generate(roles, prompt_ids, prompt_mask, device) -> tuple[int, list[str]]:
    """All-gather collectives one generate call issues (the profiler's record of every backend), and the
    names of the profiler's events that mention a collective backend or a gather (what was counted)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        roles.generate(prompt_ids, prompt_mask, device)
    # the backend's own record of each collective: "gloo:all_gather", "nccl:all_gather", ...
    names = [e.name for e in prof.events()]
    seen = sorted({n for n in names if any(w in n.lower() for w in ("gloo", "nccl", "gather"))})
    return sum(1 for n in names if n.startswith(("gloo:", "nccl:")) and "gather" in n), seen


def relocation_check(roles, log_probs) -> dict:
    """param_offload's plumbing, which a CPU->CPU move cannot exercise: move every parameter shard of the
    actor to a fresh copy (what a device move does) and check that no parameter still points at the old
    storage (a stale view would keep the GPU memory alive) and that the outputs are unchanged."""
    from trainer.engine.offload import _relocate_params

    before = log_probs()
    # detached views hold the old storages (a Parameter object would not: the move re-points its data), so no
    # new allocation can reuse one of their addresses meanwhile
    held = [t.detach() for t in _local_tensors(roles.actor.sharded.module)]
    old = {t.untyped_storage().data_ptr() for t in held}
    _relocate_params(roles.actor.sharded, lambda t: t.clone())
    new = {t.untyped_storage().data_ptr() for t in _local_tensors(roles.actor.sharded.module)}
    del held
    after = log_probs()
    return {"stale_storages": len(old & new), "max_abs_change": float((after - before).abs().max())}


def _local_tensors(module):
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        if t.numel():
            yield t


def run_variant(base: str, overrides: dict, steps: int, device: torch.device, relocate: bool = False) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = load_config(base, {**overrides, "trainer.n_gpus_per_node": world, "ppotune.device": device.type})
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.path)
    notes: list[str] = []
    roles, _ = build_roles(cfg, tokenizer, device, world, notes)
    rows = load_rows(cfg.data, cfg.ppotune.synthetic)
    ds = PromptDataset.build(rows, tokenizer, max_prompt_length=cfg.data.max_prompt_length, truncation="error")
    mine = rows_of_rank(cfg, cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n, world, rank)
    ids, mask = left_pad([ds.input_ids[i % len(ds)] for i in mine], cfg.data.max_prompt_length, tokenizer.pad_token_id)
    truths = [ds.ground_truths[i % len(ds)] for i in mine]
    ids, mask = ids.to(device), mask.to(device)
    gathers, events = gathers_per_generate(roles, ids, mask, device)
    result = {"gathers_per_generate": gathers, "collective_events": events, "notes": notes}
    if relocate:
        from trainer.engine.step import assemble_batch, compute_log_probs

        s = roles.settings
        resp = torch.full((ids.shape[0], s.sampling.max_response_length), 7, device=device)
        batch = assemble_batch(ids, mask, resp, torch.ones_like(resp))
        result["relocation"] = relocation_check(
            roles,
            lambda: compute_log_probs(
                roles.actor,
                batch,
                roles.plans.rollout_log_prob,
                prompt_width=cfg.data.max_prompt_length,
                temperature=s.sampling.temperature,
                device=device,
            ),
        )
    memory = {p: 0.0 for p in PHASES}
    for _ in range(steps):
        meter = PhaseMeter(device)
        metrics = ppo_step(roles, ids, mask, truths, meter, device)
        for p in PHASES:
            memory[p] = max(memory[p], meter.memory.get(p, 0.0))
    result["memory_gb"] = memory
    result["actor/pg_loss"] = metrics["actor/pg_loss"]
    result["critic/vf_loss"] = metrics["critic/vf_loss"]
    roles.free()  # as a trial of a warm job ends: the next variant starts without this one's memory
    return result


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage a live tensor holds (after a collection): the device-independent
    view of what a finished variant left behind."""
    gc.collect()
    seen: dict[tuple, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one of its own
                continue
            seen[(storage.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def main():
    out, spec = sys.argv[1], json.loads(open(sys.argv[2]).read())
    use_cuda = os.environ.get("PPOTUNE_TEST_DEVICE") == "cuda"
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    results = {}
    before = live_tensor_bytes()
    for name, overrides in spec["variants"].items():
        try:
            got = run_variant(spec["base"], overrides, spec["steps"], device, relocate=spec.get("relocate", False))
            results[name] = {"status": "ok", **got}
        except Exception as exc:  # noqa: BLE001 - a crash is the finding: record it, go on
            results[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
            traceback.print_exc()
        # what the variant left behind once its models are gone (a leak shows here, on any device)
        results[name]["leftover_tensor_mb"] = (live_tensor_bytes() - before) / 2**20
        if use_cuda:
            torch.cuda.empty_cache()
            results[name]["leftover_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
        if dist.get_rank() == 0:
            line = {k: v for k, v in results[name].items() if k != "notes"}
            print(f"[variant] {name}: {json.dumps(line)}", flush=True)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


if __name__ == "__main__":
    main()
