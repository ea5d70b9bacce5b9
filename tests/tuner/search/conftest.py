"""The search's tests run on the tiny space of tests/tuner/rules/test_candidates.py (its ``setup``, here too)."""

import pytest

from support import tiny_setup
from tests.tuner.rules.test_candidates import SPACE


@pytest.fixture(scope="module")
def setup():
    return tiny_setup(SPACE)
