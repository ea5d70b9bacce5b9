"""How long one trial of a job takes on a GPU, reckoned from the job before anything runs, and the hang limits drawn
from it.

A step at the job's maximum lengths (every prompt and response full: an upper bound on a step's work) is

* the training engine's passes, compute-bound: ``T = sequences x (prompt + response)`` tokens through
  ``2·N`` FLOPs a token for each forward-only pass (the old log-probs; the reference's when a KL reads it; the
  critic's values) and ``6·N`` for each update (``8·N`` with gradient checkpointing: the forward again), times
  ``ppo_epochs``; over ``world x peak FLOP/s x MFU``;
* generation: a prefill (``2·N`` FLOPs a prompt token) and ``response_length`` decode steps per wave of up to
  ``max_num_seqs`` sequences an engine (one engine per ``tensor_model_parallel_size`` GPUs), each decode step the
  slower of reading the weights once (``2·N`` bytes over the engine's HBM bandwidth x the share decoding reaches)
  and its compute (``2·N`` FLOPs a sequence).

A trial's start-up is a fixed part (processes, imports, for verl Ray and its workers) + the checkpoints read
(``2·N`` bytes each: actor, reference, critic, at an assumed disk rate) + the rollout engine's start (vLLM: its
KV cache and, unless ``enforce_eager``, its CUDA graphs). The figures and why:
docs/decisions.md#trial-time-from-the-job. Pure: the command reads the model's shape and the config into a
:class:`Job`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from trainer.config import PPOConfig, need_critic, need_reference_policy, world_size
from trainer.device_specs import device_spec
from tuner.trials.launch import HANG_MARGIN, STARTUP_TIMEOUT_S, STEP_TIMEOUT_S

__all__ = [
    "Job",
    "job_of",
    "Gpu",
    "TrialTime",
    "HangLimits",
    "gpu_named",
    "trial_time",
    "hang_limits",
    "ASSUMED_MFU",
    "DECODE_BANDWIDTH_SHARE",
    "DISK_BYTES_PER_S",
    "DEFAULT_GPU",
]

#: the share of the device's peak the training engine's passes reach, and decoding's compute: an assumption, see
#: docs/decisions.md#trial-time-from-the-job
ASSUMED_MFU = 0.30
#: the share of the HBM bandwidth a decode step's weight read reaches (kernel launches, KV reads, sampling)
DECODE_BANDWIDTH_SHARE = 0.5
#: the rate a trial reads a checkpoint from disk (one read per model; the page cache serves the other ranks)
DISK_BYTES_PER_S = 1e9
#: bytes a parameter: the checkpoints, the rollout's weights and the compute are bf16
WEIGHT_BYTES = 2
#: a vLLM engine's start: its KV cache, and its CUDA graphs unless enforce_eager
VLLM_START_S = {"graphs": 60.0, "eager": 20.0}
#: the GPU a cuda estimate assumes when none is visible and none is named (``--assume-gpu``)
DEFAULT_GPU = "H100"
@dataclasses.dataclass(frozen=True)
class Gpu:
    """What the estimate reads of a device: its dense peak and its memory bandwidth."""

    name: str  # the table's key the device matched
    peak_flops: float  # dense, in the compute dtype
    hbm_bytes_per_s: float
    assumed: bool = False  # the device is not in the tables (or none is named): DEFAULT_GPU's figures
    asked: Optional[str] = None  # the name the figures were asked for


def gpu_named(name: Optional[str], *, dtype: str = "bfloat16") -> Gpu:
    """The figures of the device ``name`` (NVML's name, or e.g. ``H200``); DEFAULT_GPU's, marked assumed, for a name
    the data sheets (trainer.device_specs) do not hold or none."""
    spec = device_spec(name)
    assumed = spec is None
    spec = spec or device_spec(DEFAULT_GPU)
    return Gpu(spec.key, spec.flops(dtype), spec.hbm_bytes_per_s, assumed, name)


@dataclasses.dataclass(frozen=True)
class Job:
    """A trial's work, as the estimate reads it (global sizes at the trial's world)."""

    num_params: int  # the actor's (and the reference's) parameters
    prompt_length: int  # data.max_prompt_length
    response_length: int  # data.max_response_length
    sequences: int  # data.train_batch_size x rollout.n
    world: int  # the trial's GPUs
    critic_params: int = 0  # 0: no critic
    reference: bool = False  # a KL reads the reference's log-probs
    recompute: bool = False  # gradient checkpointing: each update runs the forward twice
    ppo_epochs: int = 1
    max_num_seqs: int = 256  # sequences an engine decodes at once
    tensor_parallel: int = 1  # GPUs per rollout engine
    vllm: bool = True  # a rollout engine of its own (vLLM, SGLang), whose start-up counts; not HF generate
    enforce_eager: bool = False

    @property
    def tokens(self) -> int:
        return self.sequences * (self.prompt_length + self.response_length)


def job_of(cfg: PPOConfig, *, actor_params: int, critic_params: Optional[int] = None) -> Job:
    """A trial config's :class:`Job` (``critic_params``: the critic's own count when its model differs from the
    actor's; a critic only where verl builds one)."""
    arr, rollout = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    critic = (critic_params or actor_params) if need_critic(cfg) else 0
    return Job(
        num_params=actor_params,
        prompt_length=cfg.data.max_prompt_length,
        response_length=cfg.data.max_response_length,
        sequences=cfg.data.train_batch_size * rollout.n,
        world=world_size(cfg),
        critic_params=critic,
        reference=need_reference_policy(cfg),
        recompute=arr.model.enable_gradient_checkpointing,
        ppo_epochs=arr.actor.ppo_epochs,
        max_num_seqs=rollout.max_num_seqs,
        tensor_parallel=rollout.tensor_model_parallel_size,
        vllm=rollout.name != "hf",  # on a GPU an unnamed rollout is vLLM (trainer.config.rollout_name); SGLang alike
        enforce_eager=rollout.enforce_eager,
    )


