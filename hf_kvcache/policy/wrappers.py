"""Cross-cutting eviction options as wrappers around a policy: `AdaKV(policy)`, `Pyramid(policy, slope)`,
`SharedHeads(policy)`, `Merge(policy, mode)`, `Pooled(policy, pool, mode)`. A wrapper answers what it changes and
hands every other question to the policy it wraps, so wrappers compose (`Merge(Pyramid(TOVAPolicy(), 0.3))`).

- `AdaKV`: per-head budgets inside a layer (Ada-KV, Feng et al. 2024): the layer keeps `budget x kv_heads` slots
  per row, shared by its heads by priority (heads whose attention is spread keep more, peaked heads fewer), each
  head keeping at least `floor` of the budget. Needs a policy that ranks by attention (comparable across heads).
  The layer stores the ragged heads compactly between forwards (`caches.evict.slots.Slots.compact`).
- `Pyramid`: per-layer budgets (PyramidKV, Cai et al. 2024), from (1 + slope) x the budget in the first layer down
  to (1 - slope) x in the last (the same total).
- `SharedHeads`: every KV head of a layer keeps the same tokens, ranked by the policy's priority averaged over the
  layer's KV heads (as kvpress scores TOVA), instead of each head its own.
- `Merge`: an evicted token is folded into the kept slot whose key has the highest cosine with its own (at least
  `similarity`), the slot's value becoming their average weighted by the attention of the last 32 queries;
  `mode="mass"` also raises the slot's logit by the log of the tokens it stands for, `"value"` does not
  (`caches.evict.merge`). Needs a policy that keeps a ring of recent queries (`query_window() > 0`).
- `Pooled`: each slot's score becomes the maximum (`mode="max"`) or the mean (`"avg"`) of the policy's scores over
  the `pool` slots centred on it (slots are in order of position), so that a kept token keeps its neighbours (the
  digits of a number beside the one the scorer found); protected (`+inf`) and padding slots neither give nor take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..options import check_choice, check_number
from .attention import check_pool, pool_scores
from .base import INF, EvictionPolicy, SlotView
from .options import RingPolicy
from .registry import POLICIES

MERGE_MODES = ("value", "mass")
DEFAULT_MERGE_SIMILARITY = 0.5  # lowest key cosine between an evicted token and the kept slot it is folded into
DEFAULT_HEAD_FLOOR = 0.2  # AdaKV: each head keeps at least this fraction of the budget


def _forwarded(name: str) -> property:
    """A read-only property answering with the wrapped policy's `name`."""
    return property(lambda self: getattr(self.policy, name), doc=f"The wrapped policy's `{name}`.")


@dataclass
class PolicyWrapper(EvictionPolicy):
    """Hands every question to the wrapped `policy` (the properties of `FORWARDED` too); subclasses override what
    they change."""

    policy: EvictionPolicy

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.policy, EvictionPolicy):
            raise ValueError(f"{type(self).__name__} wraps an EvictionPolicy (e.g. {type(self).__name__}"
                             f"(TOVAPolicy())), got {self.policy!r}")

    def find(self, kind: type) -> EvictionPolicy | None:
        """The wrapper of type `kind` in this chain (this one included), or None."""
        inner: EvictionPolicy = self
        while isinstance(inner, PolicyWrapper):
            if isinstance(inner, kind):
                return inner
            inner = inner.policy
        return None

    @property
    def core(self) -> EvictionPolicy:
        return self.policy.core

    def layer_scales(self, layers: int) -> list[float]:
        return self.policy.layer_scales(layers)

    def query_window(self) -> int:
        return self.policy.query_window()

    def needs_rope(self) -> bool:
        return self.policy.needs_rope()

    def split(self, budget: int) -> tuple[int, int]:
        return self.policy.split(budget)

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        return self.policy.priority(view, budget)

    def scores(self, view: SlotView, budget: int, across_heads: bool = False) -> torch.Tensor:
        return self.policy.scores(view, budget, across_heads)

    def select_across_heads(self, view: SlotView, budget: int, protect_last: int = 0) -> torch.Tensor | None:
        return self.policy.select_across_heads(view, budget, protect_last)


FORWARDED = ("needs_scores", "ranks_by_attention", "uses_keys", "uses_queries", "uses_mass", "scored_outside",
             "value_weighted",
             "by_output_error", "mass_decay", "crop_queries", "sink_count", "ragged_heads", "merging", "joint_layers")
for _name in FORWARDED:  # what a wrapper does not change, it answers as the policy it wraps
    setattr(PolicyWrapper, _name, _forwarded(_name))


