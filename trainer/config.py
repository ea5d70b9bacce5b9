"""The typed, validated training config: one place for every default.

Keys are verl's keys (``python -m verl.trainer.main_ppo``) for every concept verl
has; keys verl lacks live under ``ppotune.``. The module is pure Python (no torch)
so the tuner can validate a trial's config before launching anything.

A config is built from defaults <- YAML file <- dotted ``key=value`` overrides, then
checked: unknown keys, wrong types and contradictions raise :class:`ConfigError`
naming the key.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

__all__ = [
    "ConfigError",
    "PPOConfig",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "apply_overrides",
    "parse_override",
    "flatten",
    "unflatten",
    "world_size",
    "FOLLOWS",
    "follow",
    "resolve_follows",
    "effective_config",
    "validate_config",
    "read_yaml_mapping",
    "FSDP_SECTIONS",
    "PRECISIONS",
    "verl_override_key",
]


class ConfigError(ValueError):
    """Bad user config. ``str()`` is one line naming the file (if any) and the key."""

    def __init__(self, key: str, message: str, *, source: Optional[str] = None):
        self.key = key
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {message}")


# --------------------------------------------------------------------------- sections
@dataclass
class WrapPolicyConfig:
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
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
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
    log_prob_micro_batch_size_per_gpu: Optional[int] = 4
    log_prob_use_dynamic_bsz: Optional[bool] = None  # None -> actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # None -> actor.ppo_max_token_len_per_gpu
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RolloutConfig:
    name: str = "hf"  # hf (transformers generate on the FSDP actor) | vllm
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
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # None -> actor_rollout_ref.model.path
    enable_gradient_checkpointing: bool = True
    enable_activation_offload: bool = False
    use_remove_padding: bool = True


@dataclass
class CriticConfig:
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
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # kl (k1) | abs | mse (k2) | low_var_kl (k3)
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)


@dataclass
class DataConfig:
    train_files: Optional[str] = None  # verl parquet; None -> the embedded synthetic task
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    max_response_length: int = 32
    train_batch_size: int = 16  # global, in prompts
    truncation: str = "error"  # error | left | right: what to do with a prompt over max_prompt_length


@dataclass
class TrainerSection:
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
    # The worst-case-length probe (`ppotune probe`, tuner/stages/probe.py): every prompt is data.max_prompt_length
    # real tokens (each prompt's own tokens repeated from the left, after the chat template and truncation:
    # no pad token, which remove-padding would drop) and every response data.max_response_length tokens
    # (EOS cannot be sampled, HF min_new_tokens / vLLM min_tokens + ignore_eos), so every batch is the
    # longest the config admits and the token budgets fill as far as the trainer's packing allows.
    # The updates train on that synthetic batch: a probe saves no checkpoint.
    worst_case: bool = False


@dataclass
class PPOConfig:
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    ppotune: PPOTuneSection = field(default_factory=PPOTuneSection)


# --------------------------------------------------------------------------- (de)serialising
def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a.b.c": value}. Lists are leaves."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any, source: Optional[str]) -> Any:
    """Check ``value`` against the annotated type; ints widen to floats, nothing else converts."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, args[0], source)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list or origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
    else:  # pragma: no cover - internal invariant
        raise AssertionError(f"unsupported field type {tp} for {key}")
    raise ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}", source=source)


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict:
    """The config dataclass's resolved field types (resolving them is most of building a config: the tuner
    builds one per candidate)."""
    return typing.get_type_hints(cls)


def _build(cls: type, data: Any, prefix: str, source: Optional[str]) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(
            prefix.rstrip(".") or "<root>", f"expected a mapping, got {type(data).__name__}", source=source
        )
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{prefix}{k}", RETIRED.get(k, "unknown key"), source=source)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name], key + ".", source)
        else:
            kwargs[f.name] = _coerce(key, data[f.name], tp, source)
    return cls(**kwargs)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=3"`` -> ``("a.b", 3)``; values are parsed as YAML scalars (true, 1e-3, null, [1,2])."""
    if "=" not in text:
        raise ConfigError(text, "override must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict, overrides: dict) -> dict:
    """Dotted overrides onto a nested dict (the result is a new dict)."""
    return _deep_merge(data, unflatten(overrides))


def config_from_dict(data: dict, *, source: Optional[str] = None, validate: bool = True) -> PPOConfig:
    cfg = _build(PPOConfig, data or {}, "", source)
    if validate:
        validate_config(cfg, source=source)
    return cfg


def read_yaml_mapping(path: str | Path, *, what: str = "the config") -> dict:
    """A YAML file that must hold a mapping; ConfigError (naming the file) when missing or malformed."""
    source = str(path)
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", "file not found", source=source)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "?"
        raise ConfigError("config", f"malformed YAML at {where}", source=source) from None
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"{what} must be a mapping", source=source)
    return data


