"""What a training config is: one dataclass per section, every default, each field documented where it lives.

Keys are verl's keys (``python -m verl.trainer.main_ppo``) for every concept verl has; keys verl lacks live
under ``ppotune.`` (:class:`PPOTuneSection`). A ``None`` default that means "the value of another key" is
listed in :data:`trainer.config.keys.FOLLOWS`. The checks that refuse a contradiction are in
:mod:`trainer.config.rules`; building a config from YAML and overrides is :mod:`trainer.config.io`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = [
    "WrapPolicyConfig",
    "MixedPrecisionConfig",
    "FSDPConfig",
    "OptimConfig",
    "ModelConfig",
    "ActorConfig",
    "RefConfig",
    "RolloutConfig",
    "ActorRolloutRefConfig",
    "CriticModelConfig",
    "CriticConfig",
    "KLCtrlConfig",
    "AlgorithmConfig",
    "DataConfig",
    "TrainerSection",
    "TinyModelConfig",
    "SyntheticDataConfig",
    "PPOTuneSection",
    "PPOConfig",
    "world_size",
    "CRITIC_ESTIMATORS",
    "need_critic",
    "need_reference_policy",
]


@dataclass
class WrapPolicyConfig:
    """verl ``*.fsdp_config.wrap_policy`` (``critic.fsdp.wrap_policy``): what one FSDP unit holds."""

    # verl: wrap each transformer block; min_num_params > 0 switches to size-based wrapping.
    min_num_params: int = 0


@dataclass
class MixedPrecisionConfig:
    """verl ``fsdp_config.mixed_precision``: not in verl's YAML (``+key=`` adds it); these are the
    defaults verl's FSDP engine uses when it is absent. Spellings as verl's PrecisionType: bf16 | fp32."""

    param_dtype: str = "bf16"  # the compute dtype: parameters are cast to it for forward and backward
    reduce_dtype: str = "fp32"  # gradient reduce-scatter / all-reduce dtype
    buffer_dtype: str = "fp32"  # FSDP1 only (FSDP2's MixedPrecisionPolicy has no buffer dtype)


@dataclass
class FSDPConfig:
    """verl ``*.fsdp_config`` (actor, ref) and ``critic.fsdp``: the per-GPU FSDP knobs."""

    # Between phases the FSDP module's parameter shards live in host memory; they are moved to the
    # GPU before a phase uses them and back after (verl's load/offload_fsdp_model_to_gpu/cpu).
    param_offload: bool = False
    # Optimizer state (Adam moments) in host memory between updates; on the GPU for the update.
    optimizer_offload: bool = False
    # FSDP2 only: CPUOffloadPolicy, compute-time offload (parameters, gradients and the optimizer
    # step stay on the CPU; each block is copied in for its forward/backward).
    offload_policy: bool = False
    reshard_after_forward: bool = True  # False: ZeRO-2 (FSDP1 SHARD_GRAD_OP; FSDP2 keeps params gathered)
    forward_prefetch: bool = False
    fsdp_size: int = -1  # ranks per shard group; -1 = all ranks; a divisor of the world size = hybrid (HSDP)
    model_dtype: str = "fp32"  # master weights: fp32 | bf16
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    # Skip the gradient reduce-scatter on all but the last micro-batch of a mini-batch (unsharded
    # gradients are kept meanwhile: fewer collectives, more memory).
    use_no_sync_for_gradient_accumulation: bool = False
    pad_to_length_bucket: int = 1024  # with actor.pad_to_length: packed micro-batches padded to a multiple
    wrap_policy: WrapPolicyConfig = field(default_factory=WrapPolicyConfig)


@dataclass
class OptimConfig:
    """verl ``actor.optim`` / ``critic.optim``: AdamW's knobs."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class ModelConfig:
    """verl ``actor_rollout_ref.model``. ``path``: a local HF checkpoint dir or ``tiny``."""

    path: str = "tiny"
    enable_gradient_checkpointing: bool = True
    enable_activation_offload: bool = False
    use_remove_padding: bool = True


