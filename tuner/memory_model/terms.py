"""The analytic memory terms of each PPO phase on one GPU, in bytes, from a config and the model's shape.

Per phase (``trainer.contracts.PHASES``) the terms are (0 where a term does not apply):

``states``
    Model states resident on the device during the phase. A trained role (actor, critic) holds its
    master parameters (``fsdp_config.model_dtype``: 4 B fp32), during its update their gradients (same
    dtype) and Adam's two moments (2 x the master bytes): 16 B/param with fp32 masters; the reference
    model its parameters. Everything is sharded by FSDP over the shard group (the world size, or
    ``fsdp_size``): / N. ``param_offload`` keeps a role's parameters in host memory except during the
    phases that use them, ``optimizer_offload`` its moments except during its update, FSDP2's
    ``offload_policy`` all three always; the reference model's parameters always live in host memory
    (verl's forward-only engine, compute-time offload). On a CPU run there is no separate device: every
    tensor is in the memory that is measured and offload moves nothing (the trainer notes "no effect on
    CPU"), so every state counts in every phase (gradients only during their update: they are freed after
    the optimizer step).
``buffers``
    Unsharded FSDP units while the phase runs a model: the root unit (embedding, final norm, LM or value
    head: usually the largest) plus one decoder block in the compute dtype
    (``mixed_precision.param_dtype``), two with ``forward_prefetch``, all of them with
    ``reshard_after_forward: false``; during an update also the unsharded gradients of those units before
    their reduce-scatter (the whole model's with ``use_no_sync_for_gradient_accumulation``). HF generate
    gathers the whole actor once (FSDP1 ``summon_full_params``: the fp32 masters; FSDP2 unshard: the
    compute dtype). FSDP1 with a shard group of one rank does not shard (NO_SHARD): nothing is gathered
    beyond a mixed-precision copy.
``activations``
    Per token of the phase's largest micro-batch (:mod:`tuner.memory_model.workload`). An update keeps
    every layer's activations for backward: per token per layer ``cb·(6h + 4·kv + 4·i) + 4·2h`` bytes
    (q/k/v/o inputs and outputs with rotary copies, the gated MLP's gate/up/act/product, the two RMSNorms'
    fp32 inputs; Korthikanti et al. 2022, arXiv:2205.05198, count ~34·h for a GPT block in 16-bit with
    fused attention, whose MLP is 4h wide where this one is i), plus the final norm and head inputs.
    Gradient checkpointing (full recompute) keeps only each layer's input (``h·cb``, the paper's 2·h)
    plus one layer's activations recomputed during backward; activation offload (GPU) keeps one layer's.
    Backward adds one layer's worth of activation gradients (allocated and freed layer by layer).
    Forward-only phases (old_log_prob, ref, values, gen's prefill) keep nothing for backward: the
    transient of one layer, ``cb·(3h + 3i) + 4h`` per token.
``attention``
    The padded path's attention mask (``use_remove_padding: false``): transformers hands sdpa a
    ``rows x 1 x width x width`` boolean mask, which the kernel turns into an additive mask in the compute
    dtype and keeps for backward, in every layer (one layer with checkpointing), + one being built (measured
    on torch 2.13's CPU flash kernel; neither it nor the GPU kernels keep a ``heads x L x L`` score matrix).
    The packed path runs one causal sdpa per sequence, without a mask: 0. gen's prefill (left-padded
    prompts, masked) holds one layer's at a time.
``logits``
    What verl's GPU path holds too (trainer/engine/logits.py; benchmarks/bench_pass_memory.py measures both): the LM
    head's output for every token of the micro-batch in the compute dtype (``T x V x cb``), a second one divided by
    the temperature when it is not 1, and one chunk's fp32 work on the rows read (``c x V x (cb + 8)``, ``c`` the
    chunk's rows: ``trainer.engine.logits.chunk_rows``, or ``entropy_from_logits_chunk_size``); the log-prob's
    gradient is written into the logits, so an update adds nothing more unless the entropy is in its loss (then the
    log-prob's and the entropy's gradients, ``2 x T x V x cb``). The critic's head is one wide: no logits term.
    gen: sampling's fp32 scores over the vocabulary for each sequence.
``kv_cache``
    HF generate's KV cache: sequences x (max_prompt_length + longest response) x layers x 2 x kv_dim x cb.
``engine``
    A colocated vLLM engine (``rollout.name=vllm``): on a GPU ``gpu_memory_utilization`` x the device's
    memory during gen (asleep otherwise, with ``free_cache_engine`` and sleep mode); on a CPU
    ``max(utilization x ppotune.vllm_cpu_memory_gb, weights)`` in every phase (no sleep mode on CPU).

The calibration (:mod:`tuner.memory_model.fit`) weighs each term and adds a constant per phase; the
``carry`` feature it also uses (memory an allocator keeps from an earlier phase: the step's largest
transient) is built there from these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from trainer.config import PPOConfig, config_to_dict, flatten, resolve_follows, rollout_name
from trainer.config.keys import absent_role
from trainer.contracts import PHASES
from tuner.memory_model.shape import ModelShape, ParamCounts, param_counts
from tuner.memory_model.workload import Lengths, MicroBatch, Plan, largest_micro_batch

__all__ = ["TERMS", "TRANSIENT_TERMS", "flat_config", "world_of", "phase_terms", "PhaseTerms"]

#: The analytic terms, in the order they are reported.
TERMS = ("states", "buffers", "activations", "attention", "logits", "kv_cache", "engine")
#: The terms a phase allocates and frees (everything but the resident states).
TRANSIENT_TERMS = ("buffers", "activations", "attention", "logits", "kv_cache", "engine")

_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}
_A, _REF, _RO, _C = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic"
_DEFAULTS: Optional[dict] = None

#: {phase: {term: bytes}}
PhaseTerms = dict


def flat_config(config: Mapping[str, Any]) -> dict:
    """A nested or flat (dotted keys) config -> the complete flat config a run uses: defaults filled in,
    null follow-keys resolved (``trainer.config.resolve_follows``)."""
    global _DEFAULTS
    if _DEFAULTS is None:
        _DEFAULTS = flatten(config_to_dict(PPOConfig()))
    flat = flatten(dict(config)) if any(isinstance(v, dict) and v for v in config.values()) else dict(config)
    return resolve_follows({**_DEFAULTS, **flat})


def world_of(flat: Mapping[str, Any]) -> int:
    """The config's world size: ``trainer.n_gpus_per_node x trainer.nnodes``."""
    return int(flat["trainer.n_gpus_per_node"]) * int(flat["trainer.nnodes"])


