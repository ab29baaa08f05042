"""`EvictionPolicy`: the tiny base every eviction policy subclasses, and `SlotView`, what a policy sees.

A policy overrides one method, `priority(view, budget)`: a number per held slot, higher = keep. `select` keeps the
`budget` slots of highest priority in every (batch row, KV head) -- each KV head keeps its own tokens -- after sending
padding to the bottom (`-inf`), so padding is always evicted first and never counts as a heavy hitter. Protect a slot
by giving it `+inf` (sinks, the recent window); rank the rest by attention score or by position.

What a policy can read (`SlotView`): the accumulated attention mass (`scores`, for policies with `uses_mass`), the
positions and padding flags, the held keys (query-agnostic scores such as the key norm) and values, and `window`:
the attention each of the last `query_window()` queries gives each held slot, recomputed by the layer from the
queries the `"hf_kvcache"` attention reports (`window_attention`), so it covers the queries of several decoding steps
too. A policy with `uses_queries` reads those queries themselves instead (`queries`, their positions and padding
flags, the attention `scaling`, and the model's RoPE `rope` when it `needs_rope`): the expected-attention policy
models the upcoming queries from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..rope import KeyRotation

INF = float("inf")


@dataclass
class SlotView:
    """The held slots of one layer, `[batch, kv_heads, slots]` each, in order of position (oldest first)."""

    scores: torch.Tensor | None  # float32 attention mass received so far (summed over the query heads of the group
    # and the queries, decayed by the policy's `decay`); None unless the policy `uses_mass`
    positions: torch.Tensor  # int: position of the token in its sequence (padding included)
    valid: torch.Tensor  # bool: False for padding
    seen: int = 0  # tokens the layer has seen: the slot at position p was visible to `seen - p` queries
    keys: torch.Tensor | None = None  # [batch, kv_heads, slots, head_dim] held keys (post-RoPE); None if not needed
    window: torch.Tensor | None = None  # [batch, kv_heads, W, slots] float32: attention of each of the last W
    # queries (oldest first, summed over the query heads of the group); 0 where the query could not see the slot
    # (a newer token), and rows of 0 for queries not seen yet or padding queries
    values: torch.Tensor | None = None  # [batch, kv_heads, slots, value_dim] held values; None unless `uses_values`
    queries: torch.Tensor | None = None  # [batch, heads, W, head_dim] the last W queries (post-RoPE, oldest first);
    # None unless `uses_queries`
    query_positions: torch.Tensor | None = None  # [W] int: their positions
    query_valid: torch.Tensor | None = None  # [batch, W] bool: False for padding queries
    scaling: float = 1.0  # the attention's logit scaling (1 / sqrt(head_dim) by default)
    key_bias: torch.Tensor | None = None  # [batch, kv_heads, slots] float32: log of the tokens each slot stands for
    # (merged evicted tokens, `H2OOptions.merge`), added to its logits; None when nothing is merged
    rope: "KeyRotation | None" = None  # the model's RoPE, for policies that `needs_rope`

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
    needs_scores = False  # ranks a "heavy" part of the budget by a score (heavy_length / heavy_ratio apply)
    uses_mass = False  # reads the accumulated attention mass (`view.scores`); the layer stores it only then
    uses_keys = False  # reads the held keys (`view.keys`)
    uses_values = False  # reads the held values (`view.values`); also every policy built with `value_norm`
    ranks_by_attention = False  # its priority is attention (received, or expected): `value_norm` may weight it
    default_value_norm = False
    uses_queries = False  # reads the last `query_window()` queries themselves (`view.queries`), not their attention
    uses_sinks = False
    default_recent_share = 1.0

    def __init__(
        self,
        sink_length: int = 0,
        recent_length: int | None = None,
        recent_ratio: float | None = None,
        heavy_length: int | None = None,
        heavy_ratio: float | None = None,
        window: int = 32,
        decay: float | None = None,
        pool: int = 1,
        value_norm: bool | None = None,
        output_error: bool = False,
    ) -> None:
        # output_error: a slot's score is how far the attention output moves when it is removed (`removal_error`),
        # not the attention it receives; it weighs the values itself, so it replaces the value-norm weighting
        if output_error and value_norm:
            raise ValueError("output_error already weighs each token by its value (how far the output moves without "
                             "it); leave value_norm unset with it")
        self.output_error = output_error
        # the priority is multiplied by the norm of each slot's value: the size of what the token adds to the output
        # when attended (Expected Attention's weighting; measured better for every attention policy on Qwen, README)
        self.value_norm = False if output_error else self.default_value_norm if value_norm is None else value_norm
        if self.value_norm or output_error:
            self.uses_values = True
        self.window = window  # queries of the observation window (policies whose `query_window` uses it)
        self.decay = decay  # accumulated mass fades by `decay` per query (None = plain sum); policies with uses_mass
        self.pool = pool  # width of the pooling over neighbouring slots (1 = none)
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

    def query_window(self) -> int:
        """Recent queries whose attention this policy reads (`view.window`); 0 = none (the default)."""
        return 0

    def needs_rope(self) -> bool:
        """Whether `priority` reads `view.rope` (the cache then needs the model config for it)."""
        return False

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        """`[batch, kv_heads, slots]`: higher = keep. The one method a policy overrides."""
        raise NotImplementedError

    def select(self, view: SlotView, budget: int, protect_last: int = 0, shared: bool = False) -> torch.Tensor | None:
        """Indices `[batch, kv_heads, budget]` (ascending, i.e. oldest first) of the slots to keep; None = keep all.
        `protect_last`: the newest real tokens kept whatever their priority (a question, `H2OCache.evict_to`).
        `shared`: every KV head keeps the same slots, ranked by the priority averaged over the heads (the heads must
        hold the same tokens in the same slots: a layer that always evicts this way does)."""
        if budget >= view.valid.shape[-1]:
            return None
        priority = self._ranked(view, budget, protect_last, shared)
        return priority.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values

    def _ranked(
        self, view: SlotView, budget: int, protect_last: int, shared: bool = False, across_heads: bool = False
    ) -> torch.Tensor:
        """`[batch, kv_heads, slots]` float32 priority: padding `-inf`, the `protect_last` newest real tokens `+inf`;
        `shared`: averaged over the KV heads (protected slots stay `+inf`). `across_heads` (per-head budgets): with
        `value_norm`, the weighted priority of each (row, head) is rescaled to the sum its unweighted priority had over
        the head's unprotected real slots, so the value norms reorder a head's tokens but do not move budget between
        heads: the heads still compare by attention (what Ada-KV compares), not by the scale of their values."""
        priority = self.priority(view, budget).float()
        if self.value_norm:  # protected slots (+inf) stay protected
            weighted = priority * view.values.float().norm(dim=-1)
            if across_heads:
                free = view.valid & priority.isfinite()
                before = priority.masked_fill(~free, 0.0).sum(-1, keepdim=True)
                after = weighted.masked_fill(~free, 0.0).sum(-1, keepdim=True)
                weighted = weighted * (before / after.clamp_min(torch.finfo(torch.float32).tiny))
            priority = torch.where(priority.isinf(), priority, weighted)
        if shared:
            priority = priority.mean(1, keepdim=True).expand_as(priority)
        if protect_last:
            priority = priority.masked_fill(view.last(protect_last), INF)
        return priority.masked_fill(~view.valid, -INF)

    def select_across_heads(
        self, view: SlotView, budget: int, floor: float = 0.2, protect_last: int = 0
    ) -> torch.Tensor | None:
        """Per-head budgets (Ada-KV): `[batch, kv_heads, slots]` bool, the slots to keep, `budget * kv_heads` per row
        shared by the KV heads of a layer by priority (heads whose attention is spread keep more, peaked heads fewer),
        each head keeping at least `floor * budget` of its best slots (and its protected ones). Priorities must be
        comparable across heads (attention-based ones are: each query head's attention, received or expected, sums to
        1; value-norm weighting is rescaled per head, `_ranked`). None = keep all.
        Slots that hold no token (`positions < 0`) are never kept; the `protect_last` newest real tokens always are."""
        b, h, slots = view.valid.shape
        exists = view.positions >= 0
        total = budget * h
        if int(exists.sum(dim=(1, 2)).max()) <= total:
            return None
        priority = self._ranked(view, budget, protect_last, across_heads=True)
        guaranteed = min(slots, max(0, int(floor * budget)))
        if guaranteed:  # each head's best slots rank above every unprotected slot of the layer
            top = priority.topk(guaranteed, dim=-1).indices
            best = priority.gather(-1, top)
            best = torch.where(best > -INF, best.clamp_min(torch.finfo(torch.float32).max), best)
            priority = priority.scatter(-1, top, best)
        flat = priority.reshape(b, h * slots)
        idx = flat.topk(min(total, h * slots), dim=-1).indices
        keep = torch.zeros(b, h * slots, dtype=torch.bool, device=flat.device).scatter_(-1, idx, True)
        return keep.view(b, h, slots) & exists

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _round(x: float) -> int:
    return int(x + 0.5)


def window_logits(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    query_valid: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
    in_dtype: bool = False,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of recent queries over the held keys, per KV head: `[batch, kv_heads, group, W, slots]` float32, `-inf`
    where a query does not see a key.

    `queries [batch, heads, W, head_dim]` (heads a multiple of kv_heads, grouped as GQA does), `query_positions [W]`,
    `query_valid [batch, W]` (False: padding or not seen yet: sees nothing), `keys [batch, kv_heads, slots, head_dim]`,
    `key_positions` / `key_valid [batch, kv_heads, slots]`. A query sees the valid keys at positions up to its own.
    `in_dtype`: the logits are computed in the queries' dtype (keys of the same dtype), then in float32, as the
    `"hf_kvcache"` attention computes them. `key_bias [batch, kv_heads, slots]` is added to every logit of its slot
    (the log weight of a slot that stands for several merged tokens, `H2OOptions.merge`)."""
    b, heads, w, d = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    g = heads // kv_heads
    if in_dtype:
        logits = torch.matmul(queries.reshape(b, kv_heads, g * w, d), keys.transpose(-1, -2)).float()
    else:
        logits = torch.matmul(queries.float().reshape(b, kv_heads, g * w, d), keys.float().transpose(-1, -2))
    logits = logits.mul_(scaling).view(b, kv_heads, g, w, slots)
    if key_bias is not None:
        logits += key_bias[:, :, None, None, :].to(logits.device, torch.float32)
    visible = key_valid[:, :, None, :] & (key_positions[:, :, None, :] <= query_positions[None, None, :, None])
    visible = visible & query_valid[:, None, :, None]
    return logits.masked_fill_(~visible[:, :, None], -INF)


