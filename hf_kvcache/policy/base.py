"""`EvictionPolicy`: the tiny base every eviction policy subclasses, and `SlotView`, what a policy sees.

A policy overrides one method, `priority(view, budget)`: a number per held slot, higher = keep. `select` keeps the
`budget` slots of highest priority in every (batch row, KV head) -- each KV head keeps its own tokens -- after sending
padding to the bottom (`-inf`), so padding is always evicted first and never counts as a heavy hitter. Protect a slot
by giving it `+inf` (sinks, the recent window); rank the rest by attention score or by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INF = float("inf")


@dataclass
class SlotView:
    """The held slots of one layer, `[batch, kv_heads, slots]` each, in order of position (oldest first)."""

    scores: torch.Tensor  # float32: attention mass received so far (summed over query heads of the group and queries)
    positions: torch.Tensor  # int: position of the token in its sequence (padding included)
    valid: torch.Tensor  # bool: False for padding

    def rank(self) -> torch.Tensor:
        """0 for the oldest real token of each row/head, 1 for the next... (meaningless on padding slots)."""
        return self.valid.cumsum(-1) - 1

    def rank_from_end(self) -> torch.Tensor:
        """0 for the newest real token, 1 for the one before..."""
        return self.valid.flip(-1).cumsum(-1).flip(-1) - 1

    def first(self, k: int) -> torch.Tensor:
        """The `k` oldest real tokens (attention sinks)."""
        return self.valid & (self.rank() < k)

    def last(self, k: int) -> torch.Tensor:
        """The `k` newest real tokens (the recent window)."""
        return self.valid & (self.rank_from_end() < k)


class EvictionPolicy:
    """Base of the eviction policies. Subclasses set `name` and override `priority`.

    The budget (tokens kept per KV head) is split into sinks (`sink_length`, for policies with `uses_sinks`), a recent
    window, and the rest (heavy hitters, strided samples...). The recent window is `recent_length` tokens, or
    `recent_ratio` of the budget, or what is left after `heavy_length` / `heavy_ratio` of the budget, or by default
    `default_recent_share` of what the sinks leave.
    """

    name = ""
    needs_scores = False
    uses_sinks = False
    default_recent_share = 1.0

    def __init__(
        self,
        sink_length: int = 0,
        recent_length: int | None = None,
        recent_ratio: float | None = None,
        heavy_length: int | None = None,
        heavy_ratio: float | None = None,
    ) -> None:
        self.sink_length = sink_length
        self.recent_length = recent_length
        self.recent_ratio = recent_ratio
        self.heavy_length = heavy_length
        self.heavy_ratio = heavy_ratio

    def split(self, budget: int) -> tuple[int, int]:
        """(sinks, recent window) for a budget of `budget` tokens; the heavy part is what they leave."""
        sinks = min(self.sink_length, budget) if self.uses_sinks else 0
        rest = budget - sinks
        if self.recent_length is not None:
            recent = self.recent_length
        elif self.recent_ratio is not None:
            recent = _round(self.recent_ratio * budget)
        elif self.heavy_length is not None:
            recent = rest - self.heavy_length
        elif self.heavy_ratio is not None:
            recent = rest - _round(self.heavy_ratio * budget)
        else:
            recent = _round(self.default_recent_share * rest)
        return sinks, max(0, min(recent, rest))

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        """`[batch, kv_heads, slots]`: higher = keep. The one method a policy overrides."""
        raise NotImplementedError

    def select(self, view: SlotView, budget: int) -> torch.Tensor | None:
        """Indices `[batch, kv_heads, budget]` (ascending, i.e. oldest first) of the slots to keep; None = keep all."""
        if budget >= view.valid.shape[-1]:
            return None
        priority = self.priority(view, budget).float().masked_fill(~view.valid, -INF)
        return priority.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _round(x: float) -> int:
    return int(x + 0.5)
