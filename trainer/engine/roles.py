"""The roles of a PPO run (torch): what each one is, and :func:`build_roles`, which makes them from a config.

A :class:`Trainee` is a sharded model plus (if trained) its optimizer and the knobs that act around its passes;
:class:`Roles` holds actor, reference model and critic with the run's micro-batch :class:`Plans` and its
:class:`StepSettings` (the algorithm's, identical under every knob setting): what
:func:`trainer.engine.step.ppo_step` runs on. :func:`build_roles` reads top to bottom as numbered steps:
the notes about knobs that cannot act (trainer/engine/knob_notes.py), the three models loaded and sharded one
at a time, the rollout engine, optimizers, KL controller, plans and settings, assembled.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from trainer.config import PRECISIONS, effective_config, need_critic, need_reference_policy
from trainer.contracts import SHAPE_KEYS
from trainer.engine import core
from trainer.engine.batching import fixed_micro_batches, token_budget_micro_batches
from trainer.engine.knob_notes import knob_notes
from trainer.engine.models import load_actor, load_critic, num_params
from trainer.engine.offload import move_optimizer_state, move_params
from trainer.engine.parallel import Sharded, ShardKnobs, free_memory, iter_full_params, torch_dtype
from trainer.engine.parallelize import ModelKnobs, parallelize
from trainer.engine.rollout import Sampling, generate_responses, with_rollout

if TYPE_CHECKING:
    from trainer.engine.vllm_rollout import VLLMRollout

__all__ = [
    "MicroBatching",
    "Trainee",
    "resident",
    "ActorLoss",
    "StepSettings",
    "Plans",
    "Roles",
    "fullest_micro_batches",
    "worst_case_notes",
    "model_loads",
    "build_roles",
    "SHAPE_KEYS",
]


# --------------------------------------------------------------------------- what a role is


@dataclass(frozen=True)
class MicroBatching:
    """How a rank splits its sequences: fixed ``micro_batch_size`` or a per-GPU token budget."""

    dynamic: bool
    micro_batch_size: Optional[int]
    max_token_len: int


@dataclass
class Trainee:
    """A sharded model plus (if trained) its optimizer and the knobs that act around its passes."""

    sharded: Sharded
    optimizer: Optional[torch.optim.Optimizer] = None
    param_offload: bool = False  # parameter shards in host memory between phases
    optimizer_offload: bool = False  # optimizer state in host memory between updates
    activation_offload: bool = False
    rmpad: bool = True
    no_sync: bool = False  # use_no_sync_for_gradient_accumulation
    pad_to_multiple: Optional[int] = None  # pad_to_length: packed rows padded to a multiple of the bucket
    offload_on_cpu: bool = False  # the offload knobs' copies run on a CPU too (build_roles' offload_on_cpu)


@contextlib.contextmanager
def resident(trainee: Trainee, device: torch.device, *, update: bool = False):
    """What a phase needs on the device, for the phase only (verl's load_fsdp_model_to_gpu /
    load_fsdp_optimizer before a phase, offload after): the parameter shards with ``param_offload``,
    and for an update the optimizer state with ``optimizer_offload``. On a CPU run both are no-ops (real copies
    with ``offload_on_cpu``)."""
    copy = trainee.offload_on_cpu
    if trainee.param_offload:
        move_params(trainee.sharded, device, copy=copy)
    if update and trainee.optimizer_offload:
        move_optimizer_state(trainee.optimizer, None, copy=copy)  # next to each parameter, wherever it lives
    try:
        yield
    finally:
        if update and trainee.optimizer_offload:
            move_optimizer_state(trainee.optimizer, torch.device("cpu"), copy=copy)
        if trainee.param_offload:
            move_params(trainee.sharded, torch.device("cpu"), copy=copy)


@dataclass(frozen=True)
class ActorLoss:
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    calculate_entropy: bool
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    grad_clip: float
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int = 1  # seq-mean-token-sum-norm's divisor (None in the config: max_response_length)


@dataclass(frozen=True)
class StepSettings:
    """The global (algorithm) settings of a step; identical under every knob setting."""

    sampling: Sampling  # the rollout's
    ppo_mini_batch_size_per_gpu: int  # sequences, = ppo_mini_batch_size * n / world_size
    critic_mini_batch_size_per_gpu: int
    ppo_epochs: int
    critic_epochs: int
    gamma: float
    lam: float
    use_kl_in_reward: bool
    kl_penalty: str
    cliprange_value: float
    critic_grad_clip: float
    actor_loss: ActorLoss
    train_batch_size: int
    rollout_n: int
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_critic: bool = True  # verl's need_critic
    use_reference: bool = True  # verl's need_reference_policy


@dataclass
class Plans:
    """Each phase's :class:`MicroBatching` (the per-GPU knobs of its section)."""

    actor: MicroBatching
    critic: MicroBatching
    critic_forward: MicroBatching
    ref: MicroBatching
    rollout_log_prob: MicroBatching


