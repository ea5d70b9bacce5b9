"""The keys a search space may vary: per-GPU execution knobs whose invariance is tested, and the rollout engine's.

A tuned knob never changes the algorithm (global batch sizes, epochs, clip ratios, KL and the learning rate are the
base config's): the trials of a study are compared as runs of one algorithm, and the winner is exported as such.
This is the one list of what may vary (a knob or a derived key); :func:`tuner.space.load.space_from_dict` refuses
any other key in one line, unless the space marks the knob ``algorithm: true`` on purpose, and then the report and
why.md say in their first lines that the compared trials ran different algorithms (:func:`algorithm_knobs`).

Each entry names its evidence (``proof``): ``invariance:<variant>``, a knob variant of
``tests/trainer/invariance.py`` (one PPO update gives the same parameters, gradients and statistics under it);
``engine:<variant>``, a rollout-engine variant of ``tests/trainer/engine/test_vllm_rollout.py``;
``test:<file>::<name>``, another test. ``tests/tuner/space/test_registry_proofs.py`` checks that every named
variant exists and sets its key, and that every knob the invariance variants vary is listed here. The rollout
engine's knobs size the engine (KV cache, scheduler, compile, sleep): they change how fast rollouts come, not the
PPO update.

The ``kind`` is what the space loader checks of a knob's range (:func:`range_problem`): a micro-batch is >= 1, a
token budget holds the longest sequence the data admits, a fraction is in (0, 1], a count is >= 1, a shard group
is -1 (all ranks) or >= 1. Pure Python (no torch): the tuner imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

__all__ = [
    "KnobKind",
    "ExecutionKnob",
    "EXECUTION_KNOBS",
    "TOKEN_BUDGET_LIMIT_KEYS",
    "is_execution_knob",
    "range_problem",
    "longest_sequence",
    "algorithm_knobs",
    "ALGORITHM_NOTE",
    "VerlNoOp",
    "VERL_NO_OPS",
    "verl_no_op_problem",
]

KnobKind = Literal[
    "micro_batch", "token_budget", "fraction", "count", "positive", "shard_group", "flag", "choice", "fault"
]


@dataclass(frozen=True)
class ExecutionKnob:
    key: str
    kind: KnobKind
    proof: str  # invariance:<variant> | engine:<variant> | test:<file>::<function> | rollout | fault
    role: str  # what it is, in a few words


_ACTOR, _CRITIC = "actor_rollout_ref.actor", "critic"
_REF, _ROLLOUT = "actor_rollout_ref.ref", "actor_rollout_ref.rollout"
_FSDP_SECTIONS = (f"{_ACTOR}.fsdp_config", f"{_CRITIC}.fsdp", f"{_REF}.fsdp_config")


_LOGITS = "test:tests/trainer/engine/test_logits.py::test_pad_to_length_changes_no_output"

#: (key, kind, proof, role): the per-GPU execution knobs, each with the invariance variant that varies it
_KNOBS: tuple[tuple[str, KnobKind, str, str], ...] = (
    # per-GPU batching: how a rank's share of the batch is cut into micro-batches
    (f"{_ACTOR}.ppo_micro_batch_size_per_gpu", "micro_batch", "invariance:micro_batch_1", "actor update micro-batch"),
    (f"{_CRITIC}.ppo_micro_batch_size_per_gpu", "micro_batch", "invariance:micro_batch_1", "critic update micro-batch"),
    (f"{_CRITIC}.forward_micro_batch_size_per_gpu", "micro_batch", "invariance:forward_micro_batch_1", "values pass"),
    (f"{_REF}.log_prob_micro_batch_size_per_gpu", "micro_batch", "invariance:forward_micro_batch_1", "ref pass"),
    (f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu", "micro_batch", "invariance:forward_micro_batch_1", "old logprob"),
    (f"{_ACTOR}.use_dynamic_bsz", "flag", "invariance:dynamic_bsz_96", "token-budget micro-batches"),
    (f"{_CRITIC}.use_dynamic_bsz", "flag", "invariance:dynamic_bsz_96", "token-budget micro-batches"),
    (f"{_REF}.log_prob_use_dynamic_bsz", "flag", "invariance:dynamic_bsz_96", "token-budget micro-batches"),
    (f"{_ROLLOUT}.log_prob_use_dynamic_bsz", "flag", "invariance:dynamic_bsz_96", "token-budget micro-batches"),
    (f"{_ACTOR}.ppo_max_token_len_per_gpu", "token_budget", "invariance:dynamic_bsz_96", "actor update budget"),
    (f"{_CRITIC}.ppo_max_token_len_per_gpu", "token_budget", "invariance:dynamic_bsz_96", "critic update budget"),
    (f"{_CRITIC}.forward_max_token_len_per_gpu", "token_budget", "invariance:dynamic_bsz_forward_96", "values pass"),
    (f"{_REF}.log_prob_max_token_len_per_gpu", "token_budget", "invariance:dynamic_bsz_forward_96", "ref pass"),
    (f"{_ROLLOUT}.log_prob_max_token_len_per_gpu", "token_budget", "invariance:dynamic_bsz_forward_96", "old logprob"),
    # activation memory
    ("actor_rollout_ref.model.enable_gradient_checkpointing", "flag", "invariance:gradient_checkpointing", "memory"),
    (f"{_CRITIC}.model.enable_gradient_checkpointing", "flag", "invariance:gradient_checkpointing", "memory"),
    ("actor_rollout_ref.model.enable_activation_offload", "flag", "invariance:activation_offload", "memory"),
    (f"{_CRITIC}.model.enable_activation_offload", "flag", "invariance:activation_offload", "memory"),
    ("actor_rollout_ref.model.use_remove_padding", "flag", "invariance:padded", "packed micro-batches"),
    (f"{_CRITIC}.model.use_remove_padding", "flag", "invariance:padded", "packed micro-batches"),
    (f"{_ACTOR}.entropy_from_logits_with_chunking", "flag", "invariance:entropy_chunked", "entropy memory"),
    (f"{_ACTOR}.entropy_from_logits_chunk_size", "count", "invariance:entropy_chunked", "entropy memory"),
    (f"{_ACTOR}.entropy_checkpointing", "flag", "invariance:entropy_checkpointing", "entropy memory"),
    (f"{_ACTOR}.use_torch_compile", "flag", "invariance:entropy_compiled", "compiled entropy"),
    (f"{_ACTOR}.pad_to_length", "flag", _LOGITS, "padded packed micro-batches"),
    (f"{_ACTOR}.fsdp_config.pad_to_length_bucket", "count", _LOGITS, "padded packed micro-batches"),
    # sharding
    (f"{_ACTOR}.strategy", "choice", "invariance:fsdp2", "FSDP1 or FSDP2"),
    (f"{_CRITIC}.strategy", "choice", "invariance:fsdp2", "FSDP1 or FSDP2"),
)
#: an FSDP section's knobs: (name, kind, proof); the ref's section has only those the suite varies for it too
_FSDP_KNOBS: tuple[tuple[str, KnobKind, str], ...] = (
    ("param_offload", "flag", "invariance:param_offload"),
    ("optimizer_offload", "flag", "invariance:optimizer_offload"),
    ("offload_policy", "flag", "invariance:fsdp2_offload_policy"),
    ("forward_prefetch", "flag", "invariance:forward_prefetch"),
    ("reshard_after_forward", "flag", "invariance:no_reshard_after_forward"),
    ("use_no_sync_for_gradient_accumulation", "flag", "invariance:no_sync"),
    ("fsdp_size", "shard_group", "invariance:hybrid"),
    ("mixed_precision.param_dtype", "choice", "invariance:bf16_base"),
)
_REF_FSDP_KNOBS = ("fsdp_size", "mixed_precision.param_dtype")
#: the rollout engine (vLLM colocated with the actor): it sizes the engine and how fast rollouts come
_ROLLOUT_KNOBS: tuple[tuple[str, KnobKind, str], ...] = (
    (f"{_ROLLOUT}.name", "choice", "engine:vllm_small"),
    (f"{_ROLLOUT}.gpu_memory_utilization", "fraction", "engine:vllm_small"),
    (f"{_ROLLOUT}.max_num_seqs", "count", "engine:vllm_small"),
    (f"{_ROLLOUT}.max_num_batched_tokens", "count", "engine:vllm_small"),
    (f"{_ROLLOUT}.enable_chunked_prefill", "flag", "engine:vllm_small"),
    (f"{_ROLLOUT}.enable_prefix_caching", "flag", "engine:vllm_large"),
    (f"{_ROLLOUT}.enforce_eager", "flag", "rollout"),
    (f"{_ROLLOUT}.free_cache_engine", "flag", "rollout"),
    (f"{_ROLLOUT}.enable_sleep_mode", "flag", "rollout"),
    (f"{_ROLLOUT}.tensor_model_parallel_size", "count", "rollout"),
    ("ppotune.vllm_cpu_memory_gb", "positive", "engine:vllm_small"),
)


def _entries() -> list[ExecutionKnob]:
    rows = [ExecutionKnob(*row) for row in _KNOBS]
    for section in _FSDP_SECTIONS:
        for name, kind, proof in _FSDP_KNOBS:
            if section != f"{_REF}.fsdp_config" or name in _REF_FSDP_KNOBS:
                rows.append(ExecutionKnob(f"{section}.{name}", kind, proof, f"FSDP {name}"))
    rows += [ExecutionKnob(key, kind, proof, "rollout engine") for key, kind, proof in _ROLLOUT_KNOBS]
    # ppotune's own fault hook (none | crash | hang | oom): the tests' way to make a trial fail on purpose
    rows.append(ExecutionKnob("ppotune.fault", "fault", "fault", "a test's injected failure"))
    return rows


#: every key a space may vary (a knob or a derived key), with its kind and evidence
EXECUTION_KNOBS: dict[str, ExecutionKnob] = {k.key: k for k in _entries()}

#: what bounds a token budget from below: the longest sequence a batch may hold
TOKEN_BUDGET_LIMIT_KEYS = ("data.max_prompt_length", "data.max_response_length")

#: the first line the report and why.md show for a study whose space marked algorithm knobs
ALGORITHM_NOTE = "The compared trials ran different algorithms"


@dataclass(frozen=True)
class VerlNoOp:
    """A key ppotune's engine applies that verl 0.9.1 never reads on the trainer path a verl trial runs (v1, its
    default), the key that acts there instead, and where verl decides it (``docs/verl_parity.md``, the knob table)."""

    key: str
    acts: str  # the verl key that acts instead (set it in the run file: a verl space cannot name it)
    why: str  # where verl 0.9.1 decides it


_CRITIC_ENGINE = "the critic is a TrainingWorker on its engine config critic.fsdp (workers/config/critic.py:"
#: the keys a space may not vary under ``--engine verl``: verl 0.9.1 does not read them
VERL_NO_OPS: dict[str, VerlNoOp] = {
    n.key: n
    for n in (
        VerlNoOp(
            f"{_CRITIC}.ppo_micro_batch_size_per_gpu",
            f"{_CRITIC}.fsdp.micro_batch_size_per_gpu",
            f"{_CRITIC_ENGINE}FSDPCriticConfig.__post_init__); workers/engine_workers.py:TrainingWorker.train_batch "
            "takes its micro-batch from there, never from this key",
        ),
        VerlNoOp(
            f"{_CRITIC}.forward_micro_batch_size_per_gpu",
            f"{_CRITIC}.fsdp.infer_micro_batch_size_per_gpu",
            f"{_CRITIC_ENGINE}FSDPCriticConfig.__post_init__); workers/engine_workers.py:TrainingWorker.infer_batch "
            "takes its micro-batch from there",
        ),
        VerlNoOp(
            f"{_CRITIC}.use_dynamic_bsz",
            f"{_CRITIC}.fsdp.use_dynamic_bsz",
            f"{_CRITIC_ENGINE}FSDPCriticConfig.__post_init__), whose use_dynamic_bsz defaults to true "
            "(workers/config/engine.py:EngineConfig) and is never set from this key",
        ),
        VerlNoOp(
            f"{_CRITIC}.forward_max_token_len_per_gpu",
            f"{_CRITIC}.ppo_infer_max_token_len_per_gpu",
            "the values pass's budget is critic.ppo_infer_max_token_len_per_gpu "
            "(trainer/ppo/v1/trainer_base.py:PPOTrainer._setup)",
        ),
        VerlNoOp(
            f"{_CRITIC}.ppo_max_token_len_per_gpu",
            f"{_CRITIC}.ppo_infer_max_token_len_per_gpu",
            "its default trainer (trainer.use_v1: true) sets both of the critic's budgets from "
            "critic.ppo_infer_max_token_len_per_gpu (trainer/ppo/v1/trainer_base.py:PPOTrainer._setup)",
        ),
    )
}


def verl_no_op_problem(keys: Any) -> Optional[str]:
    """Why a space that varies ``keys`` (its knobs and derived keys) cannot search verl: the first key of
    :data:`VERL_NO_OPS` among them, with the key that acts instead; None when every key acts."""
    for key in keys:
        no_op = VERL_NO_OPS.get(key)
        if no_op is not None:
            return (
                f"{key}: verl 0.9.1 does not read it ({no_op.why}); the key that acts is {no_op.acts}: "
                "set it in the run file"
            )
    return None


def is_execution_knob(key: str) -> bool:
    return key in EXECUTION_KNOBS


def longest_sequence(base_flat: Mapping[str, Any]) -> Optional[int]:
    """The longest sequence the data admits: ``data.max_prompt_length + data.max_response_length``."""
    try:
        return int(sum(int(base_flat[k]) for k in TOKEN_BUDGET_LIMIT_KEYS))
    except (KeyError, TypeError, ValueError):
        return None


def range_problem(key: str, value: Any, *, longest: Optional[int] = None) -> Optional[str]:
    """Why ``value`` is out of range for the execution knob ``key`` (None: in range, or nothing to check).
    ``longest``: :func:`longest_sequence` of the base config, for token budgets."""
    knob = EXECUTION_KNOBS.get(key)
    if knob is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if knob.kind in ("micro_batch", "count") and value < 1:
        why = " (a micro-batch holds whole sequences)" if knob.kind == "micro_batch" else ""
        return f"{value!r} is below 1{why}"
    if knob.kind == "positive" and not (value > 0 and math.isfinite(value)):
        return f"{value!r} is not positive"
    if knob.kind == "shard_group" and value != -1 and value < 1:
        return f"{value!r}: a shard group is -1 (all ranks) or a positive number of ranks"
    if knob.kind == "fraction" and not (0 < value <= 1 and math.isfinite(value)):
        return f"{value!r} is not a fraction in (0, 1]"
    if knob.kind == "token_budget":
        if value < 1:
            return f"{value!r} is below 1 token"
        if longest is not None and value < longest:
            return (
                f"{value!r} tokens is below the longest sequence the data admits ({longest} = "
                f"{' + '.join(TOKEN_BUDGET_LIMIT_KEYS)}): verl refuses such a budget"
            )
    return None


def algorithm_knobs(space: Any) -> list[str]:
    """The knobs and derived keys a stored space (the study's ``space`` attribute: the YAML as a dict) marks
    ``algorithm: true``. Anything malformed reads as no mark (the caller validates the study's attributes)."""
    out: list[str] = []
    for section in ("knobs", "derived"):
        entries = space.get(section) if isinstance(space, dict) else None
        if isinstance(entries, dict):
            out += [str(k) for k, spec in entries.items() if isinstance(spec, dict) and spec.get("algorithm") is True]
    return out
