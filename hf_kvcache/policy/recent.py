"""`recent`: LRU / sliding window -- keep the most recent tokens."""

from __future__ import annotations

import torch

from .base import EvictionPolicy, SlotView


class RecentPolicy(EvictionPolicy):
    name = "recent"

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        return view.positions.float()
