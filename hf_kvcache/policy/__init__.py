"""Eviction policies, one per module: each picks which held tokens a KV head keeps (see `base.EvictionPolicy`), and
declares and checks its own options (dataclass fields; shared groups in `options`). Wrappers (`wrappers`) add
per-head budgets, per-layer budgets, shared heads, merging and pooled scores to any policy.

New policy: a module with an `EvictionPolicy` subclass, and one `register_policy` line below (or a call from user
code); `H2OCache(policy="name", ...)` and `cache_config={"policy": "name", ...}` then build it.
"""

from __future__ import annotations

from typing import Any

from .base import EvictionPolicy, SlotView
from .expected import ExpectedAttentionPolicy
from .h2o import H2OPolicy
from .hybrid import HybridPolicy
from .knorm import KNormPolicy
from .recent import RecentPolicy
from .reconstruct import ReconstructionPolicy
from .registry import POLICIES, option_users, policy_from_options, register_policy
from .sinks import SinksPolicy
from .snapkv import SnapKVPolicy
from .strided import StridedPolicy
from .tova import TOVAPolicy
from .wrappers import AdaKV, Merge, PolicyWrapper, Pooled, Pyramid, SharedHeads

WRAPPERS: dict[str, type[PolicyWrapper]] = {w.name: w for w in (AdaKV, Pyramid, SharedHeads, Merge, Pooled)}

register_policy(H2OPolicy)
register_policy(TOVAPolicy)
register_policy(SnapKVPolicy)
register_policy(KNormPolicy)
register_policy(RecentPolicy)
register_policy(SinksPolicy)
register_policy(StridedPolicy)
register_policy(HybridPolicy)
register_policy(ExpectedAttentionPolicy)
register_policy(ReconstructionPolicy)


def policy_from_dict(spec: dict[str, Any] | str) -> EvictionPolicy:
    """A policy from `EvictionPolicy.to_dict()` (`{"name": ..., options...}`, wrappers nesting theirs under
    `"policy"`) or a bare name."""
    if isinstance(spec, str):
        return policy_from_options(spec, {})
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(f"a policy is a name, an EvictionPolicy or a dict with a 'name' key, got {spec!r}")
    options = {k: v for k, v in spec.items() if k != "name"}
    wrapper = WRAPPERS.get(spec["name"])
    if wrapper is None:
        return policy_from_options(spec["name"], options)
    unknown = sorted(set(options) - set(wrapper.option_names()))
    if unknown or "policy" not in options:
        raise ValueError(f"the {spec['name']} wrapper takes {wrapper.option_names()} (the policy it wraps under "
                         f"'policy'), got {sorted(options)}")
    return wrapper(**{**options, "policy": policy_from_dict(options["policy"])})


__all__ = [
    "AdaKV",
    "EvictionPolicy",
    "ExpectedAttentionPolicy",
    "H2OPolicy",
    "HybridPolicy",
    "KNormPolicy",
    "Merge",
    "POLICIES",
    "PolicyWrapper",
    "Pooled",
    "Pyramid",
    "RecentPolicy",
    "ReconstructionPolicy",
    "SharedHeads",
    "SinksPolicy",
    "SlotView",
    "SnapKVPolicy",
    "StridedPolicy",
    "TOVAPolicy",
    "WRAPPERS",
    "option_users",
    "policy_from_dict",
    "policy_from_options",
    "register_policy",
]
