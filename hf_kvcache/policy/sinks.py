"""`sinks`: StreamingLLM -- the first `sink_length` real tokens (attention sinks) plus the most recent ones."""

from __future__ import annotations

import torch

from .base import INF, EvictionPolicy, SlotView


class SinksPolicy(EvictionPolicy):
    name = "sinks"
    uses_sinks = True

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        sinks, _ = self.split(budget)
        return view.positions.float().masked_fill(view.first(sinks), INF)
