"""`knorm`: keep the keys of lowest L2 norm -- a query-agnostic score that needs no attention at all.

Keys with a small norm tend to draw the most attention (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based
Strategy for KV Cache Compression"), so the largest-norm keys go first. No recent window by default
(`recent_length` / `recent_ratio` add one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import INF, SlotView
from .options import ScoredPolicy


@dataclass(kw_only=True)
class KNormPolicy(ScoredPolicy):
    name: ClassVar[str] = "knorm"
    uses_keys: ClassVar[bool] = True
    default_recent_share: ClassVar[float] = 0.0

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        _, recent = self.split(budget)
        return (-view.keys.float().norm(dim=-1)).masked_fill(view.last(recent), INF)
