"""One rank of a PPO run (started by ``ppotune train``: trainer/launch/ranks.py).

:func:`start_rank` (device, process group) -> :func:`run_trial` (memory cap, data, models, steps --
the first ``ppotune.warmup_steps`` marked warm-up -- optional HF checkpoint) -> cleanup. A warm job
(trainer/rank/serve.py) runs the same two functions: :func:`start_rank` once, :func:`run_trial` per trial.
Each rank writes ``<rank-dir>/rank<r>.json``: its status (ok | oom | error), and on rank 0 the
per-step metrics, rewritten after every step so a later failure keeps what was measured.
An OOM anywhere is caught, recorded, and the rank exits at once (code 3): its peers, blocked in
a collective, are then ended by the launcher, which reads the files.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Optional

from trainer.contracts import PHASES, ExitCode
from trainer.launch.proc import die_with_parent, leave_rank, write_json_atomic

__all__ = [
    "main",
    "is_oom_error",
    "start_rank",
    "run_trial",
    "RankProcess",
    "MemoryLevel",
    "malloc_trim",
    "model_loads",
    "fail",
    "new_state",
    "on_sigterm_write",
]

_OOM_MARKERS = (
    "out of memory",
    "can't allocate memory",
    "cannot allocate memory",
    "std::bad_alloc",
    # vLLM at start-up, colocated: what training already holds leaves less than gpu_memory_utilization of
    # the device free (more utilization, more memory: the same direction as every other OOM). Its other
    # start-up refusal, a KV cache too small for one sequence, is the opposite direction: an error.
    "is less than desired gpu memory utilization",
)


def is_oom_error(exc: BaseException) -> bool:
    """CUDA OutOfMemoryError, the CPU allocator's failure under an rlimit, Python's MemoryError, or a
    colocated vLLM engine that cannot get its ``gpu_memory_utilization`` share of the device."""
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__
    text = str(exc).lower()
    return name == "OutOfMemoryError" or any(m in text for m in _OOM_MARKERS)


def _apply_memory_limit(limit_gb: float | None, device, notes: list[str], *, base_bytes: int) -> None:
    """A real cap: on GPU the allocator's per-process fraction; on CPU RLIMIT_DATA, ``limit_gb`` of
    private writable memory above ``base_bytes`` (what the rank holds once torch and the process group are up).

    RLIMIT_DATA, not RLIMIT_AS: address-space reservations (malloc arenas, thread stacks) make an
    AS cap fire at a different point on every run; a data cap fails where the memory is used.
    """
    if limit_gb is None:
        return
    import torch

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gb * 1024**3 / total), device)
        return
    base = base_bytes  # in use: a run first reuses what malloc holds free, then grows VmData up to the cap
    cap = int(base + limit_gb * 1024**3)
    # the soft limit (what the kernel enforces): a warm job lifts it again after the trial (serve.py)
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    resource.setrlimit(resource.RLIMIT_DATA, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    notes.append(
        f"ppotune.memory_limit_gb: CPU cap is RLIMIT_DATA = {base / 1024**3:.2f} GiB in use at the start "
        f"+ {limit_gb} GiB"
    )


def _environment(device, world: int) -> dict:
    import torch
    import transformers

    name, total = platform.processor() or "cpu", None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total = props.name, props.total_memory / 1024**3
    return {
        "device": device.type,
        "device_name": name,
        "device_memory_total_gb": total,
        "world_size": world,
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }


def new_state() -> dict:
    """A rank's status file, before anything ran: an error until the run says otherwise."""
    return {"status": "error", "error": None, "phase": "setup", "steps": [], "notes": [], "environment": None}


