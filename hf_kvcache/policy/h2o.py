"""`h2o`: Heavy-Hitter Oracle -- a recent window plus the tokens that received the most attention so far.

Options (`policy.options`): the recent window / heavy part (default: half the budget each), `value_norm`, and
`decay` (the accumulated mass fades by that factor per query, so old attention counts less) / `crop_window`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import INF, SlotView
from .options import MassPolicy


@dataclass(kw_only=True)
class H2OPolicy(MassPolicy):
    name: ClassVar[str] = "h2o"
    default_recent_share: ClassVar[float] = 0.5

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        _, recent = self.split(budget)
        return view.scores.masked_fill(view.last(recent), INF)