@dataclass
class ActorConfig:
    """verl ``actor_rollout_ref.actor``: the policy's update (PPO loss, batching, FSDP)."""

    strategy: str = "fsdp"  # fsdp (FSDP1) | fsdp2 (fully_shard)
    ppo_mini_batch_size: int = 8  # global, in prompts (multiplied by rollout.n)
    ppo_micro_batch_size_per_gpu: Optional[int] = 2
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 1024
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # None -> clip_ratio
    clip_ratio_high: Optional[float] = None  # None -> clip_ratio
    clip_ratio_c: float = 3.0
    # how a loss matrix (B, T) becomes a scalar over the global mini-batch (verl's agg_loss): token-mean |
    # token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr. GRPO)
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm divides by this; None -> the response width (data.max_response_length)
    loss_scale_factor: Optional[int] = None
    entropy_coeff: float = 0.0
    # KL to the reference model as a loss term (GRPO recipes): + kl_loss_coef x agg(kl_penalty(kl_loss_type));
    # a "+" suffix (k1+, k3+, low_var_kl+, ...) keeps the value and takes k2's gradient (straight through)
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    # verl computes the entropy for the actor/entropy metric in the old-log-prob pass (no autograd);
    # the update computes it under autograd only when entropy_coeff != 0 or calculate_entropy.
    calculate_entropy: bool = False
    entropy_from_logits_with_chunking: bool = False  # entropy over chunks of tokens: lower peak memory
    entropy_from_logits_chunk_size: int = 2048
    entropy_checkpointing: bool = False  # recompute the entropy's softmax in backward instead of keeping it
    use_torch_compile: bool = True  # torch.compile the entropy function (verl's default)
    ulysses_sequence_parallel_size: int = 1
    pad_to_length: bool = False  # pad each packed micro-batch to a multiple of fsdp_config.pad_to_length_bucket
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefConfig:
    """verl ``actor_rollout_ref.ref``: the reference model's log-prob pass."""

    log_prob_micro_batch_size_per_gpu: Optional[int] = 4
    log_prob_use_dynamic_bsz: Optional[bool] = None  # None -> actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # None -> actor.ppo_max_token_len_per_gpu
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RolloutConfig:
    """verl ``actor_rollout_ref.rollout``: generation, and the rollout engine's log-prob pass."""

    # hf (transformers generate on the FSDP actor) | vllm | null: what verl runs, as trainer.config.rollout_name
    # decides (vLLM on a GPU, refused where it does not import; HF generate on a CPU)
    name: Optional[str] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    n: int = 1
    ignore_eos: bool = False  # every response runs to max_response_length (the worst-case batch)
    # vLLM engine knobs (rollout.name=vllm), verl's names and defaults; the engine is colocated, one per rank
    dtype: str = "bfloat16"  # the rollout engine's weights and compute
    gpu_memory_utilization: float = 0.5  # vLLM's: the fraction of device memory the engine may hold
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None  # None -> max_prompt_length + max_response_length
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # False: torch.compile (+ CUDA graphs on GPU)
    free_cache_engine: bool = True  # sleep the engine (KV cache, weights) during training
    enable_sleep_mode: bool = True  # verl's RolloutConfig field (not in its YAML: exported as +key)
    tensor_model_parallel_size: int = 1  # verl's default is 2; the ppotune engine runs 1 (one engine per rank)
    seed: int = 42  # the engine of rank r samples with seed + r (verl: replica rank + seed)
    log_prob_micro_batch_size_per_gpu: Optional[int] = 4
    log_prob_use_dynamic_bsz: Optional[bool] = None
    log_prob_max_token_len_per_gpu: Optional[int] = None


@dataclass
class ActorRolloutRefConfig:
    """verl ``actor_rollout_ref``: the model and its three roles."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig:
    """verl ``critic.model``."""

    path: Optional[str] = None  # None -> actor_rollout_ref.model.path
    enable_gradient_checkpointing: bool = True
    enable_activation_offload: bool = False
    use_remove_padding: bool = True


@dataclass
class CriticConfig:
    """verl ``critic``: the value model's update and forward pass."""

    # verl's need_critic: None -> a critic exactly when algorithm.adv_estimator is gae; the critic-free
    # estimators (grpo, rloo, ...) build none, and the critic's keys below then act on nothing
    enable: Optional[bool] = None
    strategy: Optional[str] = None  # None -> actor strategy
    ppo_mini_batch_size: Optional[int] = None  # None -> actor.ppo_mini_batch_size
    ppo_micro_batch_size_per_gpu: Optional[int] = 2
    forward_micro_batch_size_per_gpu: Optional[int] = None  # None -> ppo_micro_batch_size_per_gpu
    use_dynamic_bsz: Optional[bool] = None  # None -> actor.use_dynamic_bsz
    ppo_max_token_len_per_gpu: int = 2048
    forward_max_token_len_per_gpu: Optional[int] = None  # None -> ppo_max_token_len_per_gpu
    ppo_epochs: Optional[int] = None  # None -> actor.ppo_epochs
    cliprange_value: float = 0.5
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class KLCtrlConfig:
    """verl ``algorithm.kl_ctrl``: the KL-in-reward coefficient's controller."""

    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class AlgorithmConfig:
    """verl ``algorithm``: advantage estimation and the KL penalty in the reward."""

    gamma: float = 1.0
    lam: float = 1.0
    # verl's core_algos registry names that ppotune's engine runs (trainer/engine/core.py ADV_ESTIMATORS):
    # gae (needs the critic) | grpo | grpo_vectorized | grpo_passk | rloo | rloo_vectorized | opo | gpg |
    # reinforce_plus_plus | reinforce_plus_plus_baseline | remax; the others group responses of one prompt
    # (rollout.n > 1) into one baseline, remax takes a greedy response's reward as the baseline
    adv_estimator: str = "gae"
    # GRPO (and grpo_passk): divide by the group's standard deviation; False = Dr. GRPO
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # kl (k1) | abs | mse (k2) | low_var_kl (k3)
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)