def on_sigterm_write(current: dict) -> None:
    """On SIGTERM write ``current["state"]`` to ``current["rank_file"]`` and exit. The launcher SIGTERMs the peers
    of a failed rank: say so, so the launcher can tell the rank that died first (no status file) from the
    ones that were stopped. ``current`` is read when the signal comes (a warm job points it at each trial)."""

    def handler(signum, _frame):
        state = current["state"]
        state["error"] = f"stopped by signal {signum} (the launcher ends the other ranks when one fails)"
        try:
            write_json_atomic(current["rank_file"], state)
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def fail(exc: BaseException, rank: int, rank_file: Path, state: dict) -> NoReturn:
    """Record a failure in the rank's status file and leave at once (3 for an OOM, 1 else)."""
    oom = is_oom_error(exc)
    state["status"] = "oom" if oom else "error"
    state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]
    state["traceback"] = traceback.format_exc()[-4000:]
    try:
        write_json_atomic(rank_file, state)
    except OSError:
        pass
    print(f"[rank {rank}] {state['status']} in phase {state['phase']}: {state['error']}", file=sys.stderr, flush=True)
    # Peers may be blocked in a collective: leave now, the launcher ends them.
    os._exit(ExitCode.OOM if oom else ExitCode.ERROR)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trainer.rank.run")
    ap.add_argument("config")
    ap.add_argument("--rank-dir", required=True)
    args = ap.parse_args(argv)
    die_with_parent(signal.SIGKILL)  # the launcher died (even by SIGKILL): no orphan rank keeps a GPU
    rank = int(os.environ.get("RANK", "0"))
    rank_file = Path(args.rank_dir) / f"rank{rank}.json"
    state = new_state()
    on_sigterm_write({"state": state, "rank_file": rank_file})
    try:
        import torch.distributed as dist

        from trainer.config import load_config

        cfg = load_config(args.config, validate=False)  # `ppotune train` validated it and wrote this file
        run_trial(cfg, start_rank(cfg), rank, rank_file, state)
        dist.destroy_process_group()
        state["status"] = "ok"
        write_json_atomic(rank_file, state)
        leave_rank()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes data for the launcher
        fail(exc, rank, rank_file, state)


def malloc_trim() -> None:
    """Hand the free memory glibc's malloc still holds back to the OS (``malloc_trim(0)``); no-op elsewhere."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _malloc_free_bytes() -> int:
    """Bytes glibc's malloc holds free in its arenas (``mallinfo2().fordblks``); 0 where unknown (not glibc)."""
    import ctypes

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]  # fmt: skip

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    fn.restype = _Mallinfo2
    return int(fn().fordblks)


@dataclass(frozen=True)
class MemoryLevel:
    """A rank's host memory at one moment: resident (GiB), and private writable bytes in use: VmData (what
    RLIMIT_DATA counts) less what malloc holds free (memory the process reuses before it asks the OS for more,
    so a cap counted from VmData alone would let a run use it on top of the limit)."""

    rss_gb: float
    data_bytes: int

    @classmethod
    def now(cls) -> "MemoryLevel":
        from trainer.engine.metrics import rss_now_gb, vm_data_bytes

        return cls(rss_now_gb() or 0.0, (vm_data_bytes() or 0) - _malloc_free_bytes())

    def __sub__(self, other: "MemoryLevel") -> "MemoryLevel":
        return MemoryLevel(self.rss_gb - other.rss_gb, self.data_bytes - other.data_bytes)


@dataclass(frozen=True)
class RankProcess:
    """What a rank sets up once, before any trial: its device and the process group."""

    device: Any  # torch.device
    world: int
    environment: dict  # the result's ``environment``


def start_rank(cfg) -> RankProcess:
    """The device and the process group (``ppotune.device``, ``ppotune.dist_timeout_s``) of this rank."""
    import torch
    import torch.distributed as dist

    want = cfg.ppotune.device
    use_cuda = torch.cuda.is_available() if want == "auto" else want == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("ppotune.device=cuda but no CUDA device is visible")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        timeout=datetime.timedelta(seconds=cfg.ppotune.dist_timeout_s),
        **({"device_id": device} if use_cuda else {}),
    )
    # The cap counts from after this: the runtime's own threads (intra-op pool, gloo) are up, so their
    # stacks do not eat the budget differently on a machine with more cores.
    torch.ones(1 << 16).sum()
    world = dist.get_world_size()
    return RankProcess(device=device, world=world, environment=_environment(device, world))


