"""Per-pass host cost, ppotune's actor against verl 0.9.1's, side by side on one CPU (issue 24).

Both engines get the same checkpoint (a Qwen2 of ``--layers`` tiny layers, written here) and the same batch
(``--batch`` sequences, left-padded prompts and right-padded responses of random lengths), and run the same
passes on their actor:

* ``log_prob``: the old-log-prob pass (forward only, entropy included): ours ``compute_old_log_probs``,
  verl's ``TrainingWorker.infer_batch`` (what ``ActorRolloutRefWorker.compute_log_prob`` runs);
* ``update_M``: one PPO mini-batch of the whole batch in M micro-batches (forward, loss, backward, optimizer
  step, the offload moves around them): ours ``update_actor``, verl's ``TrainingWorker.train_mini_batch``
  (what ``update_actor`` runs), for M = 1 and M = ``--micro``;
* ``micro_batch`` (derived): one training micro-batch's forward+backward, (update_M - update_1) / (M - 1): the
  mini-batch's fixed costs cancel, the sequences are the same;
* ``optimizer_step``: after an unmeasured forward+backward, the step with what an update's offload flags move
  around it: ours ``optimizer_step`` under ``resident``, verl's ``FSDPEngine.optimizer_step`` under its
  ``train_mode`` (which loads and offloads).

verl 0.9.1 ships no ``DataParallelPPOActor`` (``workers/actor/dp_actor.py`` went with its legacy workers): its
actor is ``TrainingWorker`` over ``FSDPEngineWithLMHead`` with ``ppo_loss``, built here from verl's own
``ppo_trainer`` config (Hydra) as ``ActorRolloutRefWorker.init_model`` builds it, without Ray, on the CPU shim
ppotune's verl engine uses (trainer/verl_engine/cpu). Both workers run in the verl venv by default, so both
run the same torch and the same transformers (the model's own ops are the same); ``--ours-python`` runs
ours elsewhere.

Counted per pass (benchmarks/step_counter.py): aten ops dispatched, syncs (host reads of device data,
data-dependent ops, copies of host data to the device that are not non-blocking from pinned memory: verl's worker
gets its batch from the driver in host memory), host copies and their bytes; wall time measured apart, without
the counters. On a CPU every copy and read is counted where it would be one on a GPU (offload moves are no-ops
here: their calls are counted, their bytes are what a GPU would move). What verl's driver does before it hands a
pass its batch (the clone, the conversion to no-padding nested tensors) runs before each measured run, outside it.

Two paths run on a CPU as stand-ins for what each engine runs on a GPU, so their ops say little about a GPU and are
counted apart (``step_counter.count_region``): attention (verl on the CPU shim: eager attention with a full mask;
ours: one sdpa call per sequence; on a GPU both run one fused call per layer: flash-attn varlen, or ours torch's
flex attention or varlen without flash-attn) and the log-probs (verl without flash-attn: ``logprobs_from_logits_v2``,
a per-row loop; on a GPU flash-attn's Triton cross-entropy). The goals are on the rest, the paths both engines
share: ops within 1.1x verl's; syncs and copied bytes at most verl's (on whole passes). Exit 1 when one is missed.
One process per engine, the passes interleaved (the order alternates every round), ``--rounds`` rounds, medians.

    python benchmarks/bench_step_overhead.py [--rounds 3] [--layers 24] [--batch 8] [--micro 4]
        [--strategies fsdp,fsdp2] [--offloads none,param_offload,optimizer_offload] [--padded] [--json FILE]

Run it alone on the machine (it measures wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

from side_by_side import WorkerProcess, answer, requests, write_record

REPO = Path(__file__).resolve().parent.parent
VERL_PY = REPO / ".venv-verl" / "bin" / "python"
PASSES = ("log_prob", "update_1", "update_M", "optimizer_step")
SHOWN = ("log_prob", "micro_batch", "update_M", "optimizer_step")
FIELDS = ("ops", "shared_ops", "attention_calls", "attention_ops", "syncs", "host_copies", "host_bytes", "wall_s")
#: the paths that run as CPU stand-ins (counted apart; the goals are on the rest)
STAND_INS = ("attention", "log_prob")
#: goals (issues 24 and 33): on the paths both share ours within 1.1x verl's ops; at most verl's syncs and bytes
OPS_GOAL, SYNC_GOAL, BYTES_GOAL = 1.1, 1.0, 1.0


# --------------------------------------------------------------------------- the shared inputs
def write_inputs(out: Path, *, layers: int, hidden: int, batch: int, prompt: int, response: int, seed: int) -> None:
    """The checkpoint (``out/model``) and the batch (``out/batch.pt``) both engines load."""
    import torch

    from trainer.config import TinyModelConfig
    from trainer.verl_engine.preset import build_byte_tokenizer, build_model

    tok = build_byte_tokenizer()
    tiny = TinyModelConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
    )
    model = build_model(tok, tiny=tiny, max_positions=prompt + response, seed=seed)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(prompt // 3, prompt + 1, (batch,), generator=g)
    rlen = torch.randint(response // 4, response + 1, (batch,), generator=g)
    pmask = (torch.arange(prompt)[None] >= prompt - plen[:, None]).long()
    rmask = (torch.arange(response)[None] < rlen[:, None]).long()
    pad = tok.pad_token_id
    prompts = torch.randint(0, 256, (batch, prompt), generator=g) * pmask + pad * (1 - pmask)
    responses = torch.randint(0, 256, (batch, response), generator=g) * rmask + pad * (1 - rmask)
    attn = torch.cat([pmask, rmask], 1)
    data = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn,
        "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
        "response_mask": rmask,
        "old_log_probs": -torch.rand(batch, response, generator=g) * 5 * rmask,
        "ref_log_probs": -torch.rand(batch, response, generator=g) * 5 * rmask,
        "advantages": torch.randn(batch, response, generator=g) * rmask,
    }
    torch.save(data, out / "batch.pt")


# --------------------------------------------------------------------------- workers (one per engine)
def _init_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(variant: str) -> dict:
    strategy, _, offload = variant.partition("/")
    return {"strategy": strategy, "offload": offload}


class OursActor:
    """ppotune's actor (trainer.engine) on the checkpoint, with one variant's knobs."""

    def __init__(self, work: Path, variant: str, *, micro: int, padded: bool, dtype: str) -> None:
        import torch

        from trainer.config import FSDP_SECTIONS, load_config
        from trainer.engine.models import load_tokenizer
        from trainer.engine.roles import MicroBatching, build_roles

        flags, batch = _flags(variant), torch.load(work / "batch.pt")
        self.batch, self.device = batch, torch.device("cpu")
        n, self.P = batch["input_ids"].shape[0], batch["prompts"].shape[1]
        actor = "actor_rollout_ref.actor"
        over = {
            **{f"{s}.mixed_precision.param_dtype": dtype for s in FSDP_SECTIONS},
            "actor_rollout_ref.model.path": str(work / "model"),
            "critic.model.path": str(work / "model"),
            "data.train_batch_size": n,
            "data.max_prompt_length": self.P,
            "data.max_response_length": batch["responses"].shape[1],
            "actor_rollout_ref.rollout.n": 1,
            f"{actor}.strategy": flags["strategy"],
            f"{actor}.ppo_mini_batch_size": n,
            f"{actor}.ppo_micro_batch_size_per_gpu": n // micro,
            f"{actor}.use_dynamic_bsz": False,
            f"{actor}.use_torch_compile": False,
            f"{actor}.use_kl_loss": True,
            f"{actor}.entropy_coeff": 0.0,
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": n // micro,
            "actor_rollout_ref.model.use_remove_padding": not padded,
            "critic.ppo_mini_batch_size": n,
            "trainer.n_gpus_per_node": 1,
        }
        if flags["offload"] not in ("", "none"):
            over[f"{actor}.fsdp_config.{flags['offload']}"] = True
        cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", over)
        tok = load_tokenizer(cfg.actor_rollout_ref.model.path)
        self.roles, _ = build_roles(cfg, tok, self.device, 1, [])
        self.plan = lambda m: MicroBatching(False, m, 0)
        self.micro, self.n = micro, n

    def run(self, name: str):
        from trainer.engine.passes import (
            actor_loss,
            compute_old_log_probs,
            forward_backward,
            optimizer_step,
            update_actor,
        )
        from trainer.engine.roles import resident

        actor, s, batch, dev = self.roles.actor, self.roles.settings, self.batch, self.device
        if name == "log_prob":
            return lambda: compute_old_log_probs(
                actor, batch, self.plan(self.n // self.micro), prompt_width=self.P, temperature=1.0, device=dev
            )
        if name.startswith("update_"):
            m = 1 if name == "update_1" else self.micro
            plan = self.plan(self.n // m)
            return lambda: update_actor(
                actor, batch, plan, s.actor_loss, mini_per_gpu=self.n, epochs=1, prompt_width=self.P,
                temperature=1.0, device=dev,
            )  # fmt: skip
        loss = actor_loss(actor, s.actor_loss, prompt_width=self.P, temperature=1.0)
        from trainer.engine.passes import _layouts  # the update's own index building, outside the measure

        (layouts,) = _layouts(actor, batch, [list(range(self.n))], self.plan(self.n), dev)

        def prepare():
            with resident(actor, dev, update=True):
                forward_backward(actor, batch, slice(0, self.n), layouts, loss, device=dev)

        def step():
            with resident(actor, dev, update=True):
                optimizer_step(actor, s.actor_loss.grad_clip, dev)

        return step, prepare


class VerlActor:
    """verl 0.9.1's actor: ``TrainingWorker`` over its FSDP engine with ``ppo_loss``, configured from verl's own
    ``ppo_trainer`` config as ``ActorRolloutRefWorker.init_model`` configures it (no Ray)."""

    def __init__(self, work: Path, variant: str, *, micro: int, padded: bool, dtype: str) -> None:
        from functools import partial

        import torch
        from tensordict import TensorDict
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import ActorConfig, HFModelConfig, TrainingWorkerConfig
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import ppo_loss

        flags, batch = _flags(variant), torch.load(work / "batch.pt")
        n = batch["input_ids"].shape[0]
        cfg = _verl_config(work, flags, n=n, micro=micro, padded=padded, dtype=dtype)
        model_config: HFModelConfig = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
        actor_config: ActorConfig = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        actor_config.model_config = model_config
        training = TrainingWorkerConfig(
            model_type="language_model",
            model_config=model_config,
            engine_config=actor_config.engine,
            optimizer_config=actor_config.optim,
            checkpoint_config=actor_config.checkpoint,
        )
        engine = training.engine_config
        engine.use_dynamic_bsz = False
        engine.infer_micro_batch_size_per_gpu = n // micro
        engine.micro_batch_size_per_gpu = n // micro
        engine.use_remove_padding = not padded
        self.worker = TrainingWorker(config=training)
        self.worker.reset()
        self.loss_fn = partial(ppo_loss, config=actor_config)
        self.worker.set_loss_fn(self.loss_fn)
        td = TensorDict({k: v for k, v in batch.items() if k != "ref_log_probs"}, batch_size=[n])
        td["ref_log_prob"] = batch["ref_log_probs"]
        self.td, self.n, self.micro = td, n, micro

    def _data(self, **meta):
        """The batch as verl's driver hands it to the worker (no-padding nested tensors; that conversion is
        the driver's work, outside the measure) with the pass's meta data."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        td = left_right_2_no_padding(self.td.clone())
        tu.assign_non_tensor(td, temperature=1.0, **meta)
        return td

    def _driven(self, call, **meta):
        """(the pass on a batch the driver made, the driver's making of it, what it hands over in host memory):
        measure() runs the second before each run of the first, unmeasured."""
        ready: list = []

        def prepare():
            ready[:] = [self._data(**meta)]

        def host():
            return [t for t in ready[0].values(include_nested=True, leaves_only=True) if hasattr(t, "is_pinned")]

        return (lambda: call(ready[0]), prepare, host)

    def run(self, name: str):
        if name == "log_prob":
            return self._driven(self.worker.infer_batch, calculate_entropy=True, compute_loss=False)
        meta = dict(
            calculate_entropy=False, global_batch_size=self.n, mini_batch_size=self.n, epochs=1, seed=1,
            dataloader_kwargs={"shuffle": False}, compute_loss=True,
        )  # fmt: skip
        if name.startswith("update_"):
            m = 1 if name == "update_1" else self.micro
            meta["micro_batch_size_per_gpu"] = self.n // m
            return self._driven(self.worker.train_mini_batch, **meta)
        engine = self.worker.engine
        one = self._data(**meta, micro_batch_size_per_gpu=self.n, use_remove_padding=engine.use_remove_padding)
        one = _with_worker_defaults(self.worker, one)

        def prepare():
            with engine.train_mode(zero_grad_on_exit=False):
                engine.forward_backward_batch(one, loss_function=self.loss_fn)

        def step():
            with engine.train_mode():
                engine.optimizer_step()

        return step, prepare


