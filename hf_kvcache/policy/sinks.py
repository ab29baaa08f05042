"""`sinks`: StreamingLLM -- the first `sink_length` real tokens (attention sinks) plus the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import INF, SlotView
from .options import WithSinks


@dataclass(kw_only=True)
class SinksPolicy(WithSinks):
    name: ClassVar[str] = "sinks"

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        sinks, _ = self.split(budget)
        return view.positions.float().masked_fill(view.first(sinks), INF)
