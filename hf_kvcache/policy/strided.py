"""`strided`: a recent window plus older tokens sampled at an even stride over the rest of the history.

Each eviction re-samples the older tokens still held at ranks 0, s, 2s, ..., so the kept past thins out uniformly
over time and the oldest real token (the attention sink) is always one of the samples. Options: `recent_length` /
`recent_ratio` (default: half the budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import INF, SlotView
from .options import RecentWindow


@dataclass(kw_only=True)
class StridedPolicy(RecentWindow):
    name: ClassVar[str] = "strided"
    default_recent_share: ClassVar[float] = 0.5

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        _, recent = self.split(budget)
        in_recent = view.last(recent)
        older = view.valid & ~in_recent
        k = budget - recent
        r = older.long().cumsum(-1) - 1  # 0-based rank among the older tokens
        m = older.sum(-1, keepdim=True).clamp(min=1)
        # ranks 0, m/k, 2m/k, ... (rank r is picked when ceil(r k / m) < ceil((r + 1) k / m)): exactly min(k, m)
        # picks, evenly spaced, always including the oldest token (which keeps the attention sink)
        picked = older & ((r * k + m - 1) // m < ((r + 1) * k + m - 1) // m)
        return view.positions.float().masked_fill(in_recent | picked, INF)