@dataclass
class Roles:
    """What :func:`trainer.engine.step.ppo_step` runs on: the trainees (no reference model when no KL reads it,
    no critic for a critic-free estimator: verl builds neither then), the rollout (a colocated vLLM engine or HF
    generate from the actor), the KL controller, the plans and the step's settings."""

    actor: Trainee
    ref: Optional[Trainee]
    critic: Optional[Trainee]
    tokenizer: object
    kl_ctrl: object
    plans: Plans
    settings: StepSettings
    rollout: Optional["VLLMRollout"] = None  # rollout.name=vllm: the colocated engine; None: HF generate

    def free(self) -> None:
        """The run is over: give back the models' memory now (:func:`trainer.engine.parallel.free_memory`), so a
        later trial of the same process starts from what it would have in a fresh one."""
        for trainee in (self.actor, self.ref, self.critic):
            if trainee is not None:
                free_memory(trainee.sharded, trainee.optimizer)

    def update_weights(self, device: torch.device) -> None:
        """Push the actor's current weights into the rollout engine (no-op for HF generate, which
        reads the actor itself). Every rank gathers each tensor and loads it into its own engine."""
        if self.rollout is None:
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(resident(self.actor, device))  # param_offload: the shards come for the gather
            # and go back to the host (``release``) before the engine's KV cache wakes, in verl's order
            self.rollout.update_weights(iter_full_params(self.actor.sharded, device), release=stack.close)

    def release_rollout(self) -> None:
        """After generation: the engine sleeps (``free_cache_engine``), training gets its memory back."""
        if self.rollout is not None:
            self.rollout.sleep()

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        device: torch.device,
        *,
        sampling: Optional[Sampling] = None,
        streamer=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Responses and their mask sampled from the actor with this run's rollout settings (or ``sampling``);
        ``streamer``: told each decode step of an HF generate (a profiled step's window)."""
        sampling = sampling or self.settings.sampling
        if self.rollout is not None:
            return self.rollout.generate(prompt_ids, prompt_mask, sampling)
        with resident(self.actor, device):
            return generate_responses(self.actor.sharded, prompt_ids, prompt_mask, sampling, streamer=streamer)


def fullest_micro_batches(
    plans: Plans, settings: StepSettings, seq_lengths: list[int]
) -> dict[str, tuple[int, int, Optional[int]]]:
    """phase -> (sequences, tokens, token budget or None for a fixed size) of the fullest micro-batch a rank's
    sequences of ``seq_lengths`` tokens make in each phase of :func:`trainer.engine.step.ppo_step`: the same plans
    and the same partitioning (trainer/engine/batching.py) the step runs; the updates split each mini-batch. On one
    rank's lengths (the step agrees the count across ranks: with equal lengths on every rank, as in the worst case,
    the same)."""

    def fullest(lengths: list[int], plan: MicroBatching) -> tuple[int, int, Optional[int]]:
        if plan.dynamic:
            bins = token_budget_micro_batches(lengths, plan.max_token_len)
        else:
            bins = fixed_micro_batches(len(lengths), plan.micro_batch_size)
        best = max(bins, key=lambda b: (sum(lengths[i] for i in b), len(b)))
        return len(best), sum(lengths[i] for i in best), plan.max_token_len if plan.dynamic else None

    def per_mini_batch(plan: MicroBatching, mini: int) -> tuple[int, int, Optional[int]]:
        parts = [fullest(seq_lengths[i : i + mini], plan) for i in range(0, len(seq_lengths), mini)]
        return max(parts, key=lambda x: (x[1], x[0]))

    out = {"old_log_prob": fullest(seq_lengths, plans.rollout_log_prob)}
    if settings.use_reference:
        out["ref"] = fullest(seq_lengths, plans.ref)
    if settings.use_critic:
        out["values"] = fullest(seq_lengths, plans.critic_forward)
        out["update_critic"] = per_mini_batch(plans.critic, settings.critic_mini_batch_size_per_gpu)
    out["update_actor"] = per_mini_batch(plans.actor, settings.ppo_mini_batch_size_per_gpu)
    return out


def worst_case_notes(roles: Roles, *, num_rows: int, prompt_length: int, response_length: int) -> list[str]:
    """The notes of a worst-case probe (``ppotune.worst_case``): its lengths, and what the fullest micro-batch of
    each phase then holds on a rank of ``num_rows`` sequences."""
    seq = prompt_length + response_length
    parts = []
    for phase, (num_seqs, tokens, budget) in fullest_micro_batches(
        roles.plans, roles.settings, [seq] * num_rows
    ).items():
        limit = f"of a {budget}-token budget" if budget is not None else "fixed micro-batch size"
        parts.append(f"{phase} {num_seqs} x {seq} = {tokens} tokens ({limit})")
    return [
        f"worst case: every prompt {prompt_length} tokens, every response {response_length} tokens (EOS ignored)",
        f"worst case: the fullest micro-batch per phase, {num_rows} sequences per rank: " + "; ".join(parts),
    ]


# --------------------------------------------------------------------------- building the roles from a config
def model_loads(cfg, rank: int) -> dict:
    """role -> (loader, path, keyword arguments): how :func:`build_roles` loads each model on ``rank``.

    Rank 0 loads the weights; the others build the architecture on the meta device and get their shards
    from rank 0 (verl: rank-0 load + sync_module_states). The reference model starts as the actor."""
    cfg = effective_config(cfg)
    max_pos = cfg.data.max_prompt_length + cfg.data.max_response_length
    kw = dict(tiny=cfg.ppotune.tiny, max_positions=max_pos, seed=cfg.trainer.seed, meta=rank != 0)
    actor = (load_actor, cfg.actor_rollout_ref.model.path, kw)
    return {"actor": actor, "ref": actor, "critic": (load_critic, cfg.critic.model.path, kw)}


def build_roles(cfg, tokenizer, device, world: int, notes: list[str], *, weights=None, offload_on_cpu: bool = False):
    """Load, shard and equip actor, ref and critic with this config's knobs; -> (Roles, model shape info).

    ``weights``: where a warm job keeps a copy of the loaded weights (``load(loader, path, tokenizer, **kw)``
    returns a fresh model, as the loader would, without reading the checkpoint again). ``offload_on_cpu``: on a
    CPU the offload knobs still run their mechanism (real copies, activation offload's hooks, FSDP2's offload
    policy unpinned), where a run would skip them: the invariance suite's check that they change no gradient."""
    # null follow-keys filled in, the rollout named: every value below is what the run uses
    cfg = with_rollout(effective_config(cfg), device.type)

    # step 1. what cannot act as set is said in the notes, never silently ignored
    notes.extend(knob_notes(cfg, device.type))

    # step 2. actor, reference model and critic, each transformed by its knobs (trainer.engine.parallelize:
    # checkpointing, compile, FSDP, offload) before the next is built
    models = _build_models(cfg, tokenizer, device, notes, weights, offload_on_cpu)

    # step 3. the rollout: a colocated vLLM engine (rollout.name=vllm), else HF generate from the actor
    rollout = _vllm_rollout(cfg, models, device, notes) if cfg.actor_rollout_ref.rollout.name == "vllm" else None

    # step 4. the trainees: the models with their optimizers and the knobs that act around their passes
    actor, ref, critic = _trainees(cfg, models, offload_on_cpu)

    # step 5. assembled with the KL controller, the micro-batch plans and the step's settings
    roles = Roles(
        actor=actor,
        ref=ref,
        critic=critic,
        tokenizer=tokenizer,
        kl_ctrl=_kl_controller(cfg.algorithm.kl_ctrl),
        plans=_plans(cfg),
        settings=_step_settings(cfg, tokenizer, world),
        rollout=rollout,
    )
    return roles, _shape_info(models.shape, models.num_params)


def _model_knobs(cfg, role: str, offload_on_cpu: bool) -> ModelKnobs:
    """A role's model knobs (trainer.engine.parallelize) from its sections of the config."""
    a, c, mdl = cfg.actor_rollout_ref.actor, cfg.critic, cfg.actor_rollout_ref.model
    if role == "ref":  # forward only: always compute-time offloaded (as in verl), never checkpointed
        shard = _shard_knobs(cfg.actor_rollout_ref.ref.fsdp_config, a.strategy, compute_offload=True)
        return ModelKnobs(shard=shard, offload_on_cpu=offload_on_cpu)
    if role == "critic":
        return ModelKnobs(
            shard=_shard_knobs(c.fsdp, c.strategy, compute_offload=c.fsdp.offload_policy),
            gradient_checkpointing=c.model.enable_gradient_checkpointing,
            param_offload=c.fsdp.param_offload,
            activation_offload=c.model.enable_activation_offload,
            offload_on_cpu=offload_on_cpu,
        )
    return ModelKnobs(
        shard=_shard_knobs(a.fsdp_config, a.strategy, compute_offload=a.fsdp_config.offload_policy),
        gradient_checkpointing=mdl.enable_gradient_checkpointing,
        entropy_chunk_size=a.entropy_from_logits_chunk_size if a.entropy_from_logits_with_chunking else None,
        entropy_checkpointing=a.entropy_checkpointing,
        compile_entropy=a.use_torch_compile,
        param_offload=a.fsdp_config.param_offload,
        activation_offload=mdl.enable_activation_offload,
        offload_on_cpu=offload_on_cpu,
    )


def _shard_knobs(fc, strategy: str, *, compute_offload: bool) -> ShardKnobs:
    """A role's FSDP knobs from its FSDP section (``fc``)."""
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
        wrap_min_num_params=fc.wrap_policy.min_num_params,
    )


