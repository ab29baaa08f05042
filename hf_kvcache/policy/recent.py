"""`recent`: LRU / sliding window -- keep the most recent tokens (no options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import EvictionPolicy, SlotView


@dataclass(kw_only=True)
class RecentPolicy(EvictionPolicy):
    name: ClassVar[str] = "recent"

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        return view.positions.float()