@dataclass
class DataConfig:
    """verl ``data``."""

    train_files: Optional[str] = None  # verl parquet; None -> the embedded synthetic task
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    max_response_length: int = 32
    train_batch_size: int = 16  # global, in prompts
    truncation: str = "error"  # error | left | right: what to do with a prompt over max_prompt_length


@dataclass
class TrainerSection:
    """verl ``trainer``: the world (nodes x GPUs), the step count, logging, the checkpoint."""

    n_gpus_per_node: int = 1
    nnodes: int = 1
    total_training_steps: int = 3
    project_name: str = "ppotune"
    experiment_name: str = "run"
    logger: list = field(default_factory=lambda: ["console"])
    default_local_dir: Optional[str] = None  # where the final HF checkpoint goes; None -> no save
    seed: int = 1


@dataclass
class TinyModelConfig:
    """Shape of the embedded model (a Qwen2 built from config, random init)."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    # head size 32: vLLM's CPU attention kernels take head sizes 32, 64, 80, 96, 112, 128, ... (not 16)
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    intermediate_size: int = 128


@dataclass
class SyntheticDataConfig:
    """The embedded arithmetic task. Prompt lengths follow a Pareto (heavy right tail)."""

    num_prompts: int = 1024
    min_terms: int = 2
    max_terms: int = 16
    length_alpha: float = 1.2  # Pareto shape: smaller -> heavier tail of long prompts
    seed: int = 0


@dataclass
class PPOTuneSection:
    """Keys verl does not have."""

    device: str = "auto"  # auto | cpu | cuda
    warmup_steps: int = 0  # leading steps excluded from the result summary
    # profile this step (1-based) with torch.profiler: rank 0 prints where its time went, operator by
    # operator; the step is left out of the summary (the profiler slows it). 0: off
    profile_step: int = 0
    # A trial's measurement (`ppotune search` sets these; a training run leaves them off): stop before
    # total_training_steps once the 90% interval of the per-step throughput is within +/- precision of
    # its median (after min_measured_steps), or once a point of `front` ([trial, throughput low, peak GB],
    # what the study measured) beats this trial for sure at no more memory. None: run every step.
    precision: Optional[float] = None
    min_measured_steps: int = 3
    front: list = field(default_factory=list)
    memory_limit_gb: Optional[float] = None  # a real cap per process (GPU fraction / CPU rlimit)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    wandb: bool = False
    dist_timeout_s: int = 600
    # vLLM on a CPU reads gpu_memory_utilization as a fraction of the whole machine's memory. The ppotune
    # engine sizes each rank's engine from this budget instead: KV cache = utilization x budget - weights.
    vllm_cpu_memory_gb: float = 1.0
    # Test hook that makes a real failure happen in the ranks (not a simulation):
    # none | hang (rank 1 never joins a collective) | crash (rank 1 SIGKILLs itself mid-step)
    fault: str = "none"
    # The worst-case-length probe (`ppotune probe`, tuner/trials/probe.py): every prompt is data.max_prompt_length
    # real tokens (each prompt's own tokens repeated from the left, after the chat template and truncation:
    # no pad token, which remove-padding would drop) and every response data.max_response_length tokens
    # (EOS cannot be sampled, HF min_new_tokens / vLLM min_tokens + ignore_eos), so every batch is the
    # longest the config admits and the token budgets fill as far as the trainer's packing allows.
    # The updates train on that synthetic batch: a probe saves no checkpoint.
    worst_case: bool = False


@dataclass
class PPOConfig:
    """The whole config: verl's sections plus ``ppotune``."""

    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    ppotune: PPOTuneSection = field(default_factory=PPOTuneSection)


def world_size(cfg: PPOConfig) -> int:
    """The number of ranks: ``trainer.n_gpus_per_node x trainer.nnodes``."""
    return cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes


#: The advantage estimators that read the critic's values (verl: only GAE).
CRITIC_ESTIMATORS = ("gae",)


def need_critic(cfg: PPOConfig) -> bool:
    """verl's ``need_critic``: ``critic.enable`` when set, else whether the estimator reads values (gae)."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS


def need_reference_policy(cfg: PPOConfig) -> bool:
    """verl's ``need_reference_policy``: the reference model's log-probs are read by the KL in the reward
    (``algorithm.use_kl_in_reward``) or the KL loss (``actor_rollout_ref.actor.use_kl_loss``)."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss
