"""`tova`: Token Omission Via Attention -- keep the tokens the newest query attends to most.

The score of a slot is the attention the newest (valid) query gives it, summed over the query heads of its KV group,
recomputed over the held tokens at every eviction: no memory of older queries, so a token that mattered long ago but
no longer does is dropped. No recent window by default (`recent_length` / `recent_ratio` add one).
"""

from __future__ import annotations

import torch

from .base import INF, EvictionPolicy, SlotView


class TOVAPolicy(EvictionPolicy):
    name = "tova"
    needs_scores = True
    ranks_by_attention = True
    default_recent_share = 0.0

    def query_window(self) -> int:
        return 1

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        _, recent = self.split(budget)
        return view.window[:, :, -1].masked_fill(view.last(recent), INF)