def _with_worker_defaults(worker, td):
    """The keys ``TrainingWorker.train_batch`` adds before it calls the engine."""
    from verl.utils import tensordict_utils as tu

    ec = worker.engine_config
    tu.assign_non_tensor(
        td,
        use_dynamic_bsz=ec.use_dynamic_bsz,
        max_token_len_per_gpu=ec.max_token_len_per_gpu,
        use_fused_kernels=False,
        global_token_num=[int(x) for x in td["input_ids"].offsets().diff().tolist()],
    )
    return td


def _verl_config(work: Path, flags: dict, *, n: int, micro: int, padded: bool, dtype: str):
    """verl's ``ppo_trainer`` config (Hydra, verl's defaults) for this actor."""
    import verl
    from hydra import compose, initialize_config_dir

    actor = "actor_rollout_ref.actor"
    over = [
        f"actor_rollout_ref.model.path={work / 'model'}",
        f"actor_rollout_ref.model.use_remove_padding={not padded}",
        # verl's default is on (model/hf_model.yaml); ours runs the base config's, off: the same work on both sides
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"{actor}.strategy={flags['strategy']}",
        f"{actor}.ppo_mini_batch_size={n}",
        f"{actor}.ppo_micro_batch_size_per_gpu={n // micro}",
        f"{actor}.use_dynamic_bsz=False",
        f"{actor}.use_torch_compile=False",
        f"{actor}.use_kl_loss=True",
        f"{actor}.entropy_coeff=0.0",
        f"++{actor}.fsdp_config.mixed_precision.param_dtype={dtype}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={n // micro}",
        f"data.train_batch_size={n}",
        "trainer.n_gpus_per_node=1",
    ]
    if flags["offload"] not in ("", "none"):
        over.append(f"{actor}.fsdp_config.{flags['offload']}=True")
    root = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=root, version_base=None):
        return compose(config_name="ppo_trainer", overrides=over)


