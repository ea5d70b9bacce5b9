"""What a run says in its notes about the knobs that cannot act as set (torch): said, never silently ignored.

:func:`knob_notes` is what :func:`trainer.engine.roles.build_roles` adds before it builds a model, one small
function per kind of note, in this order: offload on CPU, a shared section's key that cannot act in its role,
fp32 compute, packed attention that is not verl's kernel, ``pad_to_length`` without packing, the reference
model's offload flags, vLLM-only keys on an HF-generate run, HF generate on a GPU (not production's rollout).
Each reads an effective config (``trainer.config.effective_config``: the null follow-keys filled in; the rollout
named, ``trainer.engine.rollout.with_rollout``). One note needs the built model and is added where it is built
(``trainer.engine.parallelize.apply_offload``): :func:`few_layers_offload_note`.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["knob_notes", "packed_attention_notes", "few_layers_offload_note", "VLLM_ONLY_KEYS", "HF_ROLLOUT_ON_GPU"]

#: The note of a GPU run whose rollout is HF generate (the report shows a trial's notes in its row)
HF_ROLLOUT_ON_GPU = (
    "actor_rollout_ref.rollout.name=hf: HF generate on a GPU is not production's rollout (verl runs vLLM): this "
    "run's gen phase, and the step time every knob is ranked by, are not what a verl job's would be"
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


def knob_notes(cfg, device_type: str) -> list[str]:
    """Every note of this module for ``cfg`` (an effective config) on a ``device_type`` ("cuda" | "cpu") run."""
    return [
        *_offload_on_cpu_notes(cfg, device_type),
        *_inert_shared_key_notes(cfg),
        *_fp32_compute_notes(cfg),
        *packed_attention_notes(cfg, device_type),
        *_pad_to_length_notes(cfg),
        *_ref_offload_notes(cfg),
        *_vllm_only_notes(cfg),
        *_critic_batching_notes(cfg),
        *([HF_ROLLOUT_ON_GPU] if device_type == "cuda" and cfg.actor_rollout_ref.rollout.name == "hf" else []),
    ]


def few_layers_offload_note(role: str, num_layers: int) -> str:
    """The note of a role ("actor" | "critic") whose activation offload is off because its model has ``num_layers``
    layers (trainer.engine.offload.offload_layers), fewer than verl turns it on for."""
    key = f"{'critic' if role == 'critic' else 'actor_rollout_ref'}.model.enable_activation_offload"
    return (
        f"{key}: off; the model has {num_layers} layer(s) to offload, and verl 0.9.1 turns activation offload off "
        "below 3 (utils/activation_offload.py::enable_activation_offloading): its activations stay on the device "
        "(and gradient checkpointing, if on, stays HF's), as in verl"
    )


def _offload_on_cpu_notes(cfg, device_type: str) -> list[str]:
    if device_type != "cpu":
        return []
    a, c, mdl = cfg.actor_rollout_ref.actor, cfg.critic, cfg.actor_rollout_ref.model
    return [
        f"{key}: no effect on CPU (the tensors already live in host memory)"
        for key, value in (
            ("actor_rollout_ref.model.enable_activation_offload", mdl.enable_activation_offload),
            ("critic.model.enable_activation_offload", c.model.enable_activation_offload),
            ("actor_rollout_ref.actor.fsdp_config.param_offload", a.fsdp_config.param_offload),
            ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", a.fsdp_config.optimizer_offload),
            ("critic.fsdp.param_offload", c.fsdp.param_offload),
            ("critic.fsdp.optimizer_offload", c.fsdp.optimizer_offload),
            ("actor_rollout_ref.actor.fsdp_config.offload_policy", a.fsdp_config.offload_policy),
            ("critic.fsdp.offload_policy", c.fsdp.offload_policy),
        )
        if value
    ]


#: keys of a shared section (FSDPConfig) that cannot act in their role, and why
_INERT_SHARED_KEYS = {
    "actor_rollout_ref.ref.fsdp_config.use_no_sync_for_gradient_accumulation": "the reference model is not trained",
    "critic.fsdp.pad_to_length_bucket": "only the actor's and reference model's packed rows are padded "
    "(actor_rollout_ref.actor.pad_to_length)",
}


def _inert_shared_key_notes(cfg) -> list[str]:
    """A key set away from its default where its role cannot use it."""
    from trainer.config import FSDPConfig

    out = []
    for key, why in _INERT_SHARED_KEYS.items():
        section, leaf = key.rsplit(".", 1)
        fc = cfg.actor_rollout_ref.ref.fsdp_config if section.startswith("actor_rollout_ref.ref") else cfg.critic.fsdp
        if getattr(fc, leaf) != getattr(FSDPConfig(), leaf):
            out.append(f"{key}: no effect; {why}")
    return out


def _fp32_compute_notes(cfg) -> list[str]:
    """Roles that compute in fp32 (verl's default is bf16): the figures are fp32's."""
    from trainer.config import PRECISIONS

    arr = cfg.actor_rollout_ref
    fp32 = [
        name
        for name, fc in (("actor", arr.actor.fsdp_config), ("ref", arr.ref.fsdp_config), ("critic", cfg.critic.fsdp))
        if PRECISIONS[fc.mixed_precision.param_dtype] == "float32"
    ]
    if not fp32:
        return []
    return [
        f"mixed_precision.param_dtype: {'/'.join(fp32)} compute in fp32, not verl's default bf16: "
        "these figures are fp32's"
    ]


def packed_attention_notes(
    cfg,
    device_type: str,
    *,
    has_flash: Optional[bool] = None,
    has_torch_varlen: Optional[bool] = None,
    has_flex: Optional[bool] = None,
) -> list[str]:
    """What a GPU run of packed rows (``use_remove_padding``) says when its attention is not verl's: verl runs
    flash-attn varlen, one kernel per packed row (so does torch's own build of that kernel, which ppotune runs
    where flash-attn is missing); computing in fp32 (flash attention is half precision only), or with neither,
    the row goes through torch's flex attention (one compiled call, a block-diagonal mask), or where this torch has
    no flex attention, one sdpa call per sequence. The memory is the same; the step's speed is another kernel's. On
    CPU neither engine has a varlen kernel (verl runs padded there): nothing to say. ``cfg``: an effective config."""
    import torch

    from trainer.engine.attention import FLEX_BLOCK_DIAGONAL, PER_SEQUENCE_SDPA, packed_kernel
    from trainer.engine.parallel import torch_dtype

    if device_type != "cuda":
        return []
    given = (("has_flash", has_flash), ("has_torch_varlen", has_torch_varlen), ("has_flex", has_flex))
    kw = {k: v for k, v in given if v is not None}
    ran = {
        FLEX_BLOCK_DIAGONAL: "torch's flex attention, one compiled call per row with a block-diagonal mask",
        PER_SEQUENCE_SDPA: "one sdpa call per sequence",
    }
    out = []
    arr = cfg.actor_rollout_ref
    roles = [
        ("actor_rollout_ref.model.use_remove_padding", arr.model.use_remove_padding, arr.actor.fsdp_config),
        ("critic.model.use_remove_padding", cfg.critic.model.use_remove_padding, cfg.critic.fsdp),
    ]
    for key, packed, fc in roles:
        dtype = torch_dtype(fc.mixed_precision.param_dtype)
        kernel = packed_kernel(device_type, dtype, **kw) if packed else None
        if kernel in ran:
            why = "fp32 compute (flash attention is half precision only)" if dtype == torch.float32 else "no flash-attn"
            out.append(
                f"{key}: packed attention ran {ran[kernel]} ({why}), where verl runs one flash-attn varlen call per "
                "row: the same memory, another kernel's speed on a GPU (install flash-attn, compute in bf16)"
            )
    return out


def _pad_to_length_notes(cfg) -> list[str]:
    arr = cfg.actor_rollout_ref
    if arr.actor.pad_to_length and not arr.model.use_remove_padding:
        return ["actor_rollout_ref.actor.pad_to_length: no effect without use_remove_padding (nothing is packed)"]
    return []


def _ref_offload_notes(cfg) -> list[str]:
    """The reference model's offload flags: it is always offloaded between uses and has no optimizer."""
    return [
        f"actor_rollout_ref.ref.fsdp_config.{key}: no effect; the reference model's parameters always "
        "live in host memory between uses (verl's forward-only engine), and it has no optimizer"
        for key in ("param_offload", "optimizer_offload", "offload_policy")
        if getattr(cfg.actor_rollout_ref.ref.fsdp_config, key)
    ]


def _vllm_only_notes(cfg) -> list[str]:
    """vLLM-only rollout keys somebody set on an HF-generate run."""
    ro = cfg.actor_rollout_ref.rollout
    if ro.name == "vllm":
        return []
    from trainer.config import RolloutConfig

    defaults = RolloutConfig()
    return [
        f"actor_rollout_ref.rollout.{key}: no effect with rollout.name=hf (vLLM-only knob)"
        for key in VLLM_ONLY_KEYS
        if getattr(ro, key) != getattr(defaults, key)  # only the ones somebody set
    ]


def _critic_batching_notes(cfg) -> list[str]:
    """The critic's batching keys: this engine applies them, verl 0.9.1 does not (docs/verl_parity.md)."""
    from trainer.config.schema import need_critic

    if not need_critic(cfg):
        return []
    return [
        "critic: micro-batches from critic.ppo_micro_batch_size_per_gpu / use_dynamic_bsz / *_max_token_len_per_gpu, "
        "as this engine reads them; verl 0.9.1's critic reads critic.fsdp and critic.ppo_infer_max_token_len_per_gpu "
        "instead (docs/verl_parity.md): its figures are this engine's critic, not verl's"
    ]