def load_config(
    path: Optional[str | Path] = None,
    overrides: Optional[list[str] | dict] = None,
    *,
    validate: bool = True,
) -> PPOConfig:
    """YAML file (optional) + dotted overrides -> a validated :class:`PPOConfig`."""
    source = str(path) if path is not None else None
    data = read_yaml_mapping(path) if path is not None else {}
    if overrides:
        if isinstance(overrides, dict):
            flat = dict(overrides)
        else:
            flat = dict(parse_override(o) for o in overrides)
        data = apply_overrides(data, flat)
    return config_from_dict(data, source=source, validate=validate)


# --------------------------------------------------------------------------- validation
def world_size(cfg: PPOConfig) -> int:
    return cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes


_CHOICES = {
    "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2"),
    "critic.strategy": (None, "fsdp", "fsdp2"),
    "actor_rollout_ref.actor.loss_agg_mode": ("token-mean",),
    "actor_rollout_ref.actor.kl_loss_type": ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"),
    "algorithm.kl_penalty": ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.adv_estimator": ("gae",),
    "actor_rollout_ref.rollout.name": ("hf", "vllm"),
    "actor_rollout_ref.rollout.dtype": ("bfloat16", "float16", "float32"),  # vLLM's spellings
    "data.truncation": ("error", "left", "right"),
    "ppotune.device": ("auto", "cpu", "cuda"),
    "ppotune.fault": ("none", "hang", "crash"),
}

#: The FSDP sections (verl's spelling): the actor's, the reference model's and the critic's.
FSDP_SECTIONS = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp")
_DTYPE_KEYS = (
    "model_dtype",
    "mixed_precision.param_dtype",
    "mixed_precision.reduce_dtype",
    "mixed_precision.buffer_dtype",
)

#: verl's precision spellings (PrecisionType) that the ppotune engine runs -> torch dtype name.
PRECISIONS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}

#: Sections verl's FSDP engine reads but its YAML does not declare: Hydra adds them with ``+key=value``.
VERL_UNDECLARED = ("mixed_precision", "enable_sleep_mode")


def verl_override_key(key: str) -> str:
    """``key`` as a verl Hydra override spells it: ``+`` in front of a key verl's YAML does not declare."""
    return ("+" + key) if any(part in VERL_UNDECLARED for part in key.split(".")) else key


#: Keys that are gone, with what to use instead (an old config gets this line, not "unknown key").
RETIRED = {
    "dtype": "verl's FSDP engine computes in fsdp_config.mixed_precision.param_dtype (bf16 | fp32); set that",
}

_POSITIVE_INTS = [
    "data.max_prompt_length",
    "data.max_response_length",
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "critic.ppo_max_token_len_per_gpu",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "trainer.total_training_steps",
    "ppotune.tiny.hidden_size",
    "ppotune.tiny.num_hidden_layers",
    "ppotune.tiny.num_attention_heads",
    "ppotune.tiny.num_key_value_heads",
    "ppotune.tiny.intermediate_size",
    "ppotune.synthetic.num_prompts",
    "ppotune.synthetic.min_terms",
    "actor_rollout_ref.actor.entropy_from_logits_chunk_size",
    *(f"{section}.pad_to_length_bucket" for section in FSDP_SECTIONS),
]


#: Keys whose ``None`` default means "the value of another key" (verl's null defaults): key -> the key it follows.
FOLLOWS: dict[str, str] = {
    "critic.strategy": "actor_rollout_ref.actor.strategy",
    "critic.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "critic.use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "critic.forward_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
    "critic.ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
    "critic.model.path": "actor_rollout_ref.model.path",
    "actor_rollout_ref.actor.clip_ratio_low": "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_high": "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
}