def _allow_fsdp1_on_cpu() -> None:
    """Two GPU-only assumptions that stop verl's FSDP1 actor on a CPU, lifted here (nothing else of its path
    changes): torch refuses ``sync_module_states=True`` for CPU parameters (an NCCL broadcast could not send them;
    gloo can, and one process broadcasts nothing), and verl's ``load_fsdp_model_to_gpu`` names the device
    ``f"{name}:{index}"``, which the CPU shim's device (``torch.device("cpu")``, an index would name a CUDA
    device elsewhere) turns into ``"cpu:cpu"``: it runs with index 0 (``"cpu:0"``), the rest as verl wrote it."""
    from torch.distributed.fsdp import _init_utils
    from verl.utils import fsdp_utils
    from verl.workers.engine.fsdp import transformer_impl

    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    load = fsdp_utils.load_fsdp_model_to_gpu

    def load_fsdp_model_to_gpu(model):
        if fsdp_utils.fsdp_version(model) != 1:
            return load(model)
        device_id, fsdp_utils.get_device_id = fsdp_utils.get_device_id, lambda: 0
        try:
            return load(model)
        finally:
            fsdp_utils.get_device_id = device_id

    transformer_impl.load_fsdp_model_to_gpu = load_fsdp_model_to_gpu


def worker_main(side: str, work: Path, micro: int, padded: bool, dtype: str) -> None:
    """Build each variant's actor on first use; answer ``{"variant", "pass"}`` lines with measurements."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))
    if side == "verl":
        os.environ.update(VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cuda", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        import trainer.verl_engine.cpu  # noqa: F401  - verl's CPU platform, gloo, eager attention

        _allow_fsdp1_on_cpu()
    else:
        _init_process_group()
    import torch
    from step_counter import measure

    _count_stand_ins(side)
    torch.manual_seed(0)
    cls = VerlActor if side == "verl" else OursActor
    actors: dict = {}
    answer({"ready": side})
    for ask in requests():
        variant = ask["variant"]
        if variant not in actors:
            actors[variant] = cls(work, variant, micro=micro, padded=padded, dtype=dtype)
        run = actors[variant].run(ask["pass"])
        timed = ask.get("timed_runs", 3)
        if isinstance(run, tuple):  # (the measured step, its unmeasured set-up before each run[, host memory])
            got = measure(run[0], timed_runs=timed, setup=run[1], host=run[2] if len(run) > 2 else None)
        else:
            got = measure(run, timed_runs=timed)
        got["shared_ops"] = got["ops"] - sum(got["region_ops"].get(r, 0) for r in STAND_INS)
        got["attention_calls"] = got["region_calls"].get("attention", 0)
        got["attention_ops"] = got["region_ops"].get("attention", 0)
        answer(got)


def _count_stand_ins(side: str) -> None:
    """Count the ops of the CPU stand-ins apart (``step_counter.count_region``; the functions run unchanged)."""
    from step_counter import count_region

    if side == "verl":
        from transformers.models.qwen2 import modeling_qwen2
        from verl.workers.engine.fsdp import transformer_impl

        modeling_qwen2.eager_attention_forward = count_region(modeling_qwen2.eager_attention_forward, "attention")
        transformer_impl.logprobs_from_logits = count_region(transformer_impl.logprobs_from_logits, "log_prob")
        return
    from transformers import AttentionInterface

    from trainer.engine import attention, passes

    AttentionInterface.register(
        attention.PACKED_ATTENTION, count_region(attention.packed_attention_forward, "attention")
    )
    passes.token_log_probs = count_region(passes.token_log_probs, "log_prob")


class Worker(WorkerProcess):
    """One engine's worker process, asked one pass at a time."""

    def __init__(self, side: str, python: str, work: Path, args) -> None:
        cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--work", str(work)]
        cmd += ["--micro", str(args.micro), "--dtype", args.dtype] + (["--padded"] if args.padded else [])
        super().__init__(side, cmd, {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)})


