"""vLLM's share of the device in ``ppotune fit`` (tuner.fit.boundary, tuner.fit.answer, tuner.fit.propose): both of its
start-up refusals name the knob, read with trainer.contracts.MEMORY_MESSAGES. Too much share (what training holds
leaves less free: vllm/v1/worker/utils.py::request_memory) is an OOM of that knob, whatever the pass; too little (no
room for one sequence: vllm/v1/core/kv_cache_planning.py::_check_enough_kv_cache_memory) is the opposite bound, a
floor under the rung, never a crash that stops the fit. The simulated engine is verl's: one figure per step, no pass
named, the failure reported as classify_failure and the tuner record it."""

from __future__ import annotations

import json

import pytest

from trainer.contracts import VLLM_UTILIZATION_KEY, Status, memory_message
from tuner.fit.answer import answer_values, knob_answers
from tuner.fit.boundary import (
    FITS,
    OOM,
    TOO_SMALL,
    FitBlocked,
    FitState,
    KnobFit,
    ProbeOutcome,
    judge_probe,
    next_probe,
)
from tuner.fit.ladder import UTILIZATION_LADDER, SizeKnob
from tuner.fit.propose import proposals

ACTOR = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
# vllm/v1/worker/utils.py::request_memory, as the verl adapter's classify_failure keeps it (status oom)
BUSY = (
    "(vLLMHttpServer pid=4242) ValueError: Free memory on device cuda:0 (30.12/79.19 GiB) on startup is less than "
    "desired GPU memory utilization (0.95, 75.23 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
    "other processes."
)
# vllm/v1/core/kv_cache_planning.py::_check_enough_kv_cache_memory, as classify_failure / fail_rank record it: a config
# refusal (the tuner's status invalid; a ppotune trial's rank error ends up a crash until the launcher reads it so)
KV = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
TOO_LITTLE = memory_message(KV).error(KV)


def _state() -> tuple[FitState, SizeKnob, SizeKnob]:
    vllm = SizeKnob(VLLM_UTILIZATION_KEY, "vLLM engine", ("update_weights", "gen"), UTILIZATION_LADDER, 0.5, "fraction")
    actor = SizeKnob(ACTOR, "actor update", ("update_actor",), (1, 2, 4, 8), 2, "micro_batch")
    return FitState([KnobFit(vllm), KnobFit(actor)]), vllm, actor


def _rung(value: float) -> int:
    return UTILIZATION_LADDER.index(value)


def test_a_share_the_device_has_not_free_is_an_oom_of_the_vllm_knob_whatever_the_pass():
    """verl's first probe runs vLLM at the top of its ladder: the start-up refusal speaks for vLLM's knob alone (no
    pass is named, yet the probe does not turn into one-knob-at-a-time probing)."""
    state, vllm, actor = _state()
    top = {vllm.key: len(UTILIZATION_LADDER) - 1, actor.key: 3}
    made = judge_probe(state, top, ProbeOutcome(Status.OOM, error=BUSY), limit_gb=70.0, tested=[vllm.key, actor.key])
    assert [(k, o.verdict) for k, o in made] == [(vllm.key, OOM)] and not state.split
    assert state.fit(vllm.key).hi == len(UTILIZATION_LADDER) - 1
    # a study written before the adapter knew vLLM's message recorded the same probe a crash: read alike on resume
    old, vllm, actor = _state()
    judge_probe(old, top, ProbeOutcome(Status.CRASH, error=BUSY), limit_gb=70.0, tested=[vllm.key, actor.key])
    assert old.fit(vllm.key).hi == len(UTILIZATION_LADDER) - 1


@pytest.mark.parametrize("status", [Status.INVALID, Status.CRASH])
def test_a_share_too_small_for_one_sequence_is_a_floor_not_a_crash(status):
    state, vllm, actor = _state()
    rungs = {vllm.key: _rung(0.1), actor.key: 1}
    made = judge_probe(state, rungs, ProbeOutcome(status, error=TOO_LITTLE), limit_gb=70.0, tested=[vllm.key])
    assert [(k, o.verdict) for k, o in made] == [(vllm.key, TOO_SMALL)]
    fit = state.fit(vllm.key)
    assert fit.floor == _rung(0.1) and fit.low == _rung(0.1) and not fit.impossible and not fit.settled
    plan = next_probe(state, start={vllm.key: 0, actor.key: 1})
    assert plan.rungs[vllm.key] > _rung(0.1)  # never at or below the floor again
    # a fit at or below the floor (another combination's noise) does not make a too-small share the answer
    fit.record(type(made[0][1])(rung=_rung(0.1), verdict=FITS))
    assert fit.lo == -1 and fit.low == _rung(0.1)