@dataclass(frozen=True)
class _Role:
    """One model's knobs, as the terms need them."""

    strategy: str
    master_bytes: int
    compute_bytes: int
    reduce_bytes: int
    shard: int  # ranks its states are sharded over
    param_offload: bool
    optimizer_offload: bool
    offload_policy: bool
    forward_prefetch: bool
    reshard_after_forward: bool
    no_sync: bool
    checkpointing: bool
    activation_offload: bool
    remove_padding: bool


def _role(flat: Mapping[str, Any], section: str, strategy: str, model: str, shard_world: int) -> _Role:
    get = lambda leaf: flat[f"{section}.{leaf}"]  # noqa: E731
    size = int(get("fsdp_size"))
    return _Role(
        strategy=strategy,
        master_bytes=_BYTES[get("model_dtype")],
        compute_bytes=_BYTES[get("mixed_precision.param_dtype")],
        reduce_bytes=_BYTES[get("mixed_precision.reduce_dtype")],
        shard=size if size not in (-1, 0) else shard_world,  # HSDP: the shard group stays fsdp_size ranks
        param_offload=bool(get("param_offload")),
        optimizer_offload=bool(get("optimizer_offload")),
        offload_policy=bool(get("offload_policy")),
        forward_prefetch=bool(get("forward_prefetch")),
        reshard_after_forward=bool(get("reshard_after_forward")),
        no_sync=bool(get("use_no_sync_for_gradient_accumulation")),
        checkpointing=bool(flat[f"{model}.enable_gradient_checkpointing"]),
        activation_offload=bool(flat[f"{model}.enable_activation_offload"]),
        remove_padding=bool(flat[f"{model}.use_remove_padding"]),
    )