@dataclasses.dataclass(frozen=True)
class TrialTime:
    """One trial's estimated start-up (to its first step) and step, in seconds, and their parts."""

    startup_parts: dict  # fixed, weights, engine
    step_parts: dict  # gen, log_probs, update
    gpu: Gpu

    @property
    def startup_s(self) -> float:
        return sum(self.startup_parts.values())

    @property
    def step_s(self) -> float:
        return sum(self.step_parts.values())

    def basis(self, steps: int) -> str:
        """``~180 s start-up (...) + 4 steps x ~73 s (...)``."""
        s, p = self.startup_parts, self.step_parts
        return (
            f"~{self.startup_s:.0f} s start-up ({s['fixed']:.0f} fixed + {s['weights']:.0f} reading checkpoints + "
            f"{s['engine']:.0f} rollout engine) + {steps} steps x ~{self.step_s:.0f} s (generation {p['gen']:.0f}, "
            f"log-probs {p['log_probs']:.0f}, updates {p['update']:.0f}; at the maximum lengths)"
        )

    def assumptions(self) -> str:
        """The assumptions the figures rest on, said in one line."""
        g = self.gpu
        name = g.name
        if g.assumed:
            why = f"{g.asked} is not in the device tables" if g.asked else "no GPU visible; --assume-gpu names one"
            name = f"{g.name} ({why})"
        return (
            f"assumes {name}: {g.peak_flops / 1e12:.0f} TFLOP/s dense at {ASSUMED_MFU:.0%} MFU in the training passes "
            f"and decoding's compute, decoding at {DECODE_BANDWIDTH_SHARE:.0%} of {g.hbm_bytes_per_s / 1e12:.2f} TB/s "
            f"HBM, bf16 weights read from disk at {DISK_BYTES_PER_S / 1e9:g} GB/s, every prompt and response at its "
            "maximum length (docs/decisions.md#trial-time-from-the-job)"
        )


