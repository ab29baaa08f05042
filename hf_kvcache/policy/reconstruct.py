"""`reconstruct`: rank the context by the attention it receives while the model repeats it (context reconstruction,
the idea of KVzip, Kim et al. 2025), a query-agnostic score: what the model needs to rebuild the context is what any
later question about it can need.

Once a context is prefilled, `caches.evict.reconstruct.score_context` feeds the model a reconstruction prompt (an
instruction to repeat the text, then the context itself, `chunk` repeated tokens per forward so the extra cost per
forward is bounded) over the held cache, and keeps per (row, KV head, slot) the largest attention any repeat query
of the group gives the slot (`reduce="max"`; `"sum"`: their sum); the repeat tokens are dropped again. This module
holds the policy and that reduction (`reconstruction_scores`); the driver that runs the model is in the cache
package. Tokens that came after the last scoring (a question, the answer being decoded) carry no score
(`UNSCORED`): they rank above every scored token, the newest first, so a budget kept while the answer grows evicts
the lowest-scored context first. Without any scoring the policy is a recency window. Options: `chunk`, `reduce`,
`scope`, `layer_budgets`, `sink_length`, and the recent window / `value_norm` of `policy.options.AttentionPolicy`.

`scope="span"` and `layer_budgets="joint"` with `sink_length=4` and `chunk=2048` are the choices of the KVzip paper:
each repeat query's softmax runs over the sinks, the span it repeats and the repeat tokens only (so a token's score
does not shrink with the length of the context), and one ranking over every layer (and, wrapped in `AdaKV`, every
head) decides how many tokens each layer keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..options import check_choice, check_positive_int
from .attention import window_logits
from .base import INF, SlotView
from .options import AttentionPolicy, WithSinks

UNSCORED = -1.0  # the score of a slot no reconstruction has scored yet (scores are >= 0)
REDUCTIONS = ("max", "sum")
SCOPES = ("context", "span")  # what a repeat query's softmax runs over (besides the repeat tokens)
LAYER_BUDGETS = ("uniform", "joint")
DEFAULT_CHUNK = 512
QUERY_BLOCK = 64  # repeat queries whose attention is computed at once (bounds the extra memory)


@dataclass(kw_only=True)
class ReconstructionPolicy(WithSinks, AttentionPolicy):
    """Options:

    - `chunk`: repeated context tokens per scoring forward (default 512).
    - `reduce`: "max" (the largest attention a repeat query gives a slot) or "sum" (their sum).
    - `scope`: "context" (a repeat query's softmax runs over the whole held context and the repeat tokens) or "span"
      (over the first `sink_length` tokens, the span being repeated and the repeat tokens; the repeat of a later
      span starts with the `LEAD_TOKENS` tokens before it).
    - `layer_budgets`: "uniform" (every layer keeps the budget) or "joint" (the layers share `budget x layers` by one
      ranking of all their scores, `caches.evict.reconstruct.share_across_layers`; the mean stays the budget).
    - `sink_length`: the first real tokens always kept (default 0), and always in the softmax of scope "span".
    - those of `AttentionPolicy` (the recent window, `value_norm`).
    """

    name: ClassVar[str] = "reconstruct"
    default_recent_share: ClassVar[float] = 0.0
    scored_outside: ClassVar[bool] = True
    chunk: int = DEFAULT_CHUNK
    reduce: str = "max"
    scope: str = "context"
    layer_budgets: str = "uniform"
    sink_length: int = 0

    def validate(self) -> None:
        super().validate()
        check_positive_int("chunk", self.chunk)
        check_choice("reduce", self.reduce, REDUCTIONS)
        check_choice("scope", self.scope, SCOPES)
        check_choice("layer_budgets", self.layer_budgets, LAYER_BUDGETS)

    @property
    def joint_layers(self) -> bool:
        """Whether the layers share one budget by a joint ranking (`layer_budgets="joint"`)."""
        return self.layer_budgets == "joint"

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        sinks, recent = self.split(budget)
        scores = view.scores
        unscored = scores < 0
        # tokens newer than the last scoring: above every scored token, the newest first
        above = scores.clamp_min(0).amax(-1, keepdim=True) + 1 + view.positions.float()
        return torch.where(unscored, above, scores).masked_fill(view.first(sinks) | view.last(recent), INF)


def reconstruction_scores(queries: torch.Tensor, query_positions: torch.Tensor, query_valid: torch.Tensor,
                          keys: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor, scaling: float,
                          scored: int, reduce: str = "max", block: int = QUERY_BLOCK) -> torch.Tensor:
    """What the repeat queries of one forward give the first `scored` held slots: `[batch, kv_heads, scored]`
    float32, the largest (or summed) attention probability over the queries and the query heads of each KV group.

    `queries [batch, heads, W, head_dim]` (post-RoPE) at `query_positions [W]` with `query_valid [batch, W]`; `keys
    [batch, kv_heads, slots, head_dim]` at `key_positions` / `key_valid [batch, kv_heads, slots]` (every key the
    forward attends to: the held context and the repeat tokens; causal by position). The softmax runs over all of
    them, `block` queries at a time."""
    out = None
    for s in range(0, queries.shape[2], block):
        logits = window_logits(queries[:, :, s : s + block], query_positions[s : s + block],
                               query_valid[:, s : s + block], keys, key_positions, key_valid, scaling)
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)[..., :scored]  # [b, kv_heads, group, w, scored]
        part = probs.amax(dim=(2, 3)) if reduce == "max" else probs.sum(dim=(2, 3))
        out = part if out is None else (torch.maximum(out, part) if reduce == "max" else out + part)
    return out