def follow(flat: Mapping[str, Any], key: str) -> Any:
    """The effective value of ``key`` in a flat config: a null follow-key reads as the key it follows."""
    value = flat[key]
    while value is None and key in FOLLOWS:
        key = FOLLOWS[key]
        value = flat[key]
    return value


def resolve_follows(flat: Mapping[str, Any]) -> dict:
    """A copy of a flat config with every null follow-key (:data:`FOLLOWS`) filled in."""
    out = dict(flat)
    for key in FOLLOWS:
        out[key] = follow(flat, key)
    return out


def effective_config(cfg: PPOConfig) -> PPOConfig:
    """The typed config a run actually uses: every null follow-key filled in (``cfg`` is unchanged)."""
    return config_from_dict(unflatten(resolve_follows(flatten(config_to_dict(cfg)))), validate=False)


def validate_config(cfg: PPOConfig, *, source: Optional[str] = None) -> None:
    """Refuse contradictions, naming the key. verl's own checks, plus ours."""
    flat = flatten(config_to_dict(cfg))
    eff = resolve_follows(flat)
    get = eff.__getitem__

    def fail(key: str, msg: str) -> None:
        raise ConfigError(key, msg, source=source)

    for key, choices in _CHOICES.items():
        if flat[key] not in choices:
            fail(key, f"must be one of {[c for c in choices if c is not None]}, got {flat[key]!r}")
    for key in _POSITIVE_INTS:
        if flat[key] <= 0:
            fail(key, f"must be > 0, got {flat[key]}")
    for key in (
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu",
        "critic.forward_micro_batch_size_per_gpu",
    ):
        if flat[key] is not None and flat[key] <= 0:
            fail(key, f"must be > 0, got {flat[key]}")

    ws = world_size(cfg)
    n = cfg.actor_rollout_ref.rollout.n
    total_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.data.train_batch_size * n % ws:
        fail(
            "data.train_batch_size",
            f"train_batch_size x rollout.n = {cfg.data.train_batch_size * n} is not divisible by the world size {ws}",
        )

    def check_ppo(prefix: str, mini: int, micro: Optional[int], dyn: bool, budget_key: str) -> None:
        mini_key = f"{prefix}.ppo_mini_batch_size"
        micro_key = f"{prefix}.ppo_micro_batch_size_per_gpu"
        if mini <= 0:
            fail(mini_key, f"must be > 0, got {mini}")
        if cfg.data.train_batch_size % mini:
            fail(mini_key, f"{mini} does not divide data.train_batch_size={cfg.data.train_batch_size}")
        if mini * n % ws:
            fail(mini_key, f"ppo_mini_batch_size x rollout.n = {mini * n} is not divisible by the world size {ws}")
        mini_per_gpu = mini * n // ws
        if dyn:
            if get(budget_key) < total_len:
                fail(budget_key, f"{get(budget_key)} is below max_prompt_length + max_response_length = {total_len}")
        else:
            if micro is None:
                fail(micro_key, "must be set when use_dynamic_bsz is false")
            if mini_per_gpu % micro:
                fail(
                    micro_key,
                    f"{micro} does not divide the per-GPU mini-batch "
                    f"ppo_mini_batch_size x rollout.n / world_size = {mini_per_gpu}",
                )

    a = cfg.actor_rollout_ref.actor
    check_ppo(
        "actor_rollout_ref.actor",
        a.ppo_mini_batch_size,
        a.ppo_micro_batch_size_per_gpu,
        a.use_dynamic_bsz,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    )
    c = cfg.critic
    check_ppo(
        "critic",
        get("critic.ppo_mini_batch_size"),
        c.ppo_micro_batch_size_per_gpu,
        get("critic.use_dynamic_bsz"),
        "critic.ppo_max_token_len_per_gpu",
    )

    for prefix in ("actor_rollout_ref.ref", "actor_rollout_ref.rollout"):
        if get(f"{prefix}.log_prob_use_dynamic_bsz"):
            key = f"{prefix}.log_prob_max_token_len_per_gpu"
            if get(key) < total_len:
                fail(key, f"{get(key)} is below max_prompt_length + max_response_length = {total_len}")
        elif flat[f"{prefix}.log_prob_micro_batch_size_per_gpu"] is None:
            fail(f"{prefix}.log_prob_micro_batch_size_per_gpu", "must be set when log_prob_use_dynamic_bsz is false")
    if get("critic.use_dynamic_bsz"):
        if get("critic.forward_max_token_len_per_gpu") < total_len:
            fail(
                "critic.forward_max_token_len_per_gpu",
                f"{get('critic.forward_max_token_len_per_gpu')} is below "
                f"max_prompt_length + max_response_length = {total_len}",
            )
    elif get("critic.forward_micro_batch_size_per_gpu") is None:
        fail("critic.forward_micro_batch_size_per_gpu", "must be set when use_dynamic_bsz is false")

    for key in ("actor_rollout_ref.actor.clip_ratio", "critic.cliprange_value"):
        if flat[key] <= 0:
            fail(key, f"must be > 0, got {flat[key]}")
    if a.clip_ratio_c <= 1.0:
        fail("actor_rollout_ref.actor.clip_ratio_c", f"dual-clip bound must be > 1.0, got {a.clip_ratio_c}")
    if not 0.0 <= cfg.algorithm.gamma <= 1.0:
        fail("algorithm.gamma", f"must be in [0, 1], got {cfg.algorithm.gamma}")
    if not 0.0 <= cfg.algorithm.lam <= 1.0:
        fail("algorithm.lam", f"must be in [0, 1], got {cfg.algorithm.lam}")
    if not 0.0 < cfg.actor_rollout_ref.rollout.top_p <= 1.0:
        fail("actor_rollout_ref.rollout.top_p", "must be in (0, 1]")
    if cfg.actor_rollout_ref.rollout.temperature < 0:
        fail("actor_rollout_ref.rollout.temperature", "must be >= 0")
    _check_rollout(cfg.actor_rollout_ref.rollout, total_len, fail)
    if cfg.ppotune.vllm_cpu_memory_gb <= 0:
        fail("ppotune.vllm_cpu_memory_gb", "must be > 0")
    if cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.algorithm.kl_ctrl.horizon <= 0:
        fail("algorithm.kl_ctrl.horizon", "must be > 0 for the adaptive controller")
    if cfg.ppotune.warmup_steps < 0 or cfg.ppotune.warmup_steps >= cfg.trainer.total_training_steps:
        fail(
            "ppotune.warmup_steps",
            f"must be in [0, total_training_steps={cfg.trainer.total_training_steps}), got {cfg.ppotune.warmup_steps}",
        )
    if not 0 <= cfg.ppotune.profile_step <= cfg.trainer.total_training_steps:
        fail(
            "ppotune.profile_step",
            f"must be 0 (off) or a step in [1, total_training_steps={cfg.trainer.total_training_steps}], "
            f"got {cfg.ppotune.profile_step}",
        )
    if cfg.ppotune.precision is not None and not 0 < cfg.ppotune.precision < 1:
        fail("ppotune.precision", f"must be in (0, 1) (a share of the median) or null, got {cfg.ppotune.precision}")
    if cfg.ppotune.min_measured_steps < 2:
        fail(
            "ppotune.min_measured_steps",
            f"must be >= 2 (an interval needs two steps), got {cfg.ppotune.min_measured_steps}",
        )
    if any(
        not isinstance(p, (list, tuple)) or len(p) != 3 or not all(isinstance(x, (int, float)) for x in p)
        for p in cfg.ppotune.front
    ):
        fail("ppotune.front", "must be a list of [trial, throughput, peak_memory_gb] number triples")
    if cfg.ppotune.memory_limit_gb is not None and cfg.ppotune.memory_limit_gb <= 0:
        fail("ppotune.memory_limit_gb", "must be > 0")
    if cfg.ppotune.worst_case and cfg.trainer.default_local_dir:
        fail(
            "ppotune.worst_case",
            "a worst-case probe trains on forced-length batches: it saves no checkpoint "
            "(unset trainer.default_local_dir)",
        )
    t = cfg.ppotune.tiny
    if t.hidden_size % t.num_attention_heads:
        fail("ppotune.tiny.num_attention_heads", f"must divide hidden_size={t.hidden_size}")
    if t.num_attention_heads % t.num_key_value_heads:
        fail("ppotune.tiny.num_key_value_heads", f"must divide num_attention_heads={t.num_attention_heads}")
    s = cfg.ppotune.synthetic
    if s.max_terms < s.min_terms:
        fail("ppotune.synthetic.max_terms", f"must be >= min_terms={s.min_terms}")
    if s.length_alpha <= 0:
        fail("ppotune.synthetic.length_alpha", "must be > 0")
    for section in FSDP_SECTIONS:
        _check_fsdp_section(flat, section, get("critic.strategy") if section == "critic.fsdp" else a.strategy, ws, fail)
    if a.ulysses_sequence_parallel_size != 1:
        fail(
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            "sequence parallelism is not implemented by the ppotune engine; measure it with --engine verl",
        )
    if cfg.data.train_files is not None:
        for f in cfg.data.train_files.split(","):
            if not Path(f).expanduser().is_file():
                fail("data.train_files", f"file not found: {f}")
    for key in ("actor_rollout_ref.model.path", "critic.model.path"):
        path = get(key)
        if path != "tiny" and not Path(path).expanduser().is_dir():
            fail(key, f"not 'tiny' and not a local HF checkpoint directory: {path}")


