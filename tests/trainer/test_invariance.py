"""Per-GPU knobs must not change training: one PPO update of actor and critic from the same
weights and batch gives the same parameters under every knob setting (fp32, gloo, real FSDP)."""

import pytest

from invariance import TOL, VARIANTS_2, max_rel_diff, run_variants

pytestmark = pytest.mark.slow  # torchrun of real FSDP ranks


@pytest.fixture(scope="module")
def updated(tmp_path_factory):
    out = tmp_path_factory.mktemp("invariance")
    return {**run_variants(2, out, VARIANTS_2), **run_variants(1, out, {"one_process": {}})}


def test_update_moves_parameters_far_beyond_the_tolerance(updated):
    moved, _ = max_rel_diff(updated["base"]["init_actor"], updated["base"]["actor"])
    assert moved > 100 * TOL, "the update is too small for the invariance check to mean anything"


@pytest.mark.parametrize("variant", [v for v in VARIANTS_2 if v != "base"] + ["one_process"])
def test_same_parameters_under_every_knob(updated, variant):
    for part in ("actor", "critic"):
        rel, key = max_rel_diff(updated[variant][part], updated["base"][part])
        assert rel <= TOL, f"{variant}: {part}.{key} differs by {rel:.2e} (relative)"
    for k, v in updated["base"]["stats"].items():
        assert updated[variant]["stats"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