@dataclass(frozen=True)
class _Models:
    """The three sharded models, and the actor's shape (its HF config) and parameter count before sharding."""

    actor: Sharded
    ref: Optional[Sharded]  # None: no KL reads it (verl's need_reference_policy)
    critic: Optional[Sharded]  # None: the estimator reads no values (verl's need_critic)
    shape: Any  # the actor's transformers config
    num_params: int


def _build_models(cfg, tokenizer, device, notes: list[str], weights, on_cpu: bool) -> _Models:
    """Rank 0 loads the weights; the others build the architecture on the meta device and get their
    shards from rank 0 (verl: rank-0 load + sync_module_states). One model at a time, each transformed by its
    knobs (trainer.engine.parallelize) before the next is built: host memory holds one full model, on one rank."""
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    loads = model_loads(cfg, dist.get_rank())

    def build(role, fc, name, *, frozen=False):
        """-> (the model's HF config, its parameter count, the sharded model)."""
        load, path, kw = loads[role]
        model = load(path, tokenizer, **kw) if weights is None else weights.load(load, path, tokenizer, **kw)
        model = model.to(torch_dtype(fc.model_dtype))  # master weights (model_dtype)
        model.requires_grad_(not frozen)
        count = num_params(model)  # before sharding: afterwards a rank sees only its shards
        knobs = _model_knobs(cfg, role, on_cpu)
        return model.config, count, parallelize(model, knobs, device=device, name=name, notes=notes)

    shape, count, actor = build("actor", a.fsdp_config, "actor_rollout_ref.actor.fsdp_config")
    ref = critic = None
    if need_reference_policy(cfg):
        ref_fc = cfg.actor_rollout_ref.ref.fsdp_config
        _, _, ref = build("ref", ref_fc, "actor_rollout_ref.ref.fsdp_config", frozen=True)
    if need_critic(cfg):
        _, _, critic = build("critic", c.fsdp, "critic.fsdp")
    return _Models(actor=actor, ref=ref, critic=critic, shape=shape, num_params=count)