def _check_fsdp_section(flat: Mapping[str, Any], section: str, strategy: str, ws: int, fail) -> None:
    """One FSDP section's knobs: precisions, offload combinations, shard group size."""
    for leaf in _DTYPE_KEYS:
        key, value = f"{section}.{leaf}", flat[f"{section}.{leaf}"]
        if value in ("fp16", "float16"):
            fail(
                key,
                "fp16 needs loss scaling (verl's ShardedGradScaler), which the ppotune engine does not run; use bf16",
            )
        if value not in PRECISIONS:
            fail(key, f"must be one of {sorted(PRECISIONS)}, got {value!r}")
    if flat[f"{section}.offload_policy"]:
        if strategy != "fsdp2":
            fail(f"{section}.offload_policy", "offload_policy is an FSDP2 option; set the strategy to fsdp2")
        for other in ("param_offload", "optimizer_offload"):
            if flat[f"{section}.{other}"]:
                fail(
                    f"{section}.{other}",
                    "cannot act with offload_policy (parameters, gradients and the optimizer step already live "
                    "in host memory); set one of the two",
                )
    size = flat[f"{section}.fsdp_size"]
    if size != -1 and (size <= 0 or ws % size):
        fail(f"{section}.fsdp_size", f"must be -1 (all ranks) or a positive divisor of the world size {ws}, got {size}")


