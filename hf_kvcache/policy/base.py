"""`EvictionPolicy`: the small dataclass every eviction policy subclasses, and `SlotView`, what a policy sees.

A policy is a dataclass whose fields are its own options, checked when it is built (`validate`), and it overrides
one method, `priority(view, budget)`: a number per held slot, higher = keep. `select` keeps the `budget` slots of
highest priority in every (batch row, KV head) -- each KV head keeps its own tokens -- after sending padding to the
bottom (`-inf`), so padding is always evicted first and never counts as a heavy hitter. Protect a slot by giving it
`+inf` (sinks, the recent window); rank the rest by attention score or by position.

What a policy can read (`SlotView`): the accumulated attention mass (`scores`, for policies that `uses_mass`), the
positions and padding flags, the held keys (query-agnostic scores such as the key norm) and values, and `window`:
the attention each of the last `query_window()` queries gives each held slot, recomputed by the layer from the
queries the `"hf_kvcache"` attention reports (`policy.attention.window_attention`), so it covers the queries of
several decoding steps too. A policy with `uses_queries` reads those queries themselves instead (`queries`, their
positions and padding flags, the attention `scaling`, and the model's RoPE `rope` when it `needs_rope`).

The properties below (`uses_mass`, `value_weighted`, `mass_decay`, ...) are what the evicting layer asks a policy;
the option groups of `policy.options` and the wrappers of `policy.wrappers` (Ada-KV head budgets, per-layer
pyramid budgets, shared heads, merging) answer them. New policy: one module with a subclass, one `register_policy`
line (`policy/__init__.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..rope import KeyRotation

INF = float("inf")
DEFAULT_CROP_WINDOW = 32  # queries a layer keeps so that `crop` can undo the mass they gave (mass policies)


@dataclass
class SlotView:
    """The held slots of one layer, `[batch, kv_heads, slots]` each, in order of position (oldest first)."""

    scores: torch.Tensor | None  # float32 attention mass received so far (summed over the query heads of the group
    # and the queries, faded by the policy's `mass_decay`), or the score written between forwards (`scored_outside`);
    # None unless the policy `uses_mass` or is `scored_outside`
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
    # (evicted tokens merged into it, `policy.wrappers.Merge`), added to its logits; None when nothing is merged
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


@dataclass
class EvictionPolicy:
    """Base of the eviction policies (see the module docstring). Subclasses set `name`, declare their options as
    dataclass fields (keyword-only), extend `validate` (calling `super().validate()`) and override `priority`.

    The budget (tokens kept per KV head) is split into sinks (`sink_count`), a recent window (`recent_tokens`, by
    default `default_recent_share` of what the sinks leave) and the rest, ranked by the policy's priority."""

    name: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = False  # ranks a "heavy" part of the budget by a score
    ranks_by_attention: ClassVar[bool] = False  # its priority is attention (received or expected): comparable
    # across heads (Ada-KV head budgets), and a value-norm weighting may apply
    uses_keys: ClassVar[bool] = False  # reads the held keys (`view.keys`)
    uses_queries: ClassVar[bool] = False  # reads the last `query_window()` queries themselves (`view.queries`)
    default_recent_share: ClassVar[float] = 1.0

    # ---- what the layer asks (option groups and wrappers override these defaults, some with properties) ----------
    uses_mass: ClassVar[bool] = False  # the layer accumulates the attention mass each slot receives (`view.scores`)
    scored_outside: ClassVar[bool] = False  # the slots carry a score written between forwards (`view.scores`; the
    # context reconstruction, `caches.evict.reconstruct`), `policy.reconstruct.UNSCORED` until it is written
    value_weighted: ClassVar[bool] = False  # the priority is multiplied by each slot's value norm (`scores`)
    by_output_error: ClassVar[bool] = False  # the window attention is replaced by each slot's removal error
    mass_decay: ClassVar[float | None] = None  # factor (< 1) by which the accumulated mass fades per query
    crop_queries: ClassVar[int] = DEFAULT_CROP_WINDOW  # queries kept, while nothing was evicted, so that `crop` can
    # take out the mass they gave (read only when the policy `uses_mass`)
    sink_count: ClassVar[int] = 0  # first real tokens always kept (attention sinks)
    joint_layers: ClassVar[bool] = False  # the layers share the budget by one ranking of all their scores (scored
    # between forwards: `caches.evict.reconstruct.share_across_layers`) instead of each keeping its own
    ragged_heads: ClassVar[bool] = False  # the heads of a layer share its budget (`select_across_heads`, Ada-KV)
    # instead of each keeping `budget` slots (`select`)
    merging: ClassVar["EvictionPolicy | None"] = None  # the `policy.wrappers.Merge` that folds evicted tokens into
    # kept ones; None = dropped

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError that names the fix when an option is out of range (subclasses extend it)."""

    @property
    def core(self) -> "EvictionPolicy":
        """The policy that ranks, under any wrappers."""
        return self

    @property
    def uses_values(self) -> bool:
        """Whether `priority` / `ranked` read the held values (`view.values`)."""
        return self.value_weighted or self.by_output_error

    def layer_scales(self, layers: int) -> list[float]:
        """Budget factor of each of `layers` evicting layers (1 everywhere unless `policy.wrappers.Pyramid`)."""
        return [1.0] * layers

    def query_window(self) -> int:
        """Recent queries whose attention this policy reads (`view.window`); 0 = none (the default)."""
        return 0

    def needs_rope(self) -> bool:
        """Whether `priority` reads `view.rope` (the cache then needs the model config for it)."""
        return False

    # ---- the ranking ----------------------------------------------------------------------------------------------
    def split(self, budget: int) -> tuple[int, int]:
        """(sinks, recent window) for a budget of `budget` tokens; the heavy part is what they leave."""
        sinks = min(self.sink_count, budget)
        rest = budget - sinks
        return sinks, max(0, min(self.recent_tokens(budget, rest), rest))

    def recent_tokens(self, budget: int, rest: int) -> int:
        """The recent window for `budget` tokens of which the sinks leave `rest` (before clamping to `rest`)."""
        return _round(self.default_recent_share * rest)

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        """`[batch, kv_heads, slots]`: higher = keep. The one method a policy overrides."""
        raise NotImplementedError

    def scores(self, view: SlotView, budget: int, across_heads: bool = False) -> torch.Tensor:
        """`[batch, kv_heads, slots]` float32: the priority, times each slot's value norm when `value_weighted`
        (protected `+inf` slots stay protected). `across_heads` (per-head budgets): the weighted priority of each
        (row, head) is rescaled to the sum its unweighted priority had over the head's unprotected real slots, so
        the value norms reorder a head's tokens but move no budget between heads: the heads still compare by
        attention (what Ada-KV compares), not by the scale of their values."""
        priority = self.priority(view, budget).float()
        if self.value_weighted:
            weighted = priority * view.values.float().norm(dim=-1)
            if across_heads:
                free = view.valid & priority.isfinite()
                before = priority.masked_fill(~free, 0.0).sum(-1, keepdim=True)
                after = weighted.masked_fill(~free, 0.0).sum(-1, keepdim=True)
                weighted = weighted * (before / after.clamp_min(torch.finfo(torch.float32).tiny))
            priority = torch.where(priority.isinf(), priority, weighted)
        return priority

    def ranked(self, view: SlotView, budget: int, protect_last: int = 0, across_heads: bool = False) -> torch.Tensor:
        """`[batch, kv_heads, slots]` float32 `scores`, with padding `-inf` and the `protect_last` newest real tokens
        `+inf`."""
        priority = self.scores(view, budget, across_heads)
        if protect_last:
            priority = priority.masked_fill(view.last(protect_last), INF)
        return priority.masked_fill(~view.valid, -INF)

    def select(self, view: SlotView, budget: int, protect_last: int = 0) -> torch.Tensor | None:
        """Indices `[batch, kv_heads, budget]` (ascending, i.e. oldest first) of the slots to keep; None = keep all.
        `protect_last`: the newest real tokens kept whatever their priority (a question, `H2OCache.evict_to`)."""
        if budget >= view.valid.shape[-1]:
            return None
        priority = self.ranked(view, budget, protect_last)
        return priority.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values

    def select_across_heads(self, view: SlotView, budget: int, protect_last: int = 0) -> torch.Tensor | None:
        """`[batch, kv_heads, slots]` bool, the slots to keep when the heads share the layer's budget; only policies
        with `ragged_heads` (`policy.wrappers.AdaKV`) implement it."""
        raise NotImplementedError(f"{type(self).__name__} keeps `budget` slots per head: wrap it in AdaKV")

    # ---- serialization ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """`{"name": ..., option: value, ...}`: JSON-serializable, read back by `policy.policy_from_dict`."""
        out: dict[str, Any] = {"name": self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, EvictionPolicy) else value
        return out

    @classmethod
    def option_names(cls) -> list[str]:
        """The options (dataclass fields) this policy declares."""
        return [f.name for f in dataclasses.fields(cls)]


def _round(x: float) -> int:
    return int(x + 0.5)