def test_a_too_small_share_on_a_knob_the_fit_does_not_size_stops_it_with_the_key():
    actor = SizeKnob(ACTOR, "actor update", ("update_actor",), (1, 2, 4, 8), 2, "micro_batch")
    state = FitState([KnobFit(actor)])
    with pytest.raises(FitBlocked) as got:
        judge_probe(state, {actor.key: 1}, ProbeOutcome(Status.INVALID, error=TOO_LITTLE), limit_gb=70.0)
    assert VLLM_UTILIZATION_KEY in str(got.value) and not got.value.no_size


class VerlJob:
    """verl's worst case, one figure per step: vLLM at share ``u`` holds no sequence below ``u_min``; its start-up
    finds less than ``u`` of the device free above ``u_max``; the actor's update fits up to ``actor_max``."""

    def __init__(self, u_min: float, u_max: float, actor_max: int):
        self.u_min, self.u_max, self.actor_max, self.runs = u_min, u_max, actor_max, 0

    def step(self, vllm: SizeKnob, actor: SizeKnob, rungs: dict) -> ProbeOutcome:
        self.runs += 1
        u = vllm.ladder[rungs[vllm.key]]
        if u < self.u_min:
            return ProbeOutcome(Status.INVALID, error=TOO_LITTLE)
        if u > self.u_max:
            return ProbeOutcome(Status.OOM, error=BUSY)
        if actor.ladder[rungs[actor.key]] > self.actor_max:
            return ProbeOutcome(Status.OOM, error="torch.OutOfMemoryError: CUDA out of memory.")
        return ProbeOutcome(Status.OK, peak_gb=60.0)


def _fit(job: VerlJob) -> FitState:
    state, vllm, actor = _state()
    start = {vllm.key: len(UTILIZATION_LADDER) - 1, actor.key: 3}  # verl has no model: the tops first
    while (plan := next_probe(state, start=start)) is not None:
        judge_probe(state, plan.rungs, job.step(vllm, actor, plan.rungs), limit_gb=70.0, tested=list(plan.why))
        assert state.probes < 40
    return state


@pytest.mark.parametrize("u_min, u_max", [(0.3, 0.6), (0.1, 0.95), (0.55, 0.55)])
def test_the_fit_brackets_the_share_between_its_floor_and_what_the_device_has_free(u_min, u_max):
    state = _fit(VerlJob(u_min, u_max, actor_max=4))
    assert state.done and answer_values(state) == {VLLM_UTILIZATION_KEY: u_max, ACTOR: 4}
    back = FitState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert [(f.lo, f.hi, f.floor) for f in back.fits] == [(f.lo, f.hi, f.floor) for f in state.fits]


def test_no_share_fits_when_the_floor_meets_what_fails_and_the_table_says_why():
    state = _fit(VerlJob(0.6, 0.4, actor_max=4))
    fit = state.fit(VLLM_UTILIZATION_KEY)
    assert state.done and fit.impossible and VLLM_UTILIZATION_KEY not in answer_values(state)
    row = next(r for r in knob_answers(state, limit_gb=70.0) if r.key == VLLM_UTILIZATION_KEY)
    assert row.value is None and row.floor_value is not None and row.floor_value < 0.6
    assert "holds no sequence" in row.next_why and "out of memory" in row.next_why


def test_the_model_proposes_nothing_at_or_below_the_floor():
    state, vllm, actor = _state()
    rungs = {vllm.key: _rung(0.3), actor.key: 1}
    judge_probe(state, rungs, ProbeOutcome(Status.INVALID, error=TOO_LITTLE), limit_gb=70.0, tested=[vllm.key])
    seen = []

    def predict(r: dict) -> dict:
        seen.append(r[vllm.key])
        return {"gen": 80.0 * vllm.ladder[r[vllm.key]], "update_actor": 10.0}

    props, _ = proposals(state, predict, start={vllm.key: 0, actor.key: 1}, limit_gb=70.0)
    assert min(seen) > _rung(0.3) and props[vllm.key] == _rung(0.85)  # 0.85 x 80 = 68 GB within 70
