"""Where verl 0.9.1 reads each key a shipped search space may vary, on which trainer path, and what it changes: the
source of the generated knob table of ``docs/verl_parity.md`` (``scripts/gen_verl_knob_table.py``; a test checks the
page is current, that every key of every shipped space is here, and that every file:function named exists in verl).
Paths are relative to verl's package; ``TW`` is ``workers/engine_workers.py:TrainingWorker``, ``FE`` the FSDP
engine ``workers/engine/fsdp/transformer_impl.py:FSDPEngine``. Torch-free.

``paths``: ``v0 v1`` (both trainers), ``v0`` (``trainer.use_v1: false`` only), ``none`` (neither: a key ppotune's
engine applies that verl never reads; :data:`tuner.space.registry.VERL_NO_OPS` refuses it under ``--engine verl``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KnobRead", "VERL_READS"]


@dataclass(frozen=True)
class KnobRead:
    where: str  # file:function (or :Class.method) in verl 0.9.1
    paths: str  # "v0 v1" | "v0" | "none"
    changes: str  # what verl does with it


_A, _RO, _REF, _C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref", "critic"
_INIT = "workers/engine_workers.py:ActorRolloutRefWorker.init_model"
_TRAIN = "workers/engine_workers.py:TrainingWorker.train_batch"
_INFER = "workers/engine_workers.py:TrainingWorker.infer_batch"
_PREP = "workers/engine/utils.py:prepare_micro_batches"
_BUILD = "workers/engine/fsdp/transformer_impl.py:FSDPEngine._build_fsdp_module"
_MODULE = "workers/engine/fsdp/transformer_impl.py:FSDPEngine._build_module"
_OUTPUTS = "workers/engine/fsdp/transformer_impl.py:FSDPEngineWithLMHead.prepare_model_outputs"
_VLLM = "workers/rollout/vllm_rollout/vllm_async_server.py:vLLMHttpServer.launch_server"
_V1_CRITIC = "trainer/ppo/v1/trainer_base.py:PPOTrainer._setup"
_V0_CRITIC = "trainer/ppo/ray_trainer.py:RayPPOTrainer.init_workers"
_PER_CALL = " (per call: an in-run sweep changes it at a step boundary)"


def _fsdp(section: str, role: str) -> dict[str, KnobRead]:
    return {
        f"{section}.forward_prefetch": KnobRead(
            _BUILD, "v0 v1", f"the {role}'s FSDP1 forward_prefetch; FSDP2: utils/fsdp_utils.py:apply_fsdp2 prefetches"
        ),
        f"{section}.reshard_after_forward": KnobRead(
            _BUILD, "v0 v1", f"the {role}'s FSDP2 reshard_after_forward; FSDP1: FULL_SHARD or SHARD_GRAD_OP"
        ),
        f"{section}.param_offload": KnobRead(
            "workers/engine/fsdp/transformer_impl.py:FSDPEngine.is_param_offload_enabled",
            "v0 v1",
            f"the {role}'s parameters to host memory between its passes",
        ),
        f"{section}.optimizer_offload": KnobRead(
            "workers/engine/fsdp/transformer_impl.py:FSDPEngine.is_optimizer_offload_enabled",
            "v0 v1",
            f"the {role}'s optimizer state to host memory between its updates",
        ),
        f"{section}.use_no_sync_for_gradient_accumulation": KnobRead(
            "workers/engine/fsdp/transformer_impl.py:FSDPEngine._gradient_sync_context",
            "v0 v1",
            f"the {role}'s gradients reduced once per mini-batch instead of per micro-batch",
        ),
    }


VERL_READS: dict[str, KnobRead] = {
    # per-step batching: the engine config a worker call falls back to when its batch does not name them
    f"{_A}.use_dynamic_bsz": KnobRead(_INIT, "v0 v1", "the update's token-budget micro-batches" + _PER_CALL),
    f"{_A}.ppo_micro_batch_size_per_gpu": KnobRead(_INIT, "v0 v1", "the update's micro-batch" + _PER_CALL),
    f"{_A}.ppo_max_token_len_per_gpu": KnobRead(_INIT, "v0 v1", "the update's token budget" + _PER_CALL),
    f"{_RO}.log_prob_use_dynamic_bsz": KnobRead(_INIT, "v0 v1", "old-log-prob token budgets" + _PER_CALL),
    f"{_RO}.log_prob_micro_batch_size_per_gpu": KnobRead(_INIT, "v0 v1", "old-log-prob micro-batch" + _PER_CALL),
    f"{_RO}.log_prob_max_token_len_per_gpu": KnobRead(_INIT, "v0 v1", "old-log-prob token budget" + _PER_CALL),
    f"{_REF}.log_prob_use_dynamic_bsz": KnobRead(_INIT, "v0 v1", "reference token budgets" + _PER_CALL),
    f"{_REF}.log_prob_micro_batch_size_per_gpu": KnobRead(_INIT, "v0 v1", "reference micro-batch" + _PER_CALL),
    f"{_REF}.log_prob_max_token_len_per_gpu": KnobRead(_INIT, "v0 v1", "reference token budget" + _PER_CALL),
    # the critic: a TrainingWorker on its engine config critic.fsdp
    f"{_C}.ppo_micro_batch_size_per_gpu": KnobRead(
        _TRAIN, "none", "nothing: the critic's micro-batch is critic.fsdp.micro_batch_size_per_gpu"
    ),
    f"{_C}.forward_max_token_len_per_gpu": KnobRead(
        _V1_CRITIC, "none", "nothing: the values pass's budget is critic.ppo_infer_max_token_len_per_gpu"
    ),
    f"{_C}.ppo_max_token_len_per_gpu": KnobRead(
        _V0_CRITIC,
        "v0",
        "the critic update's budget on the legacy trainer; v1 takes critic.ppo_infer_max_token_len_per_gpu",
    ),
    f"{_C}.strategy": KnobRead(
        "workers/config/critic.py:FSDPCriticConfig.__post_init__", "v0 v1", "the critic's FSDP1 or FSDP2"
    ),
    f"{_A}.strategy": KnobRead(_BUILD, "v0 v1", "the actor's (and reference's) FSDP1 or FSDP2"),
    # activation and logits memory
    "actor_rollout_ref.model.enable_gradient_checkpointing": KnobRead(_MODULE, "v0 v1", "the actor's recompute"),
    f"{_C}.model.enable_gradient_checkpointing": KnobRead(_MODULE, "v0 v1", "the critic's recompute"),
    "actor_rollout_ref.model.enable_activation_offload": KnobRead(_BUILD, "v0 v1", "activations to host memory"),
    "actor_rollout_ref.model.use_remove_padding": KnobRead(
        "workers/engine/fsdp/transformer_impl.py:FSDPEngineWithLMHead.prepare_model_inputs",
        "v0 v1",
        "packed (flash-attn varlen) micro-batches for the actor and reference",
    ),
    f"{_C}.model.use_remove_padding": KnobRead(
        "workers/engine/fsdp/transformer_impl.py:FSDPEngineWithLMHead.prepare_model_inputs",
        "v0 v1",
        "packed micro-batches for the critic",
    ),
    f"{_A}.entropy_from_logits_with_chunking": KnobRead(_OUTPUTS, "v0 v1", "the entropy a chunk of tokens at a time"),
    f"{_A}.entropy_checkpointing": KnobRead(_OUTPUTS, "v0 v1", "the entropy recomputed in backward"),
    f"{_A}.use_torch_compile": KnobRead(
        "workers/engine/fsdp/transformer_impl.py:FSDPEngine.__init__", "v0 v1", "the entropy function compiled"
    ),
    f"{_A}.pad_to_length": KnobRead(
        "workers/engine/fsdp/transformer_impl.py:FSDPEngine._get_packed_pad_size",
        "v0 v1",
        "packed micro-batches padded to a bucket",
    ),
    # sharding and precision
    f"{_A}.fsdp_config.fsdp_size": KnobRead(
        "workers/engine/fsdp/transformer_impl.py:FSDPEngine._init_device_mesh", "v0 v1", "the shard group (HSDP)"
    ),
    f"{_A}.fsdp_config.mixed_precision.param_dtype": KnobRead(_BUILD, "v0 v1", "the compute dtype"),
    f"{_A}.fsdp_config.offload_policy": KnobRead(_BUILD, "v0 v1", "FSDP2's compute-time CPU offload"),
    **_fsdp(f"{_A}.fsdp_config", "actor"),
    **_fsdp(f"{_C}.fsdp", "critic"),
    # the vLLM rollout: engine arguments of each replica's server
    f"{_RO}.gpu_memory_utilization": KnobRead(_VLLM, "v0 v1", "vLLM's share of the device (weights + KV cache)"),
    f"{_RO}.max_num_seqs": KnobRead(_VLLM, "v0 v1", "sequences one engine schedules at once"),
    f"{_RO}.max_num_batched_tokens": KnobRead(_VLLM, "v0 v1", "tokens one engine step holds"),
    f"{_RO}.enable_chunked_prefill": KnobRead(_VLLM, "v0 v1", "prefill split over engine steps"),
    f"{_RO}.enforce_eager": KnobRead(_VLLM, "v0 v1", "no CUDA graphs"),
    f"{_RO}.free_cache_engine": KnobRead(
        "workers/rollout/vllm_rollout/vllm_async_server.py:vLLMHttpServer.sleep",
        "v0 v1",
        "the engine's memory released while the FSDP roles train",
    ),
}
