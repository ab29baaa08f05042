"""Eviction policies, one per module: each picks which held tokens a KV head keeps (see `base.EvictionPolicy`)."""

from .base import EvictionPolicy, SlotView
from .expected import ExpectedAttentionPolicy
from .h2o import H2OPolicy
from .hybrid import HybridPolicy
from .knorm import KNormPolicy
from .recent import RecentPolicy
from .sinks import SinksPolicy
from .snapkv import SnapKVPolicy
from .strided import StridedPolicy
from .tova import TOVAPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p
    for p in (H2OPolicy, TOVAPolicy, SnapKVPolicy, KNormPolicy, RecentPolicy, SinksPolicy, StridedPolicy, HybridPolicy,
              ExpectedAttentionPolicy)
}

__all__ = [
    "EvictionPolicy",
    "SlotView",
    "POLICIES",
    "ExpectedAttentionPolicy",
    "H2OPolicy",
    "HybridPolicy",
    "KNormPolicy",
    "SnapKVPolicy",
    "TOVAPolicy",
    "RecentPolicy",
    "SinksPolicy",
    "StridedPolicy",
]
