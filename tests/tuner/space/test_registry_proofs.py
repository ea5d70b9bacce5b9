"""The registry of what a space may vary (tuner/space/registry.py) stands beside the invariance suite: every
execution knob names the evidence that it does not change the PPO update, and that evidence exists.

``invariance:<variant>``: a variant of tests/trainer/invariance.py that sets the key (or the key it follows, a
null follow-key reading as it: trainer.config.FOLLOWS) and that the suite checks against its reference;
``engine:<variant>``: a rollout-engine variant of tests/trainer/engine/test_vllm_rollout.py; ``test:<file>::<name>``: a
test function that exists. And the other way: every key an invariance variant varies as a knob is in the registry,
so a new knob variant cannot be forgotten there."""

from __future__ import annotations

import ast

import pytest

from invariance import CHECKS_BF16, CHECKS_FP32, GRPO, LAYERS_3, VARIANTS_1, VARIANTS_2, VARIANTS_BF16_2
from support import REPO
from tests.trainer.engine.test_vllm_rollout import ENGINE_VARIANTS
from trainer.config import FOLLOWS
from tuner.space.registry import EXECUTION_KNOBS

VARIANTS = {**VARIANTS_2, **VARIANTS_BF16_2, **VARIANTS_1}
CHECKED = {c.variant for c in CHECKS_FP32 + CHECKS_BF16}
#: what the invariance variants vary that is not a knob: the algorithm itself (the suite's references for the
#: entropy knobs, and the critic's mini-batch: a different algorithm it proves acts; the GRPO job the GRPO
#: variants start from), and the training set-up (the model's depth: activation offload's variants and their
#: references need 3 layers, below which verl turns the offload off)
NOT_KNOBS = {
    "actor_rollout_ref.actor.entropy_coeff",
    "critic.ppo_mini_batch_size",
    *GRPO,
    *LAYERS_3,
}


def _sets(overrides: dict, key: str) -> bool:
    """Does a variant set ``key``, or the key it follows (a null follow-key reads as that one)?"""
    while key is not None:
        if key in overrides:
            return True
        key = FOLLOWS.get(key)
    return False


@pytest.mark.parametrize("key", sorted(EXECUTION_KNOBS))
def test_every_execution_knob_names_evidence_that_exists(key):
    knob = EXECUTION_KNOBS[key]
    kind, _, name = knob.proof.partition(":")
    if kind == "invariance":
        assert name in VARIANTS, f"{key}: no invariance variant {name!r}"
        assert name in CHECKED, f"{key}: variant {name!r} is never compared with a reference"
        assert _sets(VARIANTS[name], key), f"{key}: variant {name!r} does not set it"
    elif kind == "engine":
        assert name in ENGINE_VARIANTS and _sets(ENGINE_VARIANTS[name], key), f"{key}: {knob.proof}"
    elif kind == "test":
        path, _, function = name.partition("::")
        tree = ast.parse((REPO / path).read_text())
        assert function in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, knob.proof
    else:  # the rollout engine's own sizing, and the tests' fault hook: no update to compare
        assert (kind, knob.role) in (("rollout", "rollout engine"), ("fault", "a test's injected failure")), knob


def test_every_knob_the_invariance_suite_varies_is_in_the_registry():
    varied = {k for overrides in VARIANTS.values() for k in overrides} - NOT_KNOBS
    assert sorted(varied - set(EXECUTION_KNOBS)) == []