def _plan(flat: Mapping[str, Any], prefix: str, dynamic: str, micro: str, budget: str) -> Plan:
    """A phase's micro-batching from its section's keys (``trainer.engine.roles.build_roles``'s ``Plans``)."""
    return Plan(bool(flat[f"{prefix}.{dynamic}"]), flat[f"{prefix}.{micro}"], int(flat[f"{prefix}.{budget}"]))


def phase_terms(
    config: Mapping[str, Any],
    shape: ModelShape,
    lengths: Lengths,
    *,
    on_gpu: bool,
    world: Optional[int] = None,
    device_memory_gb: Optional[float] = None,
) -> PhaseTerms:
    """``{phase: {term: bytes}}`` for ``config`` (nested or flat) on one GPU.

    ``world``: the world size the states are sharded over (default: the config's). The per-GPU batch is
    always the config's own (``train_batch_size x rollout.n / its world``): projecting a trial to another
    world size at the same per-GPU batch changes only the sharded terms. ``on_gpu``: False for a CPU run
    (every state resident, offload inert). ``device_memory_gb``: the GPU's memory, for a vLLM engine's
    ``gpu_memory_utilization`` (None: the engine term is 0 on a GPU and its memory falls to the constant).
    """
    s = _setup(config, shape, lengths, on_gpu=on_gpu, world=world, device_memory_gb=device_memory_gb)
    out: PhaseTerms = {p: dict.fromkeys(TERMS, 0.0) for p in PHASES}
    for p in PHASES:
        out[p]["states"] = _states(s, p)
        out[p]["engine"] = _engine(s, p)
    if not s.vllm:
        out["gen"].update(_generate_terms(s))
    else:
        out["update_weights"]["buffers"] = s.counts.embedding * s.actor.master_bytes  # one full tensor at a time
    out["old_log_prob"].update(_old_log_prob_terms(s))
    if _built(s, "ref"):  # a role the run does not build has no phase (trainer.engine.roles.build_roles)
        out["ref"].update(_ref_terms(s))
    if _built(s, "critic"):
        out["values"].update(_values_terms(s))
        out["update_critic"].update(_update_critic_terms(s))
    out["update_actor"].update(_update_actor_terms(s))
    return out


@dataclass(frozen=True)
class _Setup:
    """What the terms read: the flat config, the model's shape and counts, the per-GPU batch, each role."""

    flat: Mapping[str, Any]
    counts: ParamCounts
    lengths: Lengths
    on_gpu: bool
    device_memory_gb: Optional[float]
    h: int  # hidden size
    i: int  # MLP intermediate size
    kv: int  # key/value width
    layers: int
    vocab: int
    trial_world: int
    n: int  # responses per prompt
    rows: float  # sequences per GPU (the per-GPU batch)
    P: int  # max prompt length
    R: int  # max response length
    actor: _Role
    ref: _Role
    critic: _Role
    vllm: bool
    pad_multiple: Optional[int]  # the actor's length bucket with pad_to_length
    ref_pad: Optional[int]
    entropy_chunk: Optional[int]  # rows of the entropy computed at once (None: trainer.engine.logits' chunk)
    temperature: float  # the rollout's: logits divided by it (out of place) when it is not 1


