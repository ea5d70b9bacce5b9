"""The size knobs a base config uses, each with its ladder: the values ``ppotune fit`` may give it.

Per role, the knob that sizes each pass's micro-batches, as the config sets it (fixed micro-batches or token
budgets: ``use_dynamic_bsz`` and the log-prob passes' ``log_prob_use_dynamic_bsz``, followed as verl follows them):

=================  ==============================================================  =================
pass (phase)       fixed micro-batches / token budget                               rows it splits
=================  ==============================================================  =================
update_actor       ``actor.ppo_micro_batch_size_per_gpu`` / ``ppo_max_token_len_...``  the per-GPU mini-batch
old_log_prob       ``rollout.log_prob_micro_batch_size_per_gpu`` / ``log_prob_max_...``  the per-GPU batch
ref                ``ref.log_prob_micro_batch_size_per_gpu`` / ``log_prob_max_...``  the per-GPU batch
update_critic      ``critic.ppo_micro_batch_size_per_gpu`` / ``ppo_max_token_len_...``  the critic's mini-batch
values             ``critic.forward_micro_batch_size_per_gpu`` / ``forward_max_...``  the per-GPU batch
gen                ``rollout.gpu_memory_utilization`` (a colocated vLLM engine)        -
=================  ==============================================================  =================

A role the run does not build (no critic, no reference model: ``trainer.config.keys.absent_role``) has no knob.
Ladders: a micro-batch size divides its rows (an update's must: ``trainer.config.rules``; a forward pass's too, so
every micro-batch is equally full); a token budget is ``k`` whole worst-case sequences (``k x (max_prompt_length +
max_response_length)``, ``k`` a divisor or a power of two up to the rows: at the worst case a budget between two
multiples holds no more sequences than the lower one); vLLM's share of the device in steps of 0.05. A knob's passes
are the phases it sizes: on a CPU a vLLM engine is resident in every phase (no sleep mode), so its pass overlaps all
the others (:attr:`SizeKnob.phases`). Pure: no process, no study.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from trainer.config.keys import absent_role
from trainer.contracts import PHASES

__all__ = ["SizeKnob", "size_knobs", "divisors", "UTILIZATION_LADDER"]

_A, _REF, _RO, _C = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic"
#: vLLM's ``gpu_memory_utilization`` rungs: all of it leaves the trainer nothing; too little holds no sequence, which
#: vLLM refuses at start-up whatever the limit (a floor under the rung: tuner.fit.boundary's ``too_small``)
UTILIZATION_LADDER = tuple(round(0.05 * k, 2) for k in range(2, 20))


@dataclass(frozen=True)
class SizeKnob:
    """One size knob of the base config and the values fit may give it."""

    key: str  # the dotted config key (verl's)
    role: str  # what it sizes, for people: "actor update", "ref log-prob", ...
    phases: tuple  # the phases whose memory it moves (trainer.contracts.PHASES order)
    ladder: tuple  # its values, ascending (memory increases along it)
    base: Any  # the base config's effective value (a followed key's value), None when unset
    kind: str  # micro_batch | token_budget | fraction

    @property
    def base_rung(self) -> int:
        """The largest rung at or below the base config's value (0 when it is below every rung or unset)."""
        if self.base is None:
            return 0
        below = [i for i, v in enumerate(self.ladder) if v <= self.base]
        return below[-1] if below else 0

    def rung(self, value: Any) -> Optional[int]:
        """The rung holding ``value``, or None."""
        for i, v in enumerate(self.ladder):
            if v == value:
                return i
        return None

    def overlaps(self, other: "SizeKnob") -> bool:
        """Whether the two knobs' passes share a phase (their memory is held at the same time)."""
        return bool(set(self.phases) & set(other.phases))

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "role": self.role,
            "phases": list(self.phases),
            "ladder": list(self.ladder),
            "base": self.base,
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SizeKnob":
        return cls(
            key=str(d["key"]),
            role=str(d["role"]),
            phases=tuple(str(p) for p in d["phases"]),
            ladder=tuple(d["ladder"]),
            base=d.get("base"),
            kind=str(d["kind"]),
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _counts(rows: int) -> list[int]:
    """Sequences per micro-batch a token budget is measured at: the divisors and the powers of two up to ``rows``."""
    pow2 = [1 << k for k in range(rows.bit_length()) if 1 << k <= rows]
    return sorted(set(divisors(rows)) | set(pow2))


def _pass(
    flat: Mapping[str, Any], *, dynamic: bool, micro: str, budget: str, rows: int, role: str, phase: str
) -> SizeKnob:
    """The knob of one pass: its token budget under dynamic batching, else its micro-batch size."""
    if dynamic:
        seq = int(flat["data.max_prompt_length"]) + int(flat["data.max_response_length"])
        ladder = tuple(k * seq for k in _counts(rows))
        return SizeKnob(budget, role, (phase,), ladder, flat.get(budget), "token_budget")
    return SizeKnob(micro, role, (phase,), tuple(divisors(rows)), flat.get(micro), "micro_batch")


def size_knobs(flat: Mapping[str, Any], *, on_gpu: bool) -> list[SizeKnob]:
    """The size knobs of a complete flat config whose follow-keys are resolved (``tuner.memory_model.flat_config``),
    in the order their passes run. ``on_gpu``: where the probes run (a vLLM engine sleeps between its passes on a
    GPU only)."""
    n = int(flat[f"{_RO}.n"])
    world = int(flat["trainer.n_gpus_per_node"]) * int(flat["trainer.nnodes"])
    rows = int(flat["data.train_batch_size"]) * n // world
    mini = lambda section: int(flat[f"{section}.ppo_mini_batch_size"]) * n // world  # noqa: E731
    out = []
    if flat.get(f"{_RO}.name") == "vllm":
        asleep = flat.get(f"{_RO}.free_cache_engine") and flat.get(f"{_RO}.enable_sleep_mode")
        phases = ("update_weights", "gen") if on_gpu and asleep else PHASES
        key = f"{_RO}.gpu_memory_utilization"
        out.append(SizeKnob(key, "vLLM engine", tuple(phases), UTILIZATION_LADDER, flat.get(key), "fraction"))
    log_prob = ("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu")
    for section, role, phase in ((_RO, "old log-prob", "old_log_prob"), (_REF, "ref log-prob", "ref")):
        if section == _REF and absent_role(flat, f"{_REF}.{log_prob[0]}") is not None:
            continue
        dynamic = bool(flat[f"{section}.log_prob_use_dynamic_bsz"])
        micro, budget = (f"{section}.{k}" for k in log_prob)
        out.append(_pass(flat, dynamic=dynamic, micro=micro, budget=budget, rows=rows, role=role, phase=phase))
    if absent_role(flat, f"{_C}.ppo_micro_batch_size_per_gpu") is None:
        dynamic = bool(flat[f"{_C}.use_dynamic_bsz"])
        fwd = dict(micro=f"{_C}.forward_micro_batch_size_per_gpu", budget=f"{_C}.forward_max_token_len_per_gpu")
        out.append(_pass(flat, dynamic=dynamic, **fwd, rows=rows, role="critic values", phase="values"))
        upd = dict(micro=f"{_C}.ppo_micro_batch_size_per_gpu", budget=f"{_C}.ppo_max_token_len_per_gpu")
        out.append(_pass(flat, dynamic=dynamic, **upd, rows=mini(_C), role="critic update", phase="update_critic"))
    dynamic = bool(flat[f"{_A}.use_dynamic_bsz"])
    upd = dict(micro=f"{_A}.ppo_micro_batch_size_per_gpu", budget=f"{_A}.ppo_max_token_len_per_gpu")
    out.append(_pass(flat, dynamic=dynamic, **upd, rows=mini(_A), role="actor update", phase="update_actor"))
    return out
