"""Per-GPU knobs must not change training: one PPO update of actor and critic from the same weights
and batch gives the same gradients, parameters and statistics under every knob setting (gloo, real
FSDP): exactly in fp32, within bf16's rounding under verl's default bf16 compute."""

import time

import pytest

from invariance import (
    BIT_FOR_BIT,
    CHECKS_BF16,
    CHECKS_FP32,
    MUST_DIFFER,
    SEEN_BY_BF16,
    TOL,
    VARIANTS_1,
    VARIANTS_2,
    VARIANTS_BF16_2,
    VARIANTS_GRPO_2,
    bit_differences,
    differences,
    failures,
    model_rel_diff,
    run_variants,
    table,
)

pytestmark = pytest.mark.slow  # torchrun of real FSDP ranks
_ELAPSED_S: dict[str, float] = {}


@pytest.fixture(scope="module")
def updated(tmp_path_factory):
    out = tmp_path_factory.mktemp("invariance")
    t0 = time.perf_counter()
    # two torchruns in all: every 2-rank variant in one, every 1-process variant in the other
    got = {
        **run_variants(2, out, {**VARIANTS_2, **VARIANTS_BF16_2, **VARIANTS_GRPO_2}),
        **run_variants(1, out, VARIANTS_1),
    }
    _ELAPSED_S["torchrun"] = time.perf_counter() - t0
    return got


def test_print_measured_differences(updated, capsys):
    with capsys.disabled():
        print(f"\n{len(updated)} variants in {_ELAPSED_S['torchrun']:.0f} s; worst relative differences:")
        print(table(updated, CHECKS_FP32 + CHECKS_BF16))
        print("a real change, which the bf16 tolerance must see:")
        print(table(updated, [SEEN_BY_BF16]))


@pytest.mark.parametrize("variant", ["base", "bf16_base"])
def test_update_moves_parameters_far_beyond_the_tolerance(updated, variant):
    got = updated[variant]
    for part in ("actor", "critic"):
        moved = model_rel_diff(got[f"init_{part}"], got[part])
        assert moved > 100 * TOL, f"the {part} update is too small for the invariance check to mean anything"


def test_bf16_tolerances_are_far_below_the_update():
    """bf16 parameters are compared relative to the update (a missing or doubled update differs by 1 of
    it, a reversed one by 2), gradients relative to the gradient (after clipping; a doubled loss shows in
    grad_norm, compared within stats_rel)."""
    for check in CHECKS_BF16:
        assert check.tol.params <= 0.2 and check.tol.grads <= 0.05 and check.tol.stats_rel <= 0.01, check


@pytest.mark.parametrize("check", CHECKS_FP32, ids=lambda c: f"{c.variant}-vs-{c.reference}")
def test_same_update_under_every_knob(updated, check):
    found = failures(updated, check)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("check", CHECKS_BF16, ids=lambda c: f"{c.variant}-vs-{c.reference}")
def test_bf16_update_within_rounding(updated, check):
    found = failures(updated, check)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("variant", "reference", "part"), MUST_DIFFER)
def test_the_knobs_that_change_the_algorithm_act(updated, variant, reference, part):
    a, b = updated[variant], updated[reference]
    rel = model_rel_diff(a[part], b[part], origin=b[f"init_{part}"])
    assert rel > 100 * TOL, f"{variant}: the {part}'s update differs only by {rel:.1e} of it from {reference}'s"


def test_bf16_tolerance_sees_the_entropy_bonus(updated):
    """A change of the loss worth a few percent of the gradient fails the bf16 tolerance."""
    rel = differences(updated, SEEN_BY_BF16)["actor.grad"][0]
    assert rel > 2 * SEEN_BY_BF16.tol.grads, f"the entropy bonus moved the actor's gradient by {rel:.1e} only"


@pytest.mark.parametrize(("variant", "reference"), BIT_FOR_BIT, ids=lambda v: v)
def test_offload_knobs_give_their_reference_bit_for_bit(updated, variant, reference):
    """Offload moves tensors and changes no arithmetic: not a tolerance, the same bits (a host copy handed to the
    wrong tensor, a stale view after a move, show here first)."""
    differing = bit_differences(updated, variant, reference)
    assert not differing, f"{variant} vs {reference}: {len(differing)} tensors differ, e.g. {differing[:5]}"


def test_activation_offload_ran_its_hooks_on_this_device(updated):
    for variant in (v for v in VARIANTS_2 if "activation_offload" in v):
        assert updated[variant]["activation_offload_ran"], f"{variant}: the activation offload hooks never ran"
    assert not updated["base"]["activation_offload_ran"]
