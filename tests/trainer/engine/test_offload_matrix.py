"""verl's three offload flags x FSDP1/FSDP2: every combination is refused by config validation with a
one-line reason, or runs real PPO steps without a crash (a crash teaches the tuner nothing).
Also: one all-gather per FSDP unit per generate call, on both strategies."""

import pytest
from step_worker import offload_matrix, refusal, run_step_worker

MATRIX = offload_matrix()


def test_offload_matrix_refusals_are_one_line_and_name_the_key():
    refused = {name: refusal(over) for name, over in MATRIX.items()}
    for name, why in refused.items():
        over = MATRIX[name]
        policy = over["actor_rollout_ref.actor.fsdp_config.offload_policy"]
        fsdp1 = over["actor_rollout_ref.actor.strategy"] == "fsdp"
        other = (
            over["actor_rollout_ref.actor.fsdp_config.param_offload"]
            or over["actor_rollout_ref.actor.fsdp_config.optimizer_offload"]
        )
        if policy and (fsdp1 or other):
            assert why is not None and "\n" not in why and "actor_rollout_ref.actor.fsdp_config." in why, (name, why)
        else:
            assert why is None, (name, why)
    # FSDP1: the 4 without offload_policy; FSDP2: those 4 and offload_policy alone
    assert sum(w is None for w in refused.values()) == 9


def accepted() -> dict:
    return {name: over for name, over in MATRIX.items() if refusal(over) is None}


@pytest.mark.slow
def test_every_accepted_offload_combination_runs(tmp_path):
    variants = accepted()
    results = run_step_worker(tmp_path, variants, nproc=2, relocate=True)
    crashed = {k: r["error"] for k, r in results.items() if r["status"] != "ok"}
    assert not crashed, crashed
    # on CPU every offload flag is a no-op for placement, and the run says so instead of pretending
    notes = results["fsdp2-offload_policy"]["notes"]
    assert any("offload_policy: no effect on CPU" in n for n in notes), notes
    # FSDP1 and FSDP2 gather each unit (2 blocks + root) once per generate call, not once per token
    for name, r in results.items():
        assert r["gathers_per_generate"] == 3, (name, r["gathers_per_generate"])
    # param_offload's move: after moving every shard, no parameter points at the old storage and the
    # outputs are unchanged (a stale FSDP1 view would keep the GPU copy alive)
    for name, r in results.items():
        assert r["relocation"] == {"stale_storages": 0, "max_abs_change": 0.0}, (name, r["relocation"])
    # a finished variant leaves nothing behind for the next (torch's FSDP1 keeps its flat parameters alive
    # after the module is gone: Roles.free gives their memory back, as at the end of every warm trial)
    for name, r in results.items():
        assert r["leftover_tensor_mb"] < 0.01, (name, r["leftover_tensor_mb"])