def _vllm_rollout(cfg, models: _Models, device, notes: list[str]) -> "VLLMRollout":
    """The colocated vLLM engine, sized by its plan (whose notes the run says)."""
    from trainer.engine.vllm_rollout import DTYPE_BYTES, VLLMRollout, engine_plan

    ro = cfg.actor_rollout_ref.rollout
    plan = engine_plan(
        ro,
        device_type=device.type,
        max_model_len=ro.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
        weight_bytes=models.num_params * DTYPE_BYTES[ro.dtype],
        cpu_memory_gb=cfg.ppotune.vllm_cpu_memory_gb,
        rank=dist.get_rank(),
        local_rank=device.index,  # the engine is checked against the rank's own device before vLLM is built
    )
    notes.extend(plan.notes)
    return VLLMRollout.build(models.shape, plan)


def _adamw(sharded: Sharded, optim) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        sharded.module.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
    )


def _trainees(cfg, models: _Models, on_cpu: bool) -> tuple[Trainee, Optional[Trainee], Optional[Trainee]]:
    """(actor, ref, critic): each model with its optimizer (the trained ones) and its pass knobs; None for a
    role the run does not build."""
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    ref_fc, mdl = cfg.actor_rollout_ref.ref.fsdp_config, cfg.actor_rollout_ref.model
    actor_opt = _adamw(models.actor, a.optim)
    actor = Trainee(
        models.actor,
        actor_opt,
        param_offload=a.fsdp_config.param_offload,
        optimizer_offload=a.fsdp_config.optimizer_offload,
        activation_offload=mdl.enable_activation_offload,
        rmpad=mdl.use_remove_padding,
        no_sync=a.fsdp_config.use_no_sync_for_gradient_accumulation,
        pad_to_multiple=a.fsdp_config.pad_to_length_bucket if a.pad_to_length else None,
        offload_on_cpu=on_cpu,
    )
    ref = critic = None
    if models.ref is not None:
        ref = Trainee(
            models.ref,
            rmpad=mdl.use_remove_padding,
            pad_to_multiple=ref_fc.pad_to_length_bucket if a.pad_to_length else None,
        )
    if models.critic is None:
        return actor, ref, None
    critic = Trainee(
        models.critic,
        _adamw(models.critic, c.optim),
        param_offload=c.fsdp.param_offload,
        optimizer_offload=c.fsdp.optimizer_offload,
        activation_offload=c.model.enable_activation_offload,
        rmpad=c.model.use_remove_padding,
        no_sync=c.fsdp.use_no_sync_for_gradient_accumulation,
        offload_on_cpu=on_cpu,
    )
    return actor, ref, critic