def run_trial(
    cfg,
    proc: RankProcess,
    rank: int,
    rank_file: Path,
    state: dict,
    *,
    weights=None,
    data_cache: Optional[dict] = None,
    first_use: Optional[MemoryLevel] = None,
    later: bool = False,
) -> MemoryLevel:
    """One run on a started rank: memory cap, data, models built with the config's knobs, the steps, the
    optional checkpoint; ``state`` (the rank's status file) filled as it goes. Everything it builds is
    garbage once it returns; -> the memory level it started from (after its imports).

    The CPU memory objective and the CPU cap count from that level. A warm job (trainer/rank/serve.py) passes
    ``weights`` (its copy of the loaded weights), ``data_cache`` (the prompts it tokenized, reused while the
    data config is the same: the first trial built them inside its own figures, so they are in ``first_use``)
    and, after its first trial, ``first_use``: what that trial
    left behind in a process that gave back all it built (kernels, caches, lazily built state: memory a cold
    run allocates in its own figure); a later trial then counts from its start less that, as a cold run would.
    ``later``: a later trial of a warm job: the process, its allocator and its libraries are warm, so it runs
    no warm-up step; its first step is measured unless it turns out slower than ``FIRST_STEP_OUTLIER`` x the
    median of the next two or more (trainer.summary.first_step_outlier), when it is marked warm-up after all.
    """
    import torch
    import torch.distributed as dist

    from trainer.config import config_to_dict, world_size
    from trainer.engine.data import PromptDataset, PromptLoader, left_pad, load_rows
    from trainer.engine.metrics import PhaseMeter, actor_mfu, peak_flops, profiled
    from trainer.engine.models import load_tokenizer
    from trainer.engine.step import ppo_step
    from trainer.summary import first_step_outlier, stop_reason, summarize_steps
    from trainer.tracking import StepLogger

    notes: list[str] = state["notes"]
    device, world = proc.device, proc.world
    use_cuda = device.type == "cuda"
    malloc_trim()  # freed memory malloc still holds would be reused without showing as growth: give it back first
    start = MemoryLevel.now()
    counted_from = start if first_use is None else start - first_use
    if first_use is not None:
        notes.append(
            f"warm job: memory counted from this trial's start less the first trial's first-use memory "
            f"({first_use.rss_gb * 1024:.1f} MiB resident, {first_use.data_bytes / 2**20:.1f} MiB RLIMIT_DATA), "
            "which a cold run counts in its own figure"
        )
    _apply_memory_limit(cfg.ppotune.memory_limit_gb, device, notes, base_bytes=counted_from.data_bytes)
    rss_start = counted_from.rss_gb  # CPU: the memory objective is the resident memory gained after this
    if world != world_size(cfg):
        notes.append(
            f"trainer.n_gpus_per_node x nnodes = {world_size(cfg)} but {world} ranks were started; using {world}"
        )
    state["environment"] = proc.environment
    meter = PhaseMeter(
        device,
        on_phase=lambda name: state.__setitem__("phase", name),
        # a vLLM engine allocates outside torch's caching allocator (its own pool for sleep mode)
        device_wide=cfg.actor_rollout_ref.rollout.name == "vllm",
    )

    # ---- data
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.path)
    data_key = repr((cfg.data, cfg.ppotune.synthetic, cfg.actor_rollout_ref.model.path))
    if data_cache is not None and data_key in data_cache:  # a later trial of a warm job on the same data
        rows, dataset = data_cache[data_key]
    else:
        rows = load_rows(cfg.data, cfg.ppotune.synthetic)
        dataset = PromptDataset.build(
            rows,
            tokenizer,
            max_prompt_length=cfg.data.max_prompt_length,
            truncation=cfg.data.truncation,
            prompt_key=cfg.data.prompt_key,
            source=cfg.data.train_files or "synthetic",
        )
        if data_cache is not None:
            data_cache.clear()
            data_cache[data_key] = (rows, dataset)
    if cfg.ppotune.worst_case:  # the worst-case probe: every prompt max_prompt_length real tokens
        dataset = dataset.at_length(cfg.data.max_prompt_length)
    loader = PromptLoader(len(dataset), cfg.data.train_batch_size, seed=cfg.trainer.seed)

    roles, shape_info = build_roles(cfg, tokenizer, device, world, notes, weights=weights)
    state["model"] = shape_info.pop("model")  # what tuner.memory_model computes its analytic terms from
    # Sampling starts from the same state however the models came to be (loaded, or copied in a warm job;
    # FSDP1 or FSDP2): the responses, so the tokens each step processes, never depend on the build path.
    torch.manual_seed(cfg.trainer.seed + rank)
    a, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    logger = StepLogger(cfg, rank=rank, config_dict=config_to_dict(cfg))
    peak = peak_flops(state["environment"]["device_name"]) if use_cuda else None
    total_steps, warmup = cfg.trainer.total_training_steps, cfg.ppotune.warmup_steps
    # a later warm trial: its first step measured provisionally instead of a warm-up (see the docstring)
    provisional, warmup = (True, 0) if later and warmup > 0 else (False, warmup)
    my_rows = rows_of_rank(cfg, cfg.data.train_batch_size * n, world, rank)
    # what each GPU runs per step: the same at the trial's world and the production's (tuner.world)
    state["per_gpu"] = {
        "world_size": world,
        "sequences": cfg.data.train_batch_size * n // world,
        "actor_mini_batch_sequences": a.ppo_mini_batch_size * n // world,
    }
    if cfg.ppotune.worst_case:
        from trainer.engine.step import worst_case_notes

        notes.extend(
            worst_case_notes(
                roles,
                num_rows=len(my_rows),
                prompt_length=cfg.data.max_prompt_length,
                response_length=cfg.data.max_response_length,
            )
        )
    lengths: dict[str, list] = {"prompt": [], "response": []}
    for step in range(1, total_steps + 1):
        # every rank draws the same global batch, repeats each prompt n times, and takes its slice
        global_idx = [i for i in loader.next() for _ in range(n)]
        mine = [global_idx[i] for i in my_rows]
        prompt_ids, prompt_mask = left_pad(
            [dataset.input_ids[i] for i in mine], cfg.data.max_prompt_length, tokenizer.pad_token_id
        )
        truths = [dataset.ground_truths[i] for i in mine]
        _inject_fault(cfg.ppotune.fault, rank, step)
        meter.reset()
        t0 = time.perf_counter()
        profiling = step == cfg.ppotune.profile_step
        with profiled(profiling, device) as table:
            metrics = ppo_step(roles, prompt_ids.to(device), prompt_mask.to(device), truths, meter, device)
        step_s = time.perf_counter() - t0
        if table and rank == 0:
            print(f"profile of step {step} (rank 0, {device.type}; not measured):\n{table[0]}", flush=True)
        # memory: max over ranks of each phase's peak (one collective)
        above_start = max(meter.memory.values(), default=0.0) - rss_start  # CPU: what this step added
        # CPU: each phase's peak above this rank's own start level (the objective's basis, taken per rank
        # before the max over ranks: the rank with the highest start is not always the one that grows most)
        above = [max(0.0, meter.memory[p] - rss_start) if p in meter.memory and not use_cuda else 0.0 for p in PHASES]
        mem = torch.tensor(
            [meter.memory.get(p, 0.0) for p in PHASES]
            + above
            + [rss_start, above_start, meter.allocated_peak, meter.reserved_peak, step_s],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        mem = mem.tolist()
        step_s = mem[-1]  # the slowest rank sets the step time
        sum_sq = metrics.pop("_sum_seqlen_sq")
        mine_lengths = metrics.pop("_lengths")
        if len(lengths["prompt"]) < MAX_LENGTHS_KEPT:  # every step's, warm-up included: the data the run saw
            everyone = [None] * world
            dist.all_gather_object(everyone, mine_lengths)
            for prompt_lens, response_lens in everyone:
                lengths["prompt"] += prompt_lens
                lengths["response"] += response_lens
        row = {"step": step, "warmup": step <= warmup or profiling, "timing_s/step": step_s}
        row.update({f"timing_s/{p}": meter.timing.get(p, 0.0) for p in PHASES})
        row["perf/throughput"] = metrics["perf/total_num_tokens"] / (step_s * world)
        row["perf/mfu/actor"] = actor_mfu(
            total_tokens=metrics["perf/total_num_tokens"],
            sum_seqlen_sq=sum_sq,
            **shape_info,
            epochs=a.ppo_epochs,
            seconds=meter.timing.get("update_actor", 0.0),
            world_size=world,
            peak=peak,
        )
        row.update({f"memory/{p}_gb": v for p, v in zip(PHASES, mem)})
        if not use_cuda:
            row.update({f"memory_above_start/{p}_gb": v for p, v in zip(PHASES, mem[len(PHASES) :]) if v})
        if use_cuda:
            row["perf/max_memory_allocated_gb"], row["perf/max_memory_reserved_gb"] = mem[-3], mem[-2]
            row["perf/peak_rss_gb"] = None
        else:
            row["perf/peak_rss_gb"] = max(mem[: len(PHASES)])
            row["perf/rss_start_gb"], row["perf/peak_rss_above_start_gb"] = mem[-5], mem[-4]
        row.update(metrics)
        state["steps"].append(row)
        if provisional:
            outlier = first_step_outlier([s["timing_s/step"] for s in state["steps"]])
            provisional = outlier is None  # settled once two more steps are known
            if outlier:
                state["steps"][0]["warmup"] = True
                notes.append("warm job: the first step was slower than the next ones: counted as the warm-up")
        summary = state["summary"] = summarize_steps(state["steps"], device_type=device.type, lengths=lengths)
        # every rank decides alike: the inputs (step time, tokens, peaks) were all-reduced above
        stop = stop_reason(
            [s["perf/throughput"] for s in state["steps"] if not s["warmup"]],
            peak_memory_gb=summary["peak_memory_gb"],
            precision=cfg.ppotune.precision,
            min_steps=cfg.ppotune.min_measured_steps,
            front=cfg.ppotune.front,
        )
        if provisional:  # the first step is not settled yet
            stop = None
        if stop and step < total_steps:
            summary["stopped_early"] = f"{stop} (after step {step} of {total_steps})"
        if rank == 0:
            write_json_atomic(rank_file, state)
        logger.log(row)
        if stop:
            break

    state["phase"] = "save"
    if cfg.trainer.default_local_dir:
        _save_checkpoint(cfg, roles, tokenizer, device, rank)
    logger.finish()
    roles.free()  # a warm job's next trial must not find these models' memory still held
    dist.barrier()
    return start


def rows_of_rank(cfg, num_rows: int, world: int, rank: int) -> list[int]:
    """The rows of a global batch of ``num_rows`` sequences that ``rank`` holds: blocks that split the
    actor's and the critic's mini-batches evenly across ranks (so both updates are world-size invariant)."""
    from trainer.config import effective_config
    from trainer.engine.batching import mini_batch_group, rank_rows

    eff = effective_config(cfg)
    n = eff.actor_rollout_ref.rollout.n
    group = mini_batch_group(eff.actor_rollout_ref.actor.ppo_mini_batch_size * n, eff.critic.ppo_mini_batch_size * n)
    return rank_rows(num_rows, group, world, rank)


#: sequences whose lengths a run keeps for its summary (the first steps' worth)
MAX_LENGTHS_KEPT = 100_000
#: The HF config fields a result records under ``model`` (with ``head_dim`` and ``num_params``).
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)

