"""`tova`: Token Omission Via Attention -- keep the tokens the newest query attends to most.

The score of a slot is the attention the newest (valid) query gives it, summed over the query heads of its KV group,
recomputed over the held tokens at every eviction: no memory of older queries, so a token that mattered long ago but
no longer does is dropped. No recent window by default (`recent_length` / `recent_ratio` add one). Options:
`policy.options.RingPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import INF, SlotView
from .options import RingPolicy


@dataclass(kw_only=True)
class TOVAPolicy(RingPolicy):
    name: ClassVar[str] = "tova"
    default_recent_share: ClassVar[float] = 0.0

    def query_window(self) -> int:
        return 1

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        _, recent = self.split(budget)
        return view.window[:, :, -1].masked_fill(view.last(recent), INF)
