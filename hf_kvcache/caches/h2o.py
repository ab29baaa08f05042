"""`H2OCache`: token eviction by heavy hitters (H2O), recency, attention sinks, strides, or a hybrid of them.

    cache = H2OCache(config=model.config, budget=0.2, policy="hybrid")      # keep 20 % of the tokens seen
    model.generate(ids, cache_implementation="h2o", cache_config={"budget": 256, "policy": "h2o"})

Storage (per layer, `self.store`): `keys`/`values [batch, kv_heads, kept, head_dim]` in the model's dtype, `scores
[batch, kv_heads, kept]` (float32 attention mass received so far), `positions` (int32) and `valid` (bool, False for
padding). Each KV head keeps its own tokens, the same count for every head and row so the tensors stay rectangular;
within a head the kept slots stay in order of position.

Data flow of one forward: `update` appends the new tokens and returns everything held; the `"hf_kvcache"` attention
reports which keys the mask lets any query see (`observe_visible_keys`) and the attention mass each key received,
summed over the query heads of its group and over the queries (`observe_attention`, computed chunk by chunk for long
prompts); the layer adds the mass to the scores and evicts down to the budget with its policy (`hf_kvcache.policy`).
Between two forwards a layer holds at most `budget` tokens; during one, at most `budget` + the new tokens.

Positions and masks after eviction:
* `get_seq_length()` counts tokens seen, so RoPE positions of new tokens continue from there.
* `get_mask_sizes(q)` returns `(held + q, seen - held)`: transformers' mask builder then places the held slots at
  positions `seen - held .. seen - 1`, all before every new query, and the new tokens at their true positions, so new
  queries see every held token and each other causally.
* Left padding: padding keys are marked invalid from the mask and evicted before any real token (priority -inf), and
  kept slots stay in order of position. A row with `r` real tokens holding `kept > r` slots therefore keeps all its
  real tokens plus `kept - r` padding slots at the front -- exactly the slots that transformers' mask (built from the
  2D padding mask at positions `seen - kept ..`) marks as padding; with `kept <= r` no padding is held and those
  positions are all real. So the shared `[batch, 1, q, kv]` mask is right for every head, although heads keep
  different tokens. Right padding is not supported (generate never produces it).

Every policy needs the `"hf_kvcache"` attention (for the scores, and for the padding of the new tokens). With another
attention implementation the next `update` raises an error that says what to set; `generate(cache_implementation=
"h2o")` switches the model by itself (`needs_attention_mass`).

`crop` works while nothing was evicted yet (the scores then keep the mass the cropped queries gave); once tokens were
evicted it raises, since the state before the cropped tokens cannot be restored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..options import CacheOptions, check_choice
from ..policy import POLICIES, EvictionPolicy, SlotView
from .base import LAYER_ATTR, CompressedCache, CompressedLayer

DEFAULT_SINK_LENGTH = 4
SPLIT_OPTIONS = ("recent_length", "recent_ratio", "heavy_length", "heavy_ratio")

MISSING_MASS = (
    "{cls}: the attention mass of the previous forward never arrived. This cache (policy={policy!r}) evicts tokens "
    "using the attention they receive and the padding of each row, which only the 'hf_kvcache' attention reports: "
    "load the model with attn_implementation='hf_kvcache' (or call model.set_attn_implementation('hf_kvcache')), "
    "then cache.reset(). generate(cache_implementation='h2o') switches the model by itself."
)


@dataclass
class H2OOptions(CacheOptions):
    """`budget`: tokens kept per KV head -- an int (that many) or a float in (0, 1] (that fraction of the tokens seen,
    rounded up). `policy`: h2o (heavy hitters + recent window), recent (sliding window / LRU), sinks (first tokens +
    recent), strided (recent + evenly strided older tokens), hybrid (sinks + heavy hitters + recent).
    The recent window: at most one of `recent_length`, `recent_ratio` (fraction of the budget), `heavy_length`,
    `heavy_ratio` (the window is what the heavy part leaves); default half of what the sinks leave. `sink_length`:
    first tokens always kept by sinks / hybrid (default 4)."""

    budget: int | float = 0.2
    policy: str = "h2o"
    sink_length: int | None = None
    recent_length: int | None = None
    recent_ratio: float | None = None
    heavy_length: int | None = None
    heavy_ratio: float | None = None

    def validate(self) -> None:
        check_choice("policy", self.policy, tuple(POLICIES))
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ValueError(f"budget must be an int (tokens) or a float in (0, 1] (ratio), got {b!r}")
        if isinstance(b, int) and b < 1:
            raise ValueError(f"budget must be at least 1 token, got {b}")
        if isinstance(b, float) and not 0.0 < b <= 1.0:
            raise ValueError(f"a float budget is a ratio of the tokens seen, in (0, 1]; got {b}")
        for name in ("sink_length", "recent_length", "heavy_length"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        for name in ("recent_ratio", "heavy_ratio"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
                raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
        given = [n for n in SPLIT_OPTIONS if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of {list(SPLIT_OPTIONS)} (got {given}): the heavy part is what the sinks and the "
                "recent window leave of the budget"
            )
        policy = POLICIES[self.policy]
        if given and not policy.needs_scores and policy.default_recent_share == 1.0:
            raise ValueError(
                f"policy {self.policy!r} keeps the most recent tokens (after its sinks); {given[0]} applies to the "
                "h2o, hybrid and strided policies"
            )
        if given and given[0].startswith("heavy") and not policy.needs_scores:
            raise ValueError(f"{given[0]} applies to the h2o and hybrid policies, not {self.policy!r}")
        if self.sink_length is not None and not policy.uses_sinks:
            raise ValueError(f"sink_length applies to the sinks and hybrid policies, not {self.policy!r}")

    def budget_for(self, seen: int) -> int:
        """Tokens kept per KV head once `seen` tokens went through."""
        if isinstance(self.budget, float):
            return max(1, math.ceil(self.budget * seen - 1e-9))
        return self.budget

    def make_policy(self) -> EvictionPolicy:
        sink = self.sink_length if self.sink_length is not None else DEFAULT_SINK_LENGTH
        return POLICIES[self.policy](
            sink_length=sink, recent_length=self.recent_length, recent_ratio=self.recent_ratio,
            heavy_length=self.heavy_length, heavy_ratio=self.heavy_ratio,
        )


class H2OLayer(CompressedLayer):
    """One layer's kept tokens, their scores, positions and padding flags (see the module docstring)."""

    options: H2OOptions
    wants_attention_mass = True  # all policies: the scores, and the padding flags of new tokens

    def __init__(self, options: H2OOptions | None = None) -> None:
        super().__init__(options if options is not None else H2OOptions())
        self.policy = self.options.make_policy()
        self._pending = 0  # tokens of the last update still waiting for their attention mass

    # ---- storage ------------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_states(key_states, value_states)
        if self._pending:
            raise RuntimeError(MISSING_MASS.format(cls=type(self).__name__, policy=self.options.policy))
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.append(key_states, value_states)
        self._pending = key_states.shape[-2]
        keys, values = self.store["keys"], self.store["values"]
        setattr(keys, LAYER_ATTR, self)
        return keys, values

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, n = key_states.shape[:3]
        start = self.cumulative_length - n
        dev = key_states.device
        new = {
            "keys": key_states,
            "values": value_states,
            "scores": torch.zeros(b, h, n, dtype=torch.float32, device=dev),
            "positions": torch.arange(start, start + n, dtype=torch.int32, device=dev).expand(b, h, n).contiguous(),
            "valid": torch.ones(b, h, n, dtype=torch.bool, device=dev),
        }
        for name, t in new.items():
            self.store[name] = torch.cat([self.store[name], t], dim=2) if name in self.store else t

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store["keys"], self.store["values"]

    # ---- what the attention function reports --------------------------------------------------------------------
    def observe_visible_keys(self, visible: torch.Tensor | None) -> None:
        if visible is None or not self._pending:
            return
        n = self._pending
        valid = self.store["valid"]
        if visible.shape != (valid.shape[0], valid.shape[2]):
            raise ValueError(f"visible keys {tuple(visible.shape)} do not match the held slots {tuple(valid.shape)}")
        valid[:, :, -n:] &= visible[:, None, -n:].to(valid.device)

    def observe_attention(self, mass: torch.Tensor) -> None:
        if not self._pending:
            return  # e.g. the attention of a layer called twice per forward: count the first call only
        scores = self.store["scores"]
        if mass.shape != scores.shape:
            raise ValueError(f"attention mass {tuple(mass.shape)} does not match the held slots {tuple(scores.shape)}")
        scores += mass.to(scores.device, torch.float32)
        self._pending = 0
        self.evict()

    # ---- eviction -----------------------------------------------------------------------------------------------
    def slot_view(self) -> SlotView:
        return SlotView(self.store["scores"], self.store["positions"], self.store["valid"])

    def evict(self) -> None:
        """Keep the policy's `budget` slots of every (row, KV head)."""
        if not self.store:
            return
        keep = self.policy.select(self.slot_view(), self.options.budget_for(self.cumulative_length))
        if keep is None:
            return

        def take(t: torch.Tensor) -> torch.Tensor:
            idx = keep if t.dim() == 3 else keep.unsqueeze(-1).expand(*keep.shape, t.shape[-1])
            return t.gather(2, idx)

        self._map_store(take)

    # ---- positions, masks, batch contract -----------------------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.tokens_held()
        return held + query_length, self.cumulative_length - held

    def evicted(self) -> int:
        return self.cumulative_length - self.tokens_held() if self._pending == 0 else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized and self.evicted() > 0:
            raise ValueError(
                f"H2OCache cannot crop {-tokens_to_remove} token(s): this layer already evicted "
                f"{self.evicted()} of the {self.cumulative_length} tokens it saw, so the cache before those tokens "
                "cannot be restored. Assisted / speculative decoding needs a cache that does not evict (or a budget "
                "that covers the whole sequence)."
            )
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self._pending = 0


class H2OCache(CompressedCache):
    """Evicting KV cache: `H2OCache(config=model.config, budget=0.2, policy="h2o")`. See the module docstring."""

    options_class = H2OOptions
    layer_class = H2OLayer
    needs_attention_mass = True  # generate(cache_implementation=...) switches the model to the hf_kvcache attention

    def tokens_held(self, layer_idx: int = 0) -> int:
        """Slots held per (row, KV head) by layer `layer_idx`."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer.tokens_held() if isinstance(layer, CompressedLayer) else 0