def variants(args) -> list[str]:
    out = []
    for strategy in args.strategies.split(","):
        for offload in args.offloads.split(","):
            if offload == "offload_policy" and strategy != "fsdp2":
                continue  # FSDP2 only (refused with FSDP1 by ppotune, a no-op in verl)
            out.append(f"{strategy}/{offload}")
    return out


def run_rounds(workers: dict, args) -> dict:
    """{variant: {pass: {side: [measurement per round]}}}, the sides' order alternating every round."""
    got: dict = {}
    for r in range(args.rounds):
        order = list(workers) if r % 2 == 0 else list(workers)[::-1]
        for variant in variants(args):
            for name in PASSES:
                for side in order:
                    m = workers[side].ask({"variant": variant, "pass": name, "timed_runs": args.timed_runs})
                    got.setdefault(variant, {}).setdefault(name, {}).setdefault(side, []).append(m)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return got


def summarize(got: dict, micro: int) -> dict:
    """Medians over the rounds; the derived ``micro_batch`` row = (update_M - update_1) / (M - 1)."""
    out: dict = {}
    for variant, passes in got.items():
        rows: dict = {}
        for name, sides in passes.items():
            rows[name] = {side: {f: statistics.median(m[f] for m in ms) for f in FIELDS} for side, ms in sides.items()}
            rows[name]["calls"] = {
                side: {"sync": ms[0]["sync_calls"], "copy": ms[0]["copy_calls"]} for side, ms in sides.items()
            }
        rows["micro_batch"] = {
            side: {f: (rows["update_M"][side][f] - rows["update_1"][side][f]) / (micro - 1) for f in FIELDS}
            for side in rows["update_M"]
            if side != "calls"
        }
        out[variant] = rows
    return out