def _setup(
    config: Mapping[str, Any],
    shape: ModelShape,
    lengths: Lengths,
    *,
    on_gpu: bool,
    world: Optional[int],
    device_memory_gb: Optional[float],
) -> _Setup:
    flat = flat_config(config)
    trial_world = world_of(flat)
    shard_world = int(world or trial_world)
    n = int(flat[f"{_RO}.n"])
    strategy = flat[f"{_A}.strategy"]
    pad_to_length = flat[f"{_A}.pad_to_length"]
    return _Setup(
        flat=flat,
        counts=param_counts(shape),
        lengths=lengths,
        on_gpu=on_gpu,
        device_memory_gb=device_memory_gb,
        h=shape.hidden_size,
        i=shape.intermediate_size,
        kv=shape.kv_dim,
        layers=shape.num_hidden_layers,
        vocab=shape.vocab_size,
        trial_world=trial_world,
        n=n,
        rows=int(flat["data.train_batch_size"]) * n / trial_world,
        P=int(flat["data.max_prompt_length"]),
        R=int(flat["data.max_response_length"]),
        actor=_role(flat, f"{_A}.fsdp_config", strategy, "actor_rollout_ref.model", shard_world),
        ref=_role(flat, f"{_REF}.fsdp_config", strategy, "actor_rollout_ref.model", shard_world),
        critic=_role(flat, f"{_C}.fsdp", flat[f"{_C}.strategy"], "critic.model", shard_world),
        # an unnamed rollout is vLLM on a GPU (``ppotune train`` refuses a GPU run where it does not import)
        vllm=rollout_name(flat[f"{_RO}.name"], device_type="cuda" if on_gpu else "cpu", vllm_importable=True) == "vllm",
        pad_multiple=int(flat[f"{_A}.fsdp_config.pad_to_length_bucket"]) if pad_to_length else None,
        ref_pad=int(flat[f"{_REF}.fsdp_config.pad_to_length_bucket"]) if pad_to_length else None,
        entropy_chunk=(
            int(flat[f"{_A}.entropy_from_logits_chunk_size"])
            if flat[f"{_A}.entropy_from_logits_with_chunking"]
            else None
        ),
        temperature=float(flat[f"{_RO}.temperature"]),
    )


def _micro(s: _Setup, plan: Plan, num_rows: float, role: _Role, multiple: Optional[int] = None) -> MicroBatch:
    return largest_micro_batch(
        s.lengths,
        plan,
        num_rows=int(round(num_rows)),
        max_prompt_length=s.P,
        max_response_length=s.R,
        remove_padding=role.remove_padding,
        pad_multiple=multiple,
    )


# --------------------------------------------------------------------------- the phases
def _generate_terms(s: _Setup) -> dict[str, float]:
    """gen: HF generate over the rank's whole batch (prefill of the padded prompts, then one token at a time)."""
    longest_response = min(s.lengths.response["max"], s.R)
    return {
        "buffers": _generate_buffers(s),
        "kv_cache": s.rows * (s.P + longest_response) * s.layers * 2 * s.kv * s.actor.compute_bytes,
        "activations": _forward_activations(s, s.actor, s.rows * s.P),
        "attention": s.rows * s.P**2 * s.actor.compute_bytes,  # the prefill's mask over the padded prompts
        "logits": s.rows * s.vocab * 4 * 3,  # fp32 scores, softmax, top-p's sorted copy
    }


_LOG_PROB = ("log_prob_use_dynamic_bsz", "log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu")


def _old_log_prob_terms(s: _Setup) -> dict[str, float]:
    mb = _micro(s, _plan(s.flat, _RO, *_LOG_PROB), s.rows, s.actor, s.pad_multiple)
    return {
        "buffers": _buffers(s, s.actor, s.counts.actor_root, s.counts.actor, update=False),
        "activations": _forward_activations(s, s.actor, mb.tokens),
        "attention": _attention(s, s.actor, mb, update=False),
        "logits": _logits(s, s.actor, mb, update=False, entropy=True),
    }


def _ref_terms(s: _Setup) -> dict[str, float]:
    mb = _micro(s, _plan(s.flat, _REF, *_LOG_PROB), s.rows, s.ref, s.ref_pad)
    return {
        # on a GPU the reference model's shards live in host memory: each unit is copied in for its forward
        "buffers": _buffers(s, s.ref, s.counts.actor_root, s.counts.actor, update=False, copied_in=s.on_gpu),
        "activations": _forward_activations(s, s.ref, mb.tokens),
        "attention": _attention(s, s.ref, mb, update=False),
        "logits": _logits(s, s.ref, mb, update=False, entropy=False),
    }


