"""A policy defined here, registered with one `register_policy` call (no library file touched), keeps the whole
policy contract (`policy_contract.py`), its own option included."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from hf_kvcache import H2OCache
from hf_kvcache.policy import POLICIES, SlotView, register_policy
from hf_kvcache.policy.options import RingPolicy
from policy_contract import MODEL_CHECKS, check_options_round_trip, tiny_model


@dataclass(kw_only=True)
class PeakPolicy(RingPolicy):
    """Keeps the tokens whose strongest attention from any of the last `queries` queries is highest (snapkv sums
    the window; this takes its maximum), plus a recent window of a quarter of the budget."""

    name: ClassVar[str] = "peak"
    default_recent_share: ClassVar[float] = 0.25
    queries: int = 8

    def validate(self) -> None:
        super().validate()
        if isinstance(self.queries, bool) or not isinstance(self.queries, int) or self.queries < 1:
            raise ValueError(f"queries must be a positive integer (the queries observed), got {self.queries!r}")

    def query_window(self) -> int:
        return self.queries

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        _, recent = self.split(budget)
        return view.window.amax(-2).masked_fill(view.last(recent), float("inf"))


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_policy(PeakPolicy)
    yield
    POLICIES.pop(PeakPolicy.name)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("check", MODEL_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_contract(model, check):
    check(model, PeakPolicy(queries=4))


def test_options_by_name_and_by_key():
    check_options_round_trip(PeakPolicy(queries=4))
    cache = H2OCache(budget=8, policy="peak", queries=3, recent_ratio=0.5)
    assert cache.options.policy == PeakPolicy(queries=3, recent_ratio=0.5)
    with pytest.raises(ValueError, match="queries must be a positive integer"):
        H2OCache(budget=8, policy="peak", queries=0)
    with pytest.raises(ValueError, match="queries applies to the peak policy, not 'tova'"):
        H2OCache(budget=8, policy="tova", queries=3)


def test_generate_by_name(model):
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, cache_implementation="h2o", cache_config={"budget": 8, "policy": "peak"},
                         max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values.options.policy == PeakPolicy() and out.past_key_values.tokens_held() == 8
