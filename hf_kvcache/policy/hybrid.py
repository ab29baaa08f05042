"""`hybrid`: attention sinks + heavy hitters + a recent window (options: those of `h2o` and `sink_length`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import INF, SlotView
from .options import MassPolicy, WithSinks


@dataclass(kw_only=True)
class HybridPolicy(WithSinks, MassPolicy):
    name: ClassVar[str] = "hybrid"
    default_recent_share: ClassVar[float] = 0.5

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        sinks, recent = self.split(budget)
        return view.scores.masked_fill(view.first(sinks) | view.last(recent), INF)
