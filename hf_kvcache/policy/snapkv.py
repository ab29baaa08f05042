"""`snapkv`: the attention of an observation window of the last `window` queries (optionally pooled over slots).

The score of a slot is the attention the last `window` queries give it (summed over those queries and the query
heads of its KV group), recomputed over the held tokens at every eviction -- across several decoding steps when the
forwards are shorter than the window -- then, with `pool` > 1, averaged (`pool_mode="avg"`) or maximized
(`pool_mode="max"`: a slot scores as its best neighbour) over `pool` neighbouring slots so that a kept token keeps its
context (off by default: it lost perplexity in our streaming measurement). With `query_reduce="max"` a slot scores as
the strongest attention any one window query gives it (the heads of its group summed) instead of the sum over the
window, so that a token one question token looks at hard is not outweighed by tokens every query glances at. The
observation window itself (the `window` newest tokens, at most half the budget) is always kept unless `recent_length`
/ `recent_ratio` / `heavy_length` / `heavy_ratio` say otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..options import check_choice
from .attention import check_pool, pool_scores
from .base import INF, SlotView
from .options import ObservationWindow, RingPolicy

DEFAULT_POOL = 1  # SnapKV pools over 7; measured worse here (see docs/rows)
QUERY_REDUCES = ("sum", "max")


@dataclass(kw_only=True)
class SnapKVPolicy(ObservationWindow, RingPolicy):
    """Options: `window` (queries observed, default 32), `pool` (odd width of the pooling over neighbouring slots,
    default 1 = none), `pool_mode` ("avg" or "max" over those slots), `query_reduce` ("sum" or "max" over the window's
    queries), and those of `policy.options.RingPolicy`."""

    name: ClassVar[str] = "snapkv"
    default_recent_share: ClassVar[float] = 0.0
    pool: int = DEFAULT_POOL
    pool_mode: str = "avg"
    query_reduce: str = "sum"

    def validate(self) -> None:
        super().validate()
        check_pool(self.pool, self.pool_mode, "pool_mode")
        check_choice("query_reduce", self.query_reduce, QUERY_REDUCES)

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        # the observation window, but never more than half the budget: with a small budget (the start of a stream
        # under a ratio budget) a window filling it would evict the attention sink
        recent = self.split(budget)[1] if self.split_given() else min(self.window, budget // 2)
        score = view.window.sum(-2) if self.query_reduce == "sum" else view.window.amax(-2)
        score = pool_scores(score, None, self.pool, self.pool_mode)
        return score.masked_fill(view.last(recent), INF)
