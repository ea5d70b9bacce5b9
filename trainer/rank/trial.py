"""One run on a started rank (torch, imported inside the functions): :func:`run_trial`, read top to bottom.

1. count the memory from the trial's start (less what a warm job's first trial left behind), under the cap;
2. load the data: the prompts and the loader that draws each step's global batch;
3. build the roles: actor, reference model and critic with the config's knobs (trainer.engine.roles);
4. per step: draw this rank's slice of the batch, run :func:`trainer.engine.step.ppo_step`, reduce the
   memory peaks and the step time across ranks, record the row, decide whether enough was measured;
5. save the optional HF checkpoint and give the models' memory back.

``state`` is the rank's status file (trainer/rank/process.py), filled as the trial goes: rank 0 rewrites it
after every step so a later failure keeps what was measured. A cold run (trainer/rank/run.py) runs one trial
in its process, a warm job (trainer/rank/serve.py) one after another. torch is imported inside the functions,
as in trainer/rank/process.py: a rank's entry imports this module before it has set its signal handling.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from trainer.contracts import PHASES
from trainer.launch.proc import write_json_atomic
from trainer.rank.process import MemoryLevel, RankProcess, apply_memory_limit, cap_device_memory, malloc_trim

__all__ = ["run_trial", "rows_of_rank", "follow_sleeping_engine", "MAX_LENGTHS_KEPT"]

#: sequences whose lengths a run keeps for its summary (the first steps' worth)
MAX_LENGTHS_KEPT = 100_000


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

    from trainer.engine.metrics import PhaseMeter
    from trainer.engine.models import load_tokenizer
    from trainer.engine.roles import build_roles
    from trainer.engine.rollout import with_rollout

    notes: list[str] = state["notes"]
    device, world = proc.device, proc.world

    # step 1. memory counts from here: what the trial's own steps add, under the cap
    start, counted_from = _count_memory_from_start(cfg, device, notes, first_use)
    _note_world_size(cfg, world, notes)
    state["environment"] = proc.environment
    meter = PhaseMeter(
        device,
        on_phase=lambda name: state.__setitem__("phase", name),
        # a vLLM engine allocates outside torch's caching allocator (its own pool for sleep mode)
        device_wide=with_rollout(cfg, device.type).actor_rollout_ref.rollout.name == "vllm",
    )

    # step 2. the prompts (a warm job's, while the data config is the same) and the loader
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.path)
    data = _load_data(cfg, tokenizer, data_cache)

    # step 3. actor, reference model and critic, sharded and equipped with the config's knobs
    roles, shape_info = build_roles(cfg, tokenizer, device, world, notes, weights=weights)
    state["model"] = shape_info.pop("model")  # what tuner.memory_model computes its analytic terms from
    if roles.rollout is not None:
        follow_sleeping_engine(roles.rollout, meter, cfg.ppotune.memory_limit_gb)
    # Sampling starts from the same state however the models came to be (loaded, or copied in a warm job;
    # FSDP1 or FSDP2): the responses, so the tokens each step processes, never depend on the build path.
    torch.manual_seed(cfg.trainer.seed + rank)

    # step 4. the steps, each recorded as it ends, until the last or until enough was measured
    steps = _Steps.start(cfg, roles, shape_info, meter, proc, rank, rss_start=counted_from.rss_gb, later=later)
    state["per_gpu"] = _per_gpu(cfg, world)
    if cfg.ppotune.worst_case:
        _note_worst_case(cfg, roles, len(steps.my_rows), notes)
    for step in range(1, cfg.trainer.total_training_steps + 1):
        if steps.run(step, data, tokenizer, state, rank_file):
            break

    # step 5. the checkpoint; the models' memory given back
    state["phase"] = "save"
    if cfg.trainer.default_local_dir:
        _save_checkpoint(cfg, roles, tokenizer, device, rank)
    steps.logger.finish()
    roles.free()  # a warm job's next trial must not find these models' memory still held
    dist.barrier()
    return start


# --------------------------------------------------------------------------- steps 1-3: before the first step
def _count_memory_from_start(
    cfg, device, notes: list[str], first_use: Optional[MemoryLevel]
) -> tuple[MemoryLevel, MemoryLevel]:
    """-> (the level the trial starts from, the level its memory counts from), the cap set above the latter.

    A warm job's later trial counts from its start less ``first_use`` (see :func:`run_trial`)."""
    malloc_trim()  # freed memory malloc still holds would be reused without showing as growth: give it back first
    start = MemoryLevel.now()
    counted_from = start if first_use is None else start - first_use
    if first_use is not None:
        notes.append(
            f"warm job: memory counted from this trial's start less the first trial's first-use memory "
            f"({first_use.rss_gb * 1024:.1f} MiB resident, {first_use.data_bytes / 2**20:.1f} MiB RLIMIT_DATA), "
            "which a cold run counts in its own figure"
        )
    apply_memory_limit(cfg.ppotune.memory_limit_gb, device, notes, base_bytes=counted_from.data_bytes)
    return start, counted_from