def _check_rollout(ro, total_len: int, fail) -> None:
    """The vLLM engine's knobs, with the checks vLLM makes at start-up (so a search never launches them)."""
    key = "actor_rollout_ref.rollout."
    if not 0.0 < ro.gpu_memory_utilization <= 1.0:
        fail(key + "gpu_memory_utilization", "must be in (0, 1]")
    if ro.tensor_model_parallel_size != 1:
        fail(
            key + "tensor_model_parallel_size",
            "the ppotune engine runs one vLLM engine per rank (tensor parallel 1); measure TP > 1 with --engine verl",
        )
    max_len = ro.max_model_len if ro.max_model_len is not None else total_len
    if max_len < total_len:
        fail(key + "max_model_len", f"{max_len} is below max_prompt_length + max_response_length = {total_len}")
    if ro.max_num_batched_tokens < ro.max_num_seqs:
        fail(
            key + "max_num_batched_tokens",
            f"{ro.max_num_batched_tokens} is below max_num_seqs={ro.max_num_seqs} (vLLM schedules at least one token "
            "per running sequence)",
        )
    if not ro.enable_chunked_prefill and ro.max_num_batched_tokens < max_len:
        fail(
            key + "max_num_batched_tokens",
            f"{ro.max_num_batched_tokens} is below max_model_len={max_len}: without enable_chunked_prefill vLLM "
            "prefills a whole prompt in one step",
        )