def _step_parts(job: Job, gpu: Gpu) -> dict:
    """A step's seconds: generation, the forward-only passes, the updates."""
    n, tokens = job.num_params, job.tokens
    engine_flops = job.world * gpu.peak_flops * ASSUMED_MFU
    update_per_token = (8 if job.recompute else 6) * job.ppo_epochs
    forward = 2 * n * tokens * (1 + int(job.reference)) + 2 * job.critic_params * tokens
    update = update_per_token * (n + job.critic_params) * tokens
    return {"gen": _generation_s(job, gpu), "log_probs": forward / engine_flops, "update": update / engine_flops}


def _generation_s(job: Job, gpu: Gpu) -> float:
    """Prefill, then ``response_length`` decode steps per wave of ``max_num_seqs`` sequences an engine."""
    tp = max(1, job.tensor_parallel)
    engines = max(1, job.world // tp)
    per_engine = math.ceil(job.sequences / engines)
    at_once = max(1, min(per_engine, job.max_num_seqs))
    waves = math.ceil(per_engine / at_once)
    flops = tp * gpu.peak_flops * ASSUMED_MFU
    read_s = WEIGHT_BYTES * job.num_params / (tp * gpu.hbm_bytes_per_s * DECODE_BANDWIDTH_SHARE)
    decode_step_s = max(read_s, 2 * job.num_params * at_once / flops)
    prefill_s = 2 * job.num_params * per_engine * job.prompt_length / flops
    return prefill_s + waves * job.response_length * decode_step_s


def trial_time(job: Job, gpu: Gpu, *, fixed_startup_s: float) -> TrialTime:
    """The estimate for ``job`` on ``gpu`` (``fixed_startup_s``: the engine's start-up before any model is read)."""
    models = job.num_params * (1 + int(job.reference)) + job.critic_params
    engine = VLLM_START_S["eager" if job.enforce_eager else "graphs"] if job.vllm else 0.0
    startup = {"fixed": fixed_startup_s, "weights": WEIGHT_BYTES * models / DISK_BYTES_PER_S, "engine": engine}
    return TrialTime(startup_parts=startup, step_parts=_step_parts(job, gpu), gpu=gpu)


@dataclasses.dataclass(frozen=True)
class HangLimits:
    """A search's hang limits (seconds), the estimate they were drawn from, and which a flag gave."""

    startup_s: float
    step_s: float
    estimated_startup_s: float
    estimated_step_s: float
    startup_given: bool = False  # --startup-timeout
    step_given: bool = False  # --step-timeout

    def line(self) -> str:
        def said(seconds: float, given: bool, flag: str) -> str:
            return f"{seconds:.0f} s (your {flag})" if given else f"{seconds:.0f} s"

        return (
            f"hang limits: no first step within {said(self.startup_s, self.startup_given, '--startup-timeout')}, "
            f"no next step within {said(self.step_s, self.step_given, '--step-timeout')} ({HANG_MARGIN:g}x a trial's "
            f"estimated ~{self.estimated_startup_s:.0f} s start-up + first step and ~{self.estimated_step_s:.0f} s "
            f"step, at least {STARTUP_TIMEOUT_S:g} s and {STEP_TIMEOUT_S:g} s; a flag wins)"
        )


def hang_limits(
    startup_s: float, step_s: float, *, startup_flag: Optional[float] = None, step_flag: Optional[float] = None
) -> HangLimits:
    """The hang limits of trials estimated at ``startup_s`` and ``step_s``: HANG_MARGIN times the estimate (the
    first step counts in the start-up's), never below the fixed defaults; a flag given wins."""
    return HangLimits(
        startup_s=startup_flag or max(STARTUP_TIMEOUT_S, HANG_MARGIN * (startup_s + step_s)),
        step_s=step_flag or max(STEP_TIMEOUT_S, HANG_MARGIN * step_s),
        estimated_startup_s=startup_s + step_s,
        estimated_step_s=step_s,
        startup_given=startup_flag is not None,
        step_given=step_flag is not None,
    )