def table(summary: dict) -> tuple[str, list[str]]:
    """The side-by-side table (ours / verl per pass) and the goals it misses (none without verl's side)."""
    head = f"{'variant':<26}{'pass':<16}{'shared ops ours/verl':>22}{'x':>6}{'all ops ours/verl':>19}"
    head += f"{'attn calls/ops ours':>21}{'verl':>12}{'syncs ours/verl':>17}{'copies ours/verl':>18}"
    head += f"{'MB ours/verl':>16}{'ms ours/verl':>16}  verl's CPU stand-ins"
    lines, missed = [head], []
    nan = {f: float("nan") for f in FIELDS}
    for variant, rows in summary.items():
        for name in SHOWN:
            o, v = rows[name]["ours"], rows[name].get("verl", nan)
            ratio = o["shared_ops"] / v["shared_ops"] if v["shared_ops"] else float("nan")
            stand_ins = "attention, log-prob" if v["attention_calls"] else "-"
            lines.append(
                f"{variant:<26}{name:<16}{o['shared_ops']:>11.0f}/{v['shared_ops']:<10.0f}{ratio:>6.2f}"
                f"{o['ops']:>10.0f}/{v['ops']:<8.0f}{o['attention_calls']:>9.0f}/{o['attention_ops']:<11.0f}"
                f"{v['attention_calls']:>5.0f}/{v['attention_ops']:<6.0f}"
                f"{o['syncs']:>8.1f}/{v['syncs']:<8.1f}{o['host_copies']:>9.1f}/{v['host_copies']:<8.1f}"
                f"{o['host_bytes'] / 2**20:>8.2f}/{v['host_bytes'] / 2**20:<7.2f}"
                f"{1e3 * o['wall_s']:>8.1f}/{1e3 * v['wall_s']:<7.1f}  {stand_ins}"
            )
            if ratio > OPS_GOAL:
                missed.append(f"{variant} {name}: shared ops {ratio:.2f}x verl's (goal <= {OPS_GOAL})")
            if o["syncs"] > SYNC_GOAL * v["syncs"]:
                missed.append(f"{variant} {name}: {o['syncs']:.1f} syncs, verl {v['syncs']:.1f}")
            # whole passes only: the derived micro_batch row's bytes are a difference of two passes' (verl's < 0)
            if name != "micro_batch" and o["host_bytes"] > BYTES_GOAL * v["host_bytes"] + 1024:
                missed.append(
                    f"{variant} {name}: copies {o['host_bytes'] / 2**20:.2f} MB, verl {v['host_bytes'] / 2**20:.2f}"
                )
    return "\n".join(lines), missed