#: rollout keys only a vLLM engine reads (said in the notes when set on an HF-generate run)
VLLM_ONLY_KEYS = (
    "dtype",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "enforce_eager",
    "free_cache_engine",
    "enable_sleep_mode",
    "seed",
)


def model_loads(cfg, rank: int) -> dict:
    """role -> (loader, path, keyword arguments): how :func:`build_roles` loads each model on ``rank``.

    Rank 0 loads the weights; the others build the architecture on the meta device and get their shards
    from rank 0 (verl: rank-0 load + sync_module_states). The reference model starts as the actor."""
    from trainer.config import effective_config
    from trainer.engine.models import load_actor, load_critic

    cfg = effective_config(cfg)
    max_pos = cfg.data.max_prompt_length + cfg.data.max_response_length
    kw = dict(tiny=cfg.ppotune.tiny, max_positions=max_pos, seed=cfg.trainer.seed, meta=rank != 0)
    actor = (load_actor, cfg.actor_rollout_ref.model.path, kw)
    return {"actor": actor, "ref": actor, "critic": (load_critic, cfg.critic.model.path, kw)}


def packed_attention_notes(cfg, device_type: str, *, has_flash: Optional[bool] = None) -> list[str]:
    """What a GPU run of packed rows (``use_remove_padding``) says when its attention is not verl's: verl runs
    flash-attn varlen, one kernel per packed row; without flash-attn, or computing in fp32 (flash-attn is
    half precision only), each sequence gets its own sdpa call. The memory is the same; on a GPU the many
    small calls make the step slower than verl's, so the figure understates this config. On CPU neither
    engine has a varlen kernel (verl runs padded there): nothing to say. ``cfg``: an effective config."""
    import torch

    from trainer.engine.attention import FLASH_VARLEN, packed_kernel
    from trainer.engine.parallel import torch_dtype

    if device_type != "cuda":
        return []
    kw = {} if has_flash is None else {"has_flash": has_flash}
    out = []
    arr = cfg.actor_rollout_ref
    roles = [
        ("actor_rollout_ref.model.use_remove_padding", arr.model.use_remove_padding, arr.actor.fsdp_config),
        ("critic.model.use_remove_padding", cfg.critic.model.use_remove_padding, cfg.critic.fsdp),
    ]
    for key, packed, fc in roles:
        dtype = torch_dtype(fc.mixed_precision.param_dtype)
        if packed and packed_kernel(device_type, dtype, **kw) != FLASH_VARLEN:
            why = "fp32 compute (flash-attn is half precision only)" if dtype == torch.float32 else "no flash-attn"
            out.append(
                f"{key}: packed attention ran one sdpa call per sequence ({why}), where verl runs one flash-attn "
                "varlen call per row: the same memory, a slower step on a GPU (install flash-attn, compute in bf16)"
            )
    return out