def _values_terms(s: _Setup) -> dict[str, float]:
    plan = _plan(s.flat, _C, "use_dynamic_bsz", "forward_micro_batch_size_per_gpu", "forward_max_token_len_per_gpu")
    mb = _micro(s, plan, s.rows, s.critic)
    return {
        "buffers": _buffers(s, s.critic, s.counts.critic_root, s.counts.critic, update=False),
        "activations": _forward_activations(s, s.critic, mb.tokens),
        "attention": _attention(s, s.critic, mb, update=False),
    }


def _update_critic_terms(s: _Setup) -> dict[str, float]:
    plan = _plan(s.flat, _C, "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu")
    mini = int(s.flat[f"{_C}.ppo_mini_batch_size"]) * s.n / s.trial_world
    mb = _micro(s, plan, mini, s.critic)
    return {
        "buffers": _buffers(s, s.critic, s.counts.critic_root, s.counts.critic, update=True),
        "activations": _update_activations(s, s.critic, mb.tokens),
        "attention": _attention(s, s.critic, mb, update=True),
    }


def _update_actor_terms(s: _Setup) -> dict[str, float]:
    plan = _plan(s.flat, _A, "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu")
    mini = int(s.flat[f"{_A}.ppo_mini_batch_size"]) * s.n / s.trial_world
    with_entropy = bool(s.flat[f"{_A}.entropy_coeff"]) or bool(s.flat[f"{_A}.calculate_entropy"])
    mb = _micro(s, plan, mini, s.actor, s.pad_multiple)
    return {
        "buffers": _buffers(s, s.actor, s.counts.actor_root, s.counts.actor, update=True),
        "activations": _update_activations(s, s.actor, mb.tokens),
        "attention": _attention(s, s.actor, mb, update=True),
        "logits": _logits(s, s.actor, mb, update=True, entropy=with_entropy),
    }


# --------------------------------------------------------------------------- states
def _trained_states(s: _Setup, role: _Role, params: int, uses: set, update: str, phase: str) -> float:
    shard = params / role.shard
    if not s.on_gpu:
        return shard * role.master_bytes * (3 + (phase == update))  # params + 2 moments (+ grads)
    if role.offload_policy:
        return 0.0
    here = (not role.param_offload) or phase in uses
    moments = (not role.optimizer_offload) or phase == update
    return shard * role.master_bytes * (here + 2 * moments + (phase == update))


def _states(s: _Setup, phase: str) -> float:
    actor_uses = {"gen", "old_log_prob", "update_actor"} | ({"update_weights"} if s.vllm else set())
    total = _trained_states(s, s.actor, s.counts.actor, actor_uses, "update_actor", phase)
    if _built(s, "critic"):
        total += _trained_states(s, s.critic, s.counts.critic, {"values", "update_critic"}, "update_critic", phase)
    if not s.on_gpu and _built(s, "ref"):
        total += s.counts.actor / s.ref.shard * s.ref.master_bytes
    return total


def _built(s: _Setup, role: str) -> bool:
    """Whether the run builds the critic or the reference model (verl's need_critic, need_reference_policy)."""
    key = {"critic": f"{_C}.ppo_micro_batch_size_per_gpu", "ref": f"{_REF}.log_prob_micro_batch_size_per_gpu"}[role]
    return absent_role(s.flat, key) is None


# --------------------------------------------------------------------------- buffers
def _gathered(role: _Role, params: int, copied_in: bool) -> float:
    """Bytes of ``params`` unsharded in the compute dtype. FSDP1 NO_SHARD computes on the local copy (a
    mixed-precision copy at most), unless the parameters live in host memory (``copied_in``)."""
    no_shard = role.strategy == "fsdp" and role.shard == 1 and not copied_in
    if no_shard and role.compute_bytes == role.master_bytes:
        return 0.0
    return params * role.compute_bytes


def _buffers(s: _Setup, role: _Role, root: int, params: int, update: bool, copied_in: bool = False) -> float:
    if role.reshard_after_forward:
        unit = _gathered(role, s.counts.block, copied_in)
        total = _gathered(role, root, copied_in) + unit * (2 if role.forward_prefetch else 1)
    else:  # ZeRO-2: every unit stays gathered from its forward to its backward
        total = _gathered(role, params, copied_in)
    if update:
        total += (root + s.counts.block) * role.reduce_bytes  # unsharded gradients before the reduce-scatter
        if role.no_sync:
            total += params * role.master_bytes
    return total