def main(argv=None) -> int:  # long: the flags, the inputs, the workers, the table and the record, in order
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=("ours", "verl"), help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timed-runs", type=int, default=3, help="plain timed runs per pass and round")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches of update_M (divides --batch)")
    ap.add_argument("--strategies", default="fsdp,fsdp2")
    # offload_policy (FSDP2's CPUOffloadPolicy) is GPU-only: verl pins its host shards (refused on a CPU), ours
    # turns it off on a CPU (a note says so)
    ap.add_argument("--offloads", default="none,param_offload,optimizer_offload")
    ap.add_argument("--padded", action="store_true", help="use_remove_padding=False on both")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per worker")
    ap.add_argument("--ours-python", default=str(VERL_PY), help="ours runs here (default: the verl venv's)")
    ap.add_argument("--verl-python", default=str(VERL_PY))
    ap.add_argument("--sides", default="ours,verl", help="ours: ppotune's actor alone (no verl venv needed)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--table", type=Path, help="print the table and the goals of a recorded run (its --json), no run")
    args = ap.parse_args(argv)
    if args.table:
        text, missed = table(json.loads(args.table.read_text())["summary"])
        print(text, "\ngoals:", "all met" if not missed else "; ".join(missed))
        return 1 if missed else 0
    if args.worker:
        worker_main(args.worker, args.work, args.micro, args.padded, args.dtype)
        return 0
    if args.batch % args.micro:
        ap.error("--micro must divide --batch")
    with tempfile.TemporaryDirectory(prefix="ppotune-overhead-") as tmp:
        work = Path(tmp)
        sys.path.insert(0, str(REPO))
        write_inputs(work, layers=args.layers, hidden=args.hidden, batch=args.batch, prompt=args.prompt,
                     response=args.response, seed=0)  # fmt: skip
        pythons = {"ours": args.ours_python, "verl": args.verl_python}
        workers = {side: Worker(side, pythons[side], work, args) for side in args.sides.split(",")}
        try:
            got = run_rounds(workers, args)
        finally:
            for w in workers.values():
                w.close()
    summary = summarize(got, args.micro)
    text, missed = table(summary)
    shape = f"{args.layers} layers x {args.hidden} wide, {args.batch} sequences of <= {args.prompt}+{args.response}"
    print(f"per-pass host cost, medians of {args.rounds} rounds ({shape}, {args.dtype}, "
          f"{'padded' if args.padded else 'packed'}, micro-batches 1 and {args.micro}):")  # fmt: skip
    print(text)
    print(
        "attention: calls per pass and the ops they dispatch on this CPU; on a GPU each call is one fused kernel in "
        "both engines (verl: flash-attn varlen; ours: flash-attn or torch's varlen, else flex attention)"
    )
    print(
        f"goals on the paths both share (ops <= {OPS_GOAL}x verl's, syncs and copied bytes <= verl's):",
        "all met" if not missed else "; ".join(missed),
    )
    if args.json:
        write_record(args.json, summary=summary, missed=missed)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
