"""Every registered eviction policy keeps the policy contract (`policy_contract.py`): exact decoding over the kept
tokens, its own real tokens per head, `evict_to`, batch operations, crop, the wrappers, its options."""

import pytest

from hf_kvcache.policy import POLICIES
from policy_contract import MODEL_CHECKS, check_options_round_trip, tiny_model

NAMES = sorted(POLICIES)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("check", MODEL_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("name", NAMES)
def test_policy_contract(model, name, check):
    check(model, POLICIES[name]())


@pytest.mark.parametrize("name", NAMES)
def test_policy_options_round_trip(name):
    check_options_round_trip(POLICIES[name]())