def window_attention(logits: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of recent queries over the held keys, per KV head: `[batch, kv_heads, W, slots]` float32, from their
    logits `[batch, kv_heads, group, W, slots]` (`window_logits`): each query head's softmax over the keys it sees,
    the heads of a group summed; a query that sees no key (padding, not seen yet) gives a row of 0.
    With `values [batch, kv_heads, slots, value_dim]`: each slot's `removal_error` instead of its attention."""
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    return probs.sum(2) if values is None else removal_error(probs, values)


def removal_error(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """How far each query's attention output moves if a slot is removed, summed over the query heads of the group:
    `[batch, kv_heads, W, slots]` float32 from attention `probs [batch, kv_heads, group, W, slots]` and the held
    `values [batch, kv_heads, slots, value_dim]`.

    Removing slot j from a softmax renormalizes the rest, so the output `o = sum_i p_i v_i` becomes
    `(o - p_j v_j) / (1 - p_j)`: it moves by `p_j / (1 - p_j) * |v_j - o|`. Unlike the attention `p_j` alone (or
    `p_j |v_j|`), a token whose value is close to what the head outputs anyway costs little to drop (the criterion of
    CAOTE, Goel et al. 2025)."""
    b, h, g, w, n = probs.shape
    v = values.float()
    out = torch.matmul(probs.reshape(b, h, g * w, n), v)  # [b, h, g*w, d]
    dots = torch.matmul(out, v.transpose(-1, -2))  # [b, h, g*w, n]: o . v_j
    far = (v.square().sum(-1)[:, :, None] - 2 * dots + out.square().sum(-1, keepdim=True)).clamp_min_(0.0).sqrt_()
    moved = probs / (1 - probs).clamp_min(1e-6) * far.view(b, h, g, w, n)
    return moved.sum(2)
