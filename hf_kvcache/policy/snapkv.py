"""`snapkv`: the attention of an observation window of the last `window` queries (optionally pooled over slots).

The score of a slot is the attention the last `window` queries give it (summed over those queries and the query
heads of its KV group), recomputed over the held tokens at every eviction -- across several decoding steps when the
forwards are shorter than the window -- then, with `pool` > 1, averaged over `pool` neighbouring slots so that a
kept token keeps its context (off by default: it lost perplexity in our streaming measurement). The observation window itself (the `window` newest tokens, at most half the budget) is always kept unless
`recent_length` / `recent_ratio` / `heavy_length` / `heavy_ratio` say otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import INF, EvictionPolicy, SlotView

DEFAULT_POOL = 1  # SnapKV pools over 7; measured worse here (SmolLM2 + Moby Dick, 20 %: +7.10 % ppl vs +3.85 %)


class SnapKVPolicy(EvictionPolicy):
    name = "snapkv"
    needs_scores = True
    ranks_by_attention = True
    default_recent_share = 0.0

    def __init__(self, *args, pool: int = DEFAULT_POOL, **kwargs) -> None:
        super().__init__(*args, pool=pool, **kwargs)
        self.split_given = any(
            v is not None for v in (self.recent_length, self.recent_ratio, self.heavy_length, self.heavy_ratio)
        )

    def query_window(self) -> int:
        return self.window

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        # the observation window, but never more than half the budget: with a small budget (the start of a stream
        # under a ratio budget) a window filling it would evict the attention sink
        recent = self.split(budget)[1] if self.split_given else min(self.window, budget // 2)
        score = view.window.sum(-2)
        if self.pool > 1:
            b, h, n = score.shape
            score = F.avg_pool1d(score.view(b * h, 1, n), self.pool, stride=1, padding=self.pool // 2,
                                 count_include_pad=False).view(b, h, n)
        return score.masked_fill(view.last(recent), INF)