@dataclass
class AdaKV(PolicyWrapper):
    """Per-head budgets (see the module docstring); `floor` in [0, 1]: each head's guaranteed share of the budget."""

    name: ClassVar[str] = "adakv"
    floor: float = DEFAULT_HEAD_FLOOR

    def validate(self) -> None:
        super().validate()
        check_number("floor", self.floor, 0.0, 1.0, hint=" (the share of the budget each head keeps at least)")
        if self.policy.ragged_heads:
            raise ValueError(f"{self.policy!r} shares the budgets across heads already: wrap the policy in AdaKV once")
        if self.find(SharedHeads) is not None:
            raise ValueError("shared_heads (one token set per layer) and head_budgets (a budget per head, AdaKV) "
                             "exclude each other: set one of them")
        if not self.policy.ranks_by_attention:
            users = ", ".join(n for n, p in POLICIES.items() if p.ranks_by_attention)
            raise ValueError(
                f"head_budgets shares a layer's budget across its heads by attention (AdaKV), which needs a policy "
                f"whose scores compare across heads ({users}), not {self.core.name!r}"
            )
        if self.policy.by_output_error:
            raise ValueError("head_budgets (AdaKV) compares heads by the attention their tokens receive; output_error "
                             "scores are in units of each head's values and do not compare across heads: set one of "
                             "them")

    @property
    def ragged_heads(self) -> bool:
        return True

    def select_across_heads(self, view: SlotView, budget: int, protect_last: int = 0) -> torch.Tensor | None:
        """`[batch, kv_heads, slots]` bool, the slots to keep: `budget * kv_heads` per row shared by the KV heads by
        priority, each head keeping at least `floor * budget` of its best slots (and its protected ones). None =
        keep all. Slots that hold no token (`positions < 0`) are never kept; the `protect_last` newest real tokens
        always are."""
        b, h, slots = view.valid.shape
        exists = view.positions >= 0
        total = budget * h
        if int(exists.sum(dim=(1, 2)).max()) <= total:
            return None
        priority = self.ranked(view, budget, protect_last, across_heads=True)
        guaranteed = min(slots, max(0, int(self.floor * budget)))
        if guaranteed:  # each head's best slots rank above every unprotected slot of the layer
            top = priority.topk(guaranteed, dim=-1).indices
            best = priority.gather(-1, top)
            best = torch.where(best > -INF, best.clamp_min(torch.finfo(torch.float32).max), best)
            priority = priority.scatter(-1, top, best)
        flat = priority.reshape(b, h * slots)
        idx = flat.topk(min(total, h * slots), dim=-1).indices
        keep = torch.zeros(b, h * slots, dtype=torch.bool, device=flat.device).scatter_(-1, idx, True)
        return keep.view(b, h, slots) & exists


@dataclass
class Pyramid(PolicyWrapper):
    """Per-layer budgets (see the module docstring); `slope` in [0, 1)."""

    name: ClassVar[str] = "pyramid"
    slope: float = 0.0

    def validate(self) -> None:
        super().validate()
        p = self.slope
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise ValueError(
                f"pyramid must be a number in [0, 1) (layer budgets from (1 + pyramid) x budget in the first layer "
                f"down to (1 - pyramid) x in the last), got {p!r}"
            )
        if self.policy.joint_layers:
            raise ValueError("pyramid sets fixed per-layer budgets, layer_budgets='joint' shares them by the scores: "
                             "set one of them")

    def layer_scales(self, layers: int) -> list[float]:
        """1 + slope in the first layer down to 1 - slope in the last, linearly (the mean stays 1)."""
        p = self.slope or 0.0
        if layers < 2:
            return [1.0] * layers
        return [1.0 + p - 2.0 * p * i / (layers - 1) for i in range(layers)]


@dataclass
class SharedHeads(PolicyWrapper):
    """One token set per layer (see the module docstring)."""

    name: ClassVar[str] = "shared_heads"

    def validate(self) -> None:
        super().validate()
        if self.policy.ragged_heads:
            raise ValueError("shared_heads (one token set per layer) and head_budgets (a budget per head, AdaKV) "
                             "exclude each other: set one of them")

    def scores(self, view: SlotView, budget: int, across_heads: bool = False) -> torch.Tensor:
        """The policy's scores averaged over the KV heads (protected slots stay `+inf`); the heads must hold the same
        tokens in the same slots, which a layer that always evicts this way does."""
        priority = self.policy.scores(view, budget, across_heads)
        return priority.mean(1, keepdim=True).expand_as(priority)


@dataclass
class Merge(PolicyWrapper):
    """Fold evicted tokens into kept ones (see the module docstring); `mode` "value" or "mass", `similarity` the
    lowest key cosine a fold accepts."""

    name: ClassVar[str] = "merge"
    mode: str = "mass"
    similarity: float = DEFAULT_MERGE_SIMILARITY

    def validate(self) -> None:
        super().validate()
        check_choice("merge", self.mode, MERGE_MODES)
        check_number("merge_similarity", self.similarity, -1.0, 1.0, hint=" (a key cosine)")
        if self.policy.query_window() < 1:
            users = " / ".join(n for n, p in POLICIES.items() if issubclass(p, RingPolicy))
            raise ValueError(f"merge folds evicted tokens into kept ones weighted by the attention of the last "
                             f"queries, which the {users} policies keep; not {self.core.name!r}")

    @property
    def merging(self) -> "Merge":
        return self


@dataclass
class Pooled(PolicyWrapper):
    """Scores pooled over neighbouring slots (see the module docstring); `pool` odd, `mode` "max" or "avg"."""

    name: ClassVar[str] = "pooled"
    pool: int = 7
    mode: str = "max"

    def validate(self) -> None:
        super().validate()
        check_pool(self.pool, self.mode)

    def scores(self, view: SlotView, budget: int, across_heads: bool = False) -> torch.Tensor:
        return pool_scores(self.policy.scores(view, budget, across_heads), view.valid, self.pool, self.mode)