def _kl_controller(kl):
    """``algorithm.kl_ctrl``: the coefficient of the KL penalty in the reward, adaptive or fixed."""
    if kl.type == "adaptive":
        return core.AdaptiveKLController(init_kl_coef=kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon)
    return core.FixedKLController(kl_coef=kl.kl_coef)


def _plans(cfg) -> Plans:
    """Each phase's micro-batching, from its section's per-GPU keys."""
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    ref_cfg, ro = cfg.actor_rollout_ref.ref, cfg.actor_rollout_ref.rollout
    return Plans(
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


def _step_settings(cfg, tokenizer, world: int) -> StepSettings:
    """The algorithm's settings of every step; the mini-batches per GPU at this world size."""
    a, c, ro = cfg.actor_rollout_ref.actor, cfg.critic, cfg.actor_rollout_ref.rollout
    n = ro.n
    return StepSettings(
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
        cliprange_value=c.cliprange_value,
        critic_grad_clip=c.grad_clip,
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
            loss_agg_mode=a.loss_agg_mode,
            loss_scale_factor=a.loss_scale_factor or cfg.data.max_response_length,
        ),
        train_batch_size=cfg.data.train_batch_size,
        rollout_n=n,
        adv_estimator=cfg.algorithm.adv_estimator,
        norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
        use_critic=need_critic(cfg),
        use_reference=need_reference_policy(cfg),
    )


def _shape_info(shape, n_params: int) -> dict:
    """The result's ``model`` (what tuner.memory_model computes from) and what the MFU formula reads."""
    head_dim = getattr(shape, "head_dim", None) or shape.hidden_size // shape.num_attention_heads
    return {
        "model": {**{k: getattr(shape, k, None) for k in SHAPE_KEYS}, "head_dim": head_dim, "num_params": n_params},
        "num_params": n_params,
        "head_dim": head_dim,
        "num_heads": shape.num_attention_heads,
        "num_layers": shape.num_hidden_layers,
    }
