"""`h2o`: Heavy-Hitter Oracle -- a recent window plus the tokens that received the most attention so far.

With `decay` (H2OOptions) the accumulated mass fades by that factor per query, so old attention counts less.
"""

from __future__ import annotations

import torch

from .base import INF, EvictionPolicy, SlotView


class H2OPolicy(EvictionPolicy):
    name = "h2o"
    needs_scores = True
    ranks_by_attention = True
    uses_mass = True
    default_recent_share = 0.5

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        _, recent = self.split(budget)
        return view.scores.masked_fill(view.last(recent), INF)