def follow_sleeping_engine(rollout, meter, limit_gb: Optional[float]) -> None:
    """A colocated vLLM engine's sleeps and wakes reach the memory figures and the cap.

    A sleeping engine's pool is unmapped from the device but still counted by torch's allocator (docs/vllm.md):
    the meter takes it off each phase's peak, and the cap (``--memory-limit-gb``) allows it on top of the limit,
    so both are about what the device holds. The engine was built asleep, before this hook existed."""
    meter.unmapped = rollout.unmapped

    def changed() -> None:
        meter.engine_changed()
        if limit_gb is not None and rollout.device.type == "cuda":
            cap_device_memory(limit_gb, rollout.device, unmapped_bytes=rollout.unmapped().reserved)

    rollout.on_change = changed
    changed()


def _note_world_size(cfg, world: int, notes: list[str]) -> None:
    from trainer.config import world_size

    if world != world_size(cfg):
        notes.append(
            f"trainer.n_gpus_per_node x nnodes = {world_size(cfg)} but {world} ranks were started; using {world}"
        )


@dataclass(frozen=True)
class _Data:
    """The tokenized prompts and the loader that draws each step's global batch (indices into them)."""

    dataset: Any  # trainer.engine.data.PromptDataset
    loader: Any  # trainer.engine.data.PromptLoader


def _load_data(cfg, tokenizer, data_cache: Optional[dict]) -> _Data:
    """The prompts, tokenized once per data config in a warm job (``data_cache``); the worst-case probe's
    every prompt ``max_prompt_length`` real tokens."""
    from trainer.engine.data import PromptDataset, PromptLoader, load_rows

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
    return _Data(dataset, PromptLoader(len(dataset), cfg.data.train_batch_size, seed=cfg.trainer.seed))


def _per_gpu(cfg, world: int) -> dict:
    """What each GPU runs per step: the same at the trial's world and the production's (tuner.rules.world)."""
    n = cfg.actor_rollout_ref.rollout.n
    return {
        "world_size": world,
        "sequences": cfg.data.train_batch_size * n // world,
        "actor_mini_batch_sequences": cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n // world,
    }


def _note_worst_case(cfg, roles, num_rows: int, notes: list[str]) -> None:
    from trainer.engine.roles import worst_case_notes

    notes.extend(
        worst_case_notes(
            roles,
            num_rows=num_rows,
            prompt_length=cfg.data.max_prompt_length,
            response_length=cfg.data.max_response_length,
        )
    )


def rows_of_rank(cfg, num_rows: int, world: int, rank: int) -> list[int]:
    """The rows of a global batch of ``num_rows`` sequences that ``rank`` holds: blocks that split the
    actor's and the critic's mini-batches evenly across ranks (so both updates are world-size invariant)."""
    from trainer.config import effective_config
    from trainer.engine.batching import mini_batch_group, rank_rows

    eff = effective_config(cfg)
    n = eff.actor_rollout_ref.rollout.n
    group = mini_batch_group(eff.actor_rollout_ref.actor.ppo_mini_batch_size * n, eff.critic.ppo_mini_batch_size * n)
    return rank_rows(num_rows, group, world, rank)


# --------------------------------------------------------------------------- step 4: the steps
@dataclass(frozen=True)
class _Peaks:
    """One step's memory peaks and time, each the max over ranks (one collective)."""

    per_phase: list[float]  # GB, in PHASES order: the device's peak, or on CPU the resident peak
    above_start: list[float]  # CPU: each phase's peak above its rank's start level (0 on CUDA)
    rss_start: float
    peak_above_start: float
    allocated: float
    reserved: float
    step_s: float  # the slowest rank's