def _generate_buffers(s: _Setup) -> float:
    actor = s.actor
    if actor.strategy == "fsdp":  # summon_full_params: the fp32 masters, gathered (NO_SHARD: already whole)
        return 0.0 if actor.shard == 1 else s.counts.actor * actor.master_bytes
    return s.counts.actor * actor.compute_bytes


# --------------------------------------------------------------------------- activations (bytes per token)
def _layer_bytes(s: _Setup, cb: int) -> float:
    return cb * (6 * s.h + 4 * s.kv + 4 * s.i) + 4 * 2 * s.h


def _update_activations(s: _Setup, role: _Role, tokens: float) -> float:
    cb, h = role.compute_bytes, s.h
    outside = cb * 2 * h + 4 * h  # final norm (fp32 input) and the head's input
    if role.activation_offload and s.on_gpu:
        kept = h * cb + _layer_bytes(s, cb)
    elif role.checkpointing:
        kept = s.layers * h * cb + _layer_bytes(s, cb)  # layer inputs + the layer being recomputed
    else:
        kept = s.layers * _layer_bytes(s, cb)
    # backward holds one layer's activation gradients beside what is kept (freed layer by layer)
    return tokens * (kept + _layer_bytes(s, cb) + outside)


def _forward_activations(s: _Setup, role: _Role, tokens: float) -> float:
    return tokens * (role.compute_bytes * (3 * s.h + 3 * s.i) + 4 * s.h)


def _attention(s: _Setup, role: _Role, mb: MicroBatch, *, update: bool) -> float:
    if role.remove_padding:
        return 0.0
    one_layer = mb.rows * (s.P + s.R) ** 2 * role.compute_bytes
    if not update:
        return one_layer
    kept = 1 if role.checkpointing or (role.activation_offload and s.on_gpu) else s.layers
    return (kept + 1) * one_layer


# --------------------------------------------------------------------------- logits
#: trainer.engine.logits.chunk_rows: a 1/64 share of the logits' rows, at least 16 MiB of fp32 (the tuner does not
#: import the engine)
_CHUNKS_PER_LOGITS, _MIN_CHUNK_BYTES = 64, 16 << 20


def _logits(s: _Setup, role: _Role, mb: MicroBatch, *, update: bool, entropy: bool) -> float:
    one = mb.tokens * s.vocab * role.compute_bytes  # the LM head's output, compute dtype
    chunk = max(math.ceil(mb.tokens / _CHUNKS_PER_LOGITS), _MIN_CHUNK_BYTES // (4 * s.vocab), 1)
    if entropy and s.entropy_chunk:
        chunk = max(chunk, s.entropy_chunk)
    total = one + min(mb.response_tokens, chunk) * s.vocab * (role.compute_bytes + 8)
    if s.temperature != 1.0:
        total += one  # divided by the temperature out of place (its gradient too, in an update)
    if update and entropy:
        total += 2 * one  # the log-prob's gradient (not in place: the entropy reads the logits) and the entropy's
    return total


# --------------------------------------------------------------------------- engine (vLLM)
def _engine(s: _Setup, phase: str) -> float:
    if not s.vllm:
        return 0.0
    flat = s.flat
    util = float(flat[f"{_RO}.gpu_memory_utilization"])
    weights = s.counts.actor * _BYTES[flat[f"{_RO}.dtype"]]
    if not s.on_gpu:
        return max(util * float(flat["ppotune.vllm_cpu_memory_gb"]) * 2**30, weights)
    asleep = flat[f"{_RO}.free_cache_engine"] and flat[f"{_RO}.enable_sleep_mode"]
    if asleep and phase not in ("gen", "update_weights"):
        return 0.0
    if phase == "update_weights" and asleep:
        return weights  # weights are loaded into an engine whose KV cache is not allocated yet
    return util * s.device_memory_gb * 2**30 if s.device_memory_gb else 0.0