def build_roles(cfg, tokenizer, device, world: int, notes: list[str], *, weights=None):
    """Load, shard and equip actor, ref and critic with this config's knobs; -> (Roles, model shape info).

    ``weights``: where a warm job keeps a copy of the loaded weights (``load(loader, path, tokenizer, **kw)``
    returns a fresh model, as the loader would, without reading the checkpoint again)."""
    import torch
    import torch.distributed as dist

    from trainer.config import PRECISIONS, effective_config
    from trainer.engine import core
    from trainer.engine.models import num_params
    from trainer.engine.parallel import ShardKnobs, shard_model, torch_dtype
    from trainer.engine.rollout import Sampling
    from trainer.engine.step import ActorLoss, MicroBatching, Plans, Roles, StepSettings, Trainee, make_entropy_fn

    cfg = effective_config(cfg)  # null follow-keys filled in: every value below is what the run uses
    c, ref_cfg = cfg.critic, cfg.actor_rollout_ref.ref
    a, mdl, ro = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    max_pos = cfg.data.max_prompt_length + cfg.data.max_response_length
    # Rank 0 loads the weights; the others build the architecture on the meta device and get their
    # shards from rank 0 (verl: rank-0 load + sync_module_states). One model at a time, each sharded
    # before the next is built: host memory holds one full model, on one rank.
    loads = model_loads(cfg, dist.get_rank())

    def knobs(fc, strategy, gc, *, compute_offload):
        mp = fc.mixed_precision
        return ShardKnobs(
            strategy=strategy,
            compute_offload=compute_offload,
            reshard_after_forward=fc.reshard_after_forward,
            forward_prefetch=fc.forward_prefetch,
            fsdp_size=fc.fsdp_size,
            param_dtype=PRECISIONS[mp.param_dtype],
            reduce_dtype=PRECISIONS[mp.reduce_dtype],
            buffer_dtype=PRECISIONS[mp.buffer_dtype],
            gradient_checkpointing=gc,
            wrap_min_num_params=fc.wrap_policy.min_num_params,
        )

    def build(role, fc, name, shard_knobs, *, frozen=False):
        """-> (the model's HF config, its parameter count, the sharded model)."""
        load, path, kw = loads[role]
        model = load(path, tokenizer, **kw) if weights is None else weights.load(load, path, tokenizer, **kw)
        model = model.to(torch_dtype(fc.model_dtype))  # master weights (model_dtype)
        model.requires_grad_(not frozen)
        count = num_params(model)  # before sharding: afterwards a rank sees only its shards
        return model.config, count, shard_model(model, shard_knobs, device=device, name=name, notes=notes)

    on_cpu = device.type == "cpu"
    for key, value in (
        ("actor_rollout_ref.model.enable_activation_offload", mdl.enable_activation_offload),
        ("critic.model.enable_activation_offload", cfg.critic.model.enable_activation_offload),
        ("actor_rollout_ref.actor.fsdp_config.param_offload", a.fsdp_config.param_offload),
        ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", a.fsdp_config.optimizer_offload),
        ("critic.fsdp.param_offload", c.fsdp.param_offload),
        ("critic.fsdp.optimizer_offload", c.fsdp.optimizer_offload),
        ("actor_rollout_ref.actor.fsdp_config.offload_policy", a.fsdp_config.offload_policy),
        ("critic.fsdp.offload_policy", c.fsdp.offload_policy),
    ):
        if value and on_cpu:
            notes.append(f"{key}: no effect on CPU (the tensors already live in host memory)")
    from trainer.config import FSDPConfig

    inert = {  # keys of a shared section that cannot act in this role: said, never silently ignored
        "actor_rollout_ref.ref.fsdp_config.use_no_sync_for_gradient_accumulation": "the reference model is not trained",
        "critic.fsdp.pad_to_length_bucket": "only the actor's and reference model's packed rows are padded "
        "(actor_rollout_ref.actor.pad_to_length)",
    }
    for key, why in inert.items():
        section, leaf = key.rsplit(".", 1)
        fc = ref_cfg.fsdp_config if section.startswith("actor_rollout_ref.ref") else c.fsdp
        if getattr(fc, leaf) != getattr(FSDPConfig(), leaf):
            notes.append(f"{key}: no effect; {why}")
    fp32 = [
        name
        for name, fc in (("actor", a.fsdp_config), ("ref", ref_cfg.fsdp_config), ("critic", c.fsdp))
        if PRECISIONS[fc.mixed_precision.param_dtype] == "float32"
    ]
    if fp32:
        notes.append(
            f"mixed_precision.param_dtype: {'/'.join(fp32)} compute in fp32, not verl's default bf16: "
            "these figures are fp32's"
        )
    notes.extend(packed_attention_notes(cfg, device.type))
    if a.pad_to_length and not mdl.use_remove_padding:
        notes.append("actor_rollout_ref.actor.pad_to_length: no effect without use_remove_padding (nothing is packed)")
    for key in ("param_offload", "optimizer_offload", "offload_policy"):
        if getattr(ref_cfg.fsdp_config, key):
            notes.append(
                f"actor_rollout_ref.ref.fsdp_config.{key}: no effect; the reference model's parameters always "
                "live in host memory between uses (verl's forward-only engine), and it has no optimizer"
            )
    if ro.name != "vllm":
        from trainer.config import RolloutConfig

        defaults = RolloutConfig()
        for key in VLLM_ONLY_KEYS:
            if getattr(ro, key) != getattr(defaults, key):  # only the ones somebody set
                notes.append(f"actor_rollout_ref.rollout.{key}: no effect with rollout.name=hf (vLLM-only knob)")

    shape, n_params, actor = build(
        "actor",
        a.fsdp_config,
        "actor_rollout_ref.actor.fsdp_config",
        knobs(
            a.fsdp_config, a.strategy, mdl.enable_gradient_checkpointing, compute_offload=a.fsdp_config.offload_policy
        ),
    )
    head_dim = getattr(shape, "head_dim", None) or shape.hidden_size // shape.num_attention_heads
    _, _, ref = build(
        "ref",
        ref_cfg.fsdp_config,
        "actor_rollout_ref.ref.fsdp_config",
        knobs(ref_cfg.fsdp_config, a.strategy, False, compute_offload=True),
        frozen=True,
    )
    _, _, critic = build(
        "critic",
        c.fsdp,
        "critic.fsdp",
        knobs(c.fsdp, c.strategy, c.model.enable_gradient_checkpointing, compute_offload=c.fsdp.offload_policy),
    )
    if not on_cpu:
        from trainer.engine.parallel import move_params

        # param_offload: the shards wait in host memory from the start, as verl offloads them at init
        # (a colocated vLLM engine, built next, then sees the device without them)
        for sharded, offload in ((actor, a.fsdp_config.param_offload), (critic, c.fsdp.param_offload)):
            if offload:
                move_params(sharded, torch.device("cpu"))
    rollout = None
    if ro.name == "vllm":
        from trainer.engine.vllm_rollout import DTYPE_BYTES, VLLMRollout, engine_plan

        plan = engine_plan(
            ro,
            device_type=device.type,
            max_model_len=ro.max_model_len or max_pos,
            weight_bytes=n_params * DTYPE_BYTES[ro.dtype],
            cpu_memory_gb=cfg.ppotune.vllm_cpu_memory_gb,
            rank=dist.get_rank(),
        )
        notes.extend(plan.notes)
        rollout = VLLMRollout.build(shape, plan)
    actor_opt = torch.optim.AdamW(
        actor.module.parameters(), lr=a.optim.lr, betas=tuple(a.optim.betas), weight_decay=a.optim.weight_decay
    )
    critic_opt = torch.optim.AdamW(
        critic.module.parameters(),
        lr=cfg.critic.optim.lr,
        betas=tuple(cfg.critic.optim.betas),
        weight_decay=cfg.critic.optim.weight_decay,
    )

    n = ro.n
    kl = cfg.algorithm.kl_ctrl
    kl_ctrl = (
        core.AdaptiveKLController(init_kl_coef=kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon)
        if kl.type == "adaptive"
        else core.FixedKLController(kl_coef=kl.kl_coef)
    )
    plans = Plans(
        actor=MicroBatching(a.use_dynamic_bsz, a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu),
        critic=MicroBatching(c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu),
        critic_forward=MicroBatching(
            c.use_dynamic_bsz, c.forward_micro_batch_size_per_gpu, c.forward_max_token_len_per_gpu
        ),
        ref=MicroBatching(
            ref_cfg.log_prob_use_dynamic_bsz,
            ref_cfg.log_prob_micro_batch_size_per_gpu,
            ref_cfg.log_prob_max_token_len_per_gpu,
        ),
        rollout_log_prob=MicroBatching(
            ro.log_prob_use_dynamic_bsz, ro.log_prob_micro_batch_size_per_gpu, ro.log_prob_max_token_len_per_gpu
        ),
    )
    settings = StepSettings(
        sampling=Sampling(
            max_response_length=cfg.data.max_response_length,
            temperature=ro.temperature,
            top_p=ro.top_p,
            top_k=ro.top_k,
            do_sample=ro.do_sample,
            ignore_eos=ro.ignore_eos or cfg.ppotune.worst_case,  # the worst-case probe: full-length responses
            pad_id=tokenizer.pad_token_id,
            eos_id=tokenizer.eos_token_id,
            vocab_limit=len(tokenizer),
        ),
        ppo_mini_batch_size_per_gpu=a.ppo_mini_batch_size * n // world,
        critic_mini_batch_size_per_gpu=c.ppo_mini_batch_size * n // world,
        ppo_epochs=a.ppo_epochs,
        critic_epochs=c.ppo_epochs,
        gamma=cfg.algorithm.gamma,
        lam=cfg.algorithm.lam,
        use_kl_in_reward=cfg.algorithm.use_kl_in_reward,
        kl_penalty=cfg.algorithm.kl_penalty,
        cliprange_value=cfg.critic.cliprange_value,
        critic_grad_clip=cfg.critic.grad_clip,
        actor_loss=ActorLoss(
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c,
            entropy_coeff=a.entropy_coeff,
            calculate_entropy=a.calculate_entropy,
            use_kl_loss=a.use_kl_loss,
            kl_loss_coef=a.kl_loss_coef,
            kl_loss_type=a.kl_loss_type,
            grad_clip=a.grad_clip,
        ),
        train_batch_size=cfg.data.train_batch_size,
        rollout_n=n,
    )
    roles = Roles(
        actor=Trainee(
            actor,
            actor_opt,
            param_offload=a.fsdp_config.param_offload,
            optimizer_offload=a.fsdp_config.optimizer_offload,
            activation_offload=mdl.enable_activation_offload,
            rmpad=mdl.use_remove_padding,
            no_sync=a.fsdp_config.use_no_sync_for_gradient_accumulation,
            pad_to_multiple=a.fsdp_config.pad_to_length_bucket if a.pad_to_length else None,
            entropy_fn=make_entropy_fn(
                chunk_size=a.entropy_from_logits_chunk_size if a.entropy_from_logits_with_chunking else None,
                checkpointing=a.entropy_checkpointing,
                compile=a.use_torch_compile,
            ),
        ),
        ref=Trainee(
            ref,
            rmpad=mdl.use_remove_padding,
            pad_to_multiple=ref_cfg.fsdp_config.pad_to_length_bucket if a.pad_to_length else None,
        ),
        critic=Trainee(
            critic,
            critic_opt,
            param_offload=c.fsdp.param_offload,
            optimizer_offload=c.fsdp.optimizer_offload,
            activation_offload=c.model.enable_activation_offload,
            rmpad=c.model.use_remove_padding,
            no_sync=c.fsdp.use_no_sync_for_gradient_accumulation,
        ),
        tokenizer=tokenizer,
        kl_ctrl=kl_ctrl,
        plans=plans,
        settings=settings,
        rollout=rollout,
    )

    shape_info = {
        "model": {**{k: getattr(shape, k, None) for k in SHAPE_KEYS}, "head_dim": head_dim, "num_params": n_params},
        "num_params": n_params,
        "head_dim": head_dim,
        "num_heads": shape.num_attention_heads,
        "num_layers": shape.num_hidden_layers,
    }
    return roles, shape_info


