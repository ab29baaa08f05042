"""`hybrid`: attention sinks + heavy hitters + a recent window."""

from __future__ import annotations

import torch

from .base import INF, EvictionPolicy, SlotView


class HybridPolicy(EvictionPolicy):
    name = "hybrid"
    needs_scores = True
    ranks_by_attention = True
    uses_mass = True
    uses_sinks = True
    default_recent_share = 0.5

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        sinks, recent = self.split(budget)
        return view.scores.masked_fill(view.first(sinks) | view.last(recent), INF)