@dataclass
class _Steps:
    """What every step of a trial shares (built once, after the roles), and the per-step recipe."""

    cfg: Any
    roles: Any  # trainer.engine.roles.Roles
    shape_info: dict
    meter: Any  # trainer.engine.metrics.PhaseMeter
    device: Any  # torch.device
    world: int
    rank: int
    rss_start: float  # CPU: the memory objective is the resident memory gained after this
    my_rows: list[int]  # this rank's rows of each global batch (rows_of_rank)
    logger: Any  # trainer.tracking.StepLogger
    peak_flops: Optional[float]
    warmup: int  # the first steps marked warm-up
    provisional: bool  # a later warm trial's first step, measured until it proves an outlier
    lengths: dict  # the prompt and response lengths the run saw (its summary's distribution)

    @classmethod
    def start(cls, cfg, roles, shape_info: dict, meter, proc: RankProcess, rank: int, *, rss_start, later) -> "_Steps":
        """The loop's shared parts; ``later``: a warm job's later trial (see :func:`run_trial`)."""
        from trainer.config import PRECISIONS, config_to_dict
        from trainer.engine.metrics import peak_flops
        from trainer.tracking import StepLogger

        device, world = proc.device, proc.world
        logger = StepLogger(cfg, rank=rank, config_dict=config_to_dict(cfg))
        # MFU against the peak of the actor's compute dtype (fp32 runs: TF32 off, torch's and verl's default)
        dtype = PRECISIONS[cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype]
        peak = peak_flops(proc.environment["device_name"], dtype) if device.type == "cuda" else None
        warmup = cfg.ppotune.warmup_steps
        # a later warm trial: its first step measured provisionally instead of a warm-up (see run_trial)
        provisional, warmup = (True, 0) if later and warmup > 0 else (False, warmup)
        my_rows = rows_of_rank(cfg, cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n, world, rank)
        return cls(
            cfg=cfg,
            roles=roles,
            shape_info=shape_info,
            meter=meter,
            device=device,
            world=world,
            rank=rank,
            rss_start=rss_start,
            my_rows=my_rows,
            logger=logger,
            peak_flops=peak,
            warmup=warmup,
            provisional=provisional,
            lengths={"prompt": [], "response": []},
        )

    def run(self, step: int, data: _Data, tokenizer, state: dict, rank_file: Path) -> bool:
        """One step, recorded in ``state``; -> whether the trial stops after it (every rank decides alike)."""
        # 4a. this rank's slice of the step's global batch
        prompt_ids, prompt_mask, truths = self.draw_batch(data, tokenizer)
        _inject_fault(self.cfg.ppotune.fault, self.rank, step)
        # 4b. the PPO step, timed on this rank
        profiling = step == self.cfg.ppotune.profile_step
        graphs = compiled_graphs()
        metrics, step_s = self.timed_ppo_step(step, prompt_ids, prompt_mask, truths, profiling=profiling)
        self.note_compiles(step, compiled_graphs() - graphs, state, measured=step > self.warmup and not profiling)
        # 4c. the memory peaks and the step time, the max over ranks; every rank's sequence lengths
        peaks = self.peaks_across_ranks(step_s)
        sum_sq = metrics.pop("_sum_seqlen_sq")
        self.gather_lengths(metrics.pop("_lengths"))
        # 4d. the step's row of the result
        row = self.row(step, peaks, metrics, sum_sq, warmup=step <= self.warmup or profiling)
        state["steps"].append(row)
        if self.provisional:
            self.settle_first_step(state)
        # 4e. enough measured? (the summary so far); rank 0 rewrites the status file
        stop = self.stop_reason(step, state)
        if self.rank == 0:
            write_json_atomic(rank_file, state)
        self.logger.log(row)
        return bool(stop)

    def note_compiles(self, step: int, graphs: int, state: dict, *, measured: bool) -> None:
        """A measured step that compiled (torch.compile met a new shape family) says so in the notes: its time
        holds the compile (a later warm trial's first step is settled by settle_first_step)."""
        if graphs and measured:
            state["notes"].append(f"torch.compile: {graphs} graph(s) compiled inside measured step {step}")

    def draw_batch(self, data: _Data, tokenizer):
        """-> (prompt ids, prompt mask, ground truths) of this rank's rows: every rank draws the same global
        batch, repeats each prompt ``rollout.n`` times, and takes its slice."""
        from trainer.engine.data import left_pad

        n = self.cfg.actor_rollout_ref.rollout.n
        global_idx = [i for i in data.loader.next() for _ in range(n)]
        mine = [global_idx[i] for i in self.my_rows]
        prompt_ids, prompt_mask = left_pad(
            [data.dataset.input_ids[i] for i in mine], self.cfg.data.max_prompt_length, tokenizer.pad_token_id
        )
        return prompt_ids, prompt_mask, [data.dataset.ground_truths[i] for i in mine]

    def timed_ppo_step(self, step: int, prompt_ids, prompt_mask, truths, *, profiling: bool) -> tuple[dict, float]:
        """:func:`trainer.engine.step.ppo_step`, timed on this rank (under the profiler at ``ppotune.profile_step``:
        its table printed by rank 0, the step marked warm-up)."""
        import torch

        from trainer.engine.metrics import profiled
        from trainer.engine.step import ppo_step

        device = self.device
        # each row's prompt in the global batch (its rollout.n responses are consecutive rows): verl's uid
        n = self.cfg.actor_rollout_ref.rollout.n
        uids = torch.tensor([row // n for row in self.my_rows], device=device)
        self.meter.reset()
        t0 = time.perf_counter()
        with profiled(profiling, device, meter=self.meter) as tables:
            metrics = ppo_step(
                self.roles, prompt_ids.to(device), prompt_mask.to(device), truths, self.meter, device, uids=uids
            )
        step_s = time.perf_counter() - t0
        if tables and self.rank == 0:
            print(f"profile of step {step} (rank 0, {device.type}; not measured):\n{tables[0]}", flush=True)
            print(f"profile of step {step} by phase (rank 0, {device.type}):\n{tables[1]}", flush=True)
        return metrics, step_s

    def peaks_across_ranks(self, step_s: float) -> _Peaks:
        """Max over ranks of each phase's peak, the start level, the step time (one collective)."""
        import torch
        import torch.distributed as dist

        meter, rss_start, use_cuda = self.meter, self.rss_start, self.device.type == "cuda"
        above_start = max(meter.memory.values(), default=0.0) - rss_start  # CPU: what this step added
        # CPU: each phase's peak above this rank's own start level (the objective's basis, taken per rank
        # before the max over ranks: the rank with the highest start is not always the one that grows most)
        above = [max(0.0, meter.memory[p] - rss_start) if p in meter.memory and not use_cuda else 0.0 for p in PHASES]
        mem = torch.tensor(
            [meter.memory.get(p, 0.0) for p in PHASES]
            + above
            + [rss_start, above_start, meter.allocated_peak, meter.reserved_peak, step_s],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        mem = mem.tolist()
        k = len(PHASES)
        return _Peaks(mem[:k], mem[k : 2 * k], *mem[2 * k :])

    def gather_lengths(self, mine: tuple[list, list]) -> None:
        """Every rank's prompt and response lengths of this step, while fewer than MAX_LENGTHS_KEPT are kept
        (every step's, warm-up included: the data the run saw)."""
        import torch.distributed as dist

        if len(self.lengths["prompt"]) < MAX_LENGTHS_KEPT:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, mine)
            for prompt_lens, response_lens in everyone:
                self.lengths["prompt"] += prompt_lens
                self.lengths["response"] += response_lens

    def row(self, step: int, peaks: _Peaks, metrics: dict, sum_sq: float, *, warmup: bool) -> dict:
        """The step's row of the result: timings, throughput, MFU, memory, then the step's metrics."""
        from trainer.engine.metrics import actor_mfu

        timing, world = self.meter.timing, self.world
        row = {"step": step, "warmup": warmup, "timing_s/step": peaks.step_s}  # the slowest rank sets the time
        row.update({f"timing_s/{p}": timing.get(p, 0.0) for p in PHASES})
        row["perf/throughput"] = metrics["perf/total_num_tokens"] / (peaks.step_s * world)
        row["perf/mfu/actor"] = actor_mfu(
            total_tokens=metrics["perf/total_num_tokens"],
            sum_seqlen_sq=sum_sq,
            **self.shape_info,
            epochs=self.cfg.actor_rollout_ref.actor.ppo_epochs,
            seconds=timing.get("update_actor", 0.0),
            world_size=world,
            peak=self.peak_flops,
        )
        row.update(self.phase_mfu(metrics["perf/total_num_tokens"], sum_sq))
        if warmup and self.meter.profile:  # the profiled step (never measured): its per-phase profile
            for phase, p in self.meter.profile.items():
                row.update({f"profile/{phase}/{k}": v for k, v in p.items() if k != "top_host"})
            self.meter.profile = {}
        row.update({f"memory/{p}_gb": v for p, v in zip(PHASES, peaks.per_phase)})
        if self.device.type == "cuda":
            row["perf/max_memory_allocated_gb"], row["perf/max_memory_reserved_gb"] = peaks.allocated, peaks.reserved
            row["perf/peak_rss_gb"] = None
        else:
            row.update({f"memory_above_start/{p}_gb": v for p, v in zip(PHASES, peaks.above_start) if v})
            row["perf/peak_rss_gb"] = max(peaks.per_phase)
            row["perf/rss_start_gb"], row["perf/peak_rss_above_start_gb"] = peaks.rss_start, peaks.peak_above_start
        row.update(metrics)
        return row

    def phase_mfu(self, total_tokens: float, sum_sq: float) -> dict:
        """``perf/mfu/<phase>`` of every phase that runs a model (where the device's peak is known)."""
        from trainer.engine.metrics import phase_flops

        if not self.peak_flops:
            return {}
        info = self.shape_info
        flops = phase_flops(
            num_params=info["num_params"],
            total_tokens=total_tokens,
            sum_seqlen_sq=sum_sq,
            head_dim=info["head_dim"],
            num_heads=info["num_heads"],
            num_layers=info["num_layers"],
            actor_epochs=self.cfg.actor_rollout_ref.actor.ppo_epochs,
            critic_epochs=self.cfg.critic.ppo_epochs,
        )
        timing = self.meter.timing
        return {
            f"perf/mfu/{p}": f / (timing[p] * self.world * self.peak_flops)
            for p, f in flops.items()
            if timing.get(p, 0.0) > 0
        }

    def settle_first_step(self, state: dict) -> None:
        """A later warm trial's first step: marked warm-up after all if it proves slower than the next ones."""
        from trainer.summary import first_step_outlier

        outlier = first_step_outlier([s["timing_s/step"] for s in state["steps"]])
        self.provisional = outlier is None  # settled once two more steps are known
        if outlier:
            state["steps"][0]["warmup"] = True
            state["notes"].append("warm job: the first step was slower than the next ones: counted as the warm-up")

    def stop_reason(self, step: int, state: dict) -> Optional[str]:
        """The summary so far, and why the trial stops after this step (None: it goes on). Every rank decides
        alike: the inputs (step time, tokens, peaks) were all-reduced."""
        from trainer.summary import measuring_done, summarize_steps

        cfg, total_steps = self.cfg, self.cfg.trainer.total_training_steps
        summary = state["summary"] = summarize_steps(state["steps"], device_type=self.device.type, lengths=self.lengths)
        stop = measuring_done(
            [s["perf/throughput"] for s in state["steps"] if not s["warmup"]],
            peak_memory_gb=summary["peak_memory_gb"],
            precision=cfg.ppotune.precision,
            min_steps=cfg.ppotune.min_measured_steps,
            front=cfg.ppotune.front,
        )
        if self.provisional:  # the first step is not settled yet
            stop = None
        if stop and step < total_steps:
            summary["stopped_early"] = f"{stop} (after step {step} of {total_steps})"
        return stop


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (0 when dynamo was never loaded)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _inject_fault(fault: str, rank: int, step: int) -> None:
    """``ppotune.fault``: a REAL failure for tests of the tuner (rank 1, first step)."""
    if fault == "none" or rank != 1 or step != 1:
        return
    if fault == "hang":
        while True:  # never reaches the next collective: the peers block in it
            time.sleep(3600)
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- step 5: save
def _save_checkpoint(cfg, roles, tokenizer, device, rank: int) -> None:
    """HF-format actor and critic (when there is one; ``save_pretrained``) under trainer.default_local_dir."""
    from trainer.engine.parallel import clean_state_dict, full_state_dict
    from trainer.engine.roles import resident

    out = Path(cfg.trainer.default_local_dir).expanduser()
    for name, trainee in (("actor", roles.actor), ("critic", roles.critic)):
        if trainee is None:
            continue
        with resident(trainee, device):  # with param_offload the shards are in host memory between phases
            sd = full_state_dict(trainee.sharded, device=device)
        if rank == 0:
            target = out / name
            target.mkdir(parents=True, exist_ok=True)
            inner = trainee.sharded.module
            inner = getattr(inner, "module", inner)  # FSDP1 wraps; FSDP2 is the model itself
            inner.save_pretrained(target, state_dict=clean_state_dict(sd))
            tokenizer.save_pretrained(target)