def _inject_fault(fault: str, rank: int, step: int) -> None:
    """``ppotune.fault``: a REAL failure for tests of the tuner (rank 1, first step)."""
    if fault == "none" or rank != 1 or step != 1:
        return
    if fault == "hang":
        while True:  # never reaches the next collective: the peers block in it
            time.sleep(3600)
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGKILL)


def _save_checkpoint(cfg, roles, tokenizer, device, rank: int) -> None:
    """HF-format actor and critic (``save_pretrained``) under trainer.default_local_dir."""
    from trainer.engine.parallel import clean_state_dict, full_state_dict
    from trainer.engine.step import resident

    out = Path(cfg.trainer.default_local_dir).expanduser()
    for name, trainee in (("actor", roles.actor), ("critic", roles.critic)):
        with resident(trainee, device):  # with param_offload the shards are in host memory between phases
            sd = full_state_dict(trainee.sharded, device=device)
        if rank == 0:
            target = out / name
            target.mkdir(parents=True, exist_ok=True)
            inner = trainee.sharded.module
            inner = getattr(inner, "module", inner)  # FSDP1 wraps; FSDP2 is the model itself
            inner.save_pretrained(target, state_dict=clean_state_dict(sd))
            tokenizer.save_pretrained(target)


if __name__ == "__main__":
    sys.exit(main())
