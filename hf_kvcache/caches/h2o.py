"""`H2OCache`: token eviction -- heavy hitters (H2O), TOVA, SnapKV, expected attention, key norm, recency, attention
sinks, strides, or a hybrid -- optionally storing the kept tokens quantized.

    cache = H2OCache(config=model.config, budget=0.2, policy="snapkv")      # keep 20 % of the tokens seen
    model.generate(ids, cache_implementation="h2o", cache_config={"budget": 256, "policy": "tova", "quant_bits": 4})

Storage (per layer, `layer.slots`, an `H2OSlots`; every tensor `[batch, kv_heads, kept, ...]`): `keys`/`values [..,
head_dim]` in the model's dtype, or with `quant_bits` their KIVI-style codes (`KIVIQuantized`: codes packed along
head_dim, per-token fp16 scale / zero `[.., groups]`; keys by default with RoPE undone and each channel shifted and
scaled first, by the layer's `key_codec`, `quant.prerope.PreRopeKeys`, whose float32 shift / scale `[1, kv_heads, 1,
head_dim]` count too); `scores` (float32 attention mass received so far; only for
policies that accumulate it, h2o / hybrid); `positions` (int32) and `valid` (bool, False for padding). Read them with
`held_positions()`, `held_valid()`, `held_scores()`, `held_keys_values()` (rectangular also while compact). Each KV head keeps its
own tokens, the same count for every head and row so the tensors stay rectangular; within a head the kept slots stay
in order of position. Window policies (tova, snapkv, expected) also hold the queries of the last `window` positions
(`queries [batch, heads, W, head_dim]` in 16 bits, their positions and padding flags): from them the layer recomputes,
at each eviction, the attention those queries give the held tokens (`policy.base.window_attention`), over one forward
or several decoding steps alike; expected reads the queries themselves (it models the next ones from them, moved by
the model's RoPE, which the cache builds from `config`). Every tensor counts in `memory_stats()`.

Data flow of one forward: `update` appends the new tokens (quantized when `quant_bits` is set; attention then sees the
held tokens dequantized and the new ones exact) and returns everything held; the `"hf_kvcache"` attention reports the
last queries (`observe_queries`: window policies, and h2o / hybrid until they evict, for `crop`), which keys the mask lets any query see
(`observe_visible_keys`) and the attention mass each key received, summed over the query heads of its group and over
the queries (`observe_attention`, computed chunk by chunk for long prompts); the layer adds the mass to the scores
(fading them by `decay` first) and evicts down to the budget with its policy (`hf_kvcache.policy`). Between two
forwards a layer holds at most `budget` tokens; during one, at most `budget` + the new tokens. With `pyramid`, each
layer has its own budget (the first the largest); the attention mask transformers builds for the first layer is read
from its last columns by the others (`mask_from_end`).

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

`crop` works while nothing was evicted yet, and leaves the layer the one that never saw the cropped tokens. With the
policies that accumulate mass (h2o, hybrid), a layer keeps until its first eviction the queries of the last
`crop_window` positions (32, in the model's dtype; counted in `memory_stats()`; none when the budget never evicts),
from which `crop` recomputes the attention mass the cropped queries gave and takes it out of the scores (undoing the
decay too). Window policies need nothing more: n cropped tokens mean n new ones before the next eviction, which
refill their window. A crop whose mass it cannot take out -- more tokens than `crop_window`, or `quant_bits` with h2o
/ hybrid (the new keys those queries saw exactly are now stored quantized) -- still crops the storage (the prefix
store encodes cropped copies), and the next update raises a ValueError that says what to change. Any crop once
tokens were evicted raises at once (the state before the cropped tokens cannot be restored).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch

from ..options import CacheOptions, check_choice, check_int, check_number, check_positive_int
from ..policy import POLICIES, EvictionPolicy, SlotView
from ..policy.base import window_attention, window_logits
from ..policy.ring import QueryRing
from ..quant.kivi import KIVIQuantized, dequantize_kivi, quantize_kivi
from ..quant.prerope import PreRopeKeys
from ..rope import KeyRotation
from .base import FP16_BYTES, CompressedCache, CompressedLayer
from .merge import MERGE_MODES, fold_evicted
from .window import QuantizedWindowLayer

DEFAULT_SINK_LENGTH = 4
DEFAULT_CROP_WINDOW = 32  # queries kept so that `crop` can undo what they did (see H2OOptions.crop_window)
SPLIT_OPTIONS = ("recent_length", "recent_ratio", "heavy_length", "heavy_ratio")

MISSING_MASS = (
    "{cls}: the attention mass of the previous forward never arrived. This cache (policy={policy!r}) evicts tokens "
    "using the attention they receive and the padding of each row, which only the 'hf_kvcache' attention reports: "
    "load the model with attn_implementation='hf_kvcache' (or call model.set_attn_implementation('hf_kvcache')), "
    "then cache.reset(). generate(cache_implementation='h2o') switches the model by itself."
)


QUANT_BITS = (None, 8, 4, 2)
KEY_QUANT = ("prerope", "token")  # how `quant_bits` stores keys (H2OOptions.key_quant)
WINDOW_POLICIES = ("snapkv", "expected")  # policies whose query window `window` sets
MERGE_POLICIES = ("tova", "snapkv", "expected")  # policies that keep a ring of queries (what `merge` reads)
MERGE_WINDOW = 32  # queries whose attention weighs a merge (the ring holds at least that many with `merge`)
DEFAULT_MERGE_SIMILARITY = 0.5  # lowest key cosine between an evicted token and the kept slot it is folded into
VALUE_NORM_POLICIES = tuple(n for n, p in POLICIES.items() if p.ranks_by_attention)
POLICY_OPTIONS = {  # policy-specific options: the policies they apply to
    "pool": ("snapkv",), "future": ("expected",), "mass_share": ("expected",),
    "sinks_in_softmax": ("expected",), "value_norm": VALUE_NORM_POLICIES, "output_error": MERGE_POLICIES,
}


@dataclass
class H2OOptions(CacheOptions):
    """`budget`: tokens kept per KV head -- an int >= 2 (that many) or a float in (0, 1] (that fraction of the tokens
    seen, rounded up; 1.0 keeps everything). `policy`: h2o (heavy hitters by accumulated attention + recent window),
    tova (attention of the newest query), snapkv (attention of the last `window` queries + that window),
    expected (the attention the next queries are expected to give, modelled from the last `window` queries, times
    the value norm; + sinks), knorm (lowest key norm, no attention needed), recent (sliding window / LRU), sinks
    (first tokens + recent), strided (recent + evenly strided older tokens), hybrid (sinks + heavy hitters + recent).
    The recent window: at most one of `recent_length`, `recent_ratio` (fraction of the budget), `heavy_length`,
    `heavy_ratio` (the window is what the heavy part leaves); default: the policy's share. `sink_length`: first tokens
    always kept by sinks / hybrid / expected (default 4). `decay` in (0, 1]: the accumulated mass of h2o / hybrid
    fades by that factor per query (None = plain sum). `window`: snapkv's observation window, expected's recent
    queries, in queries (default 32). `pool`: snapkv's pooling width over neighbouring slots (odd; default 1 = none).
    `future` (expected): the modelled queries are moved by RoPE to the next `future` positions (default 512; 0 keeps
    them where they are and needs no config); `mass_share` (expected, in [0, 1), default 0): the share of the
    priority taken from the attention mass the tokens received (h2o's score); `sinks_in_softmax` (expected, default
    True): False normalizes the expected attention over the evictable keys only (kvpress's choice). `value_norm`
    (h2o, hybrid, tova, snapkv, expected; default True for expected, False for the others): multiply each token's
    score by the norm of its value. `output_error` (tova, snapkv, expected; default False): rank each token by how
    far the attention output of the scoring queries (received, or expected) would move without it, `p / (1 - p) *
    |v - o|` per query head (`policy.base.removal_error`), instead of by its attention; it replaces `value_norm`.
    `quant_bits`: None keeps the kept tokens in the model's dtype; 8, 4 or 2 stores them quantized (KIVI-style
    asymmetric min/max groups of `quant_group_size` channels per token, fp16 scale and zero; default group: the whole
    head), so `memory_stats()` shows the real bytes. `key_quant` (with `quant_bits`): `"prerope"` (default) quantizes
    the keys with RoPE undone, each channel shifted by its mean and divided by its RMS (fitted once per layer, from
    the keys it holds when it has seen 32, float32 per KV head and channel, counted), and redoes RoPE on reading (`quant.prerope`; needs the
    config); `"token"` quantizes the post-RoPE keys as they come. Qwen2.5-0.5B, tova 40 % at 4 bits: +0.53 % perplexity
    at 8.12x with `"prerope"`, +96 % at 8.19x with `"token"` (README).
    `pyramid` p in [0, 1): per-layer budgets (PyramidKV-style), from (1 + p) x the budget in the first layer down to
    (1 - p) x in the last (same total). `min_budget`: with a ratio budget, never keep fewer than this many tokens
    (a ratio of the few tokens seen at the start of a stream is tiny: 20 % of the first 32 is 7).
    `head_budgets`: per-head budgets inside a layer (Ada-KV): the layer keeps `budget x kv_heads` slots per row, shared
    by the heads by score (each head keeps at least a fifth of the budget; policies ranking by attention, received or
    expected; a value-norm weighting is rescaled per head so that the heads compare by attention), stored compactly
    between forwards (a flat `[slots, ...]` per tensor plus the count per row and head), so `memory_stats()` counts
    only the kept slots.
    `shared_heads`: every KV head of a layer keeps the same tokens, ranked by the policy's priority averaged over the
    layer's KV heads (kvpress scores TOVA this way) instead of each head its own; in the question-aware passkey
    (SmolLM2, 20 % of 512 tokens kept) it took tova from 0 to 61 % and snapkv from 0 to 28 % (README).
    `merge` (tova, snapkv, expected; default None = drop): an evicted token is folded into the kept slot whose key
    has the highest cosine with its own (at least `merge_similarity`, default 0.5), the slot's value becoming their
    average weighted by the attention of the last 32 queries; `"mass"` also raises the slot's logit by the log of the
    tokens it stands for (one float32 per slot more), `"value"` does not (`caches.merge`). With `quant_bits` the slots
    a fold changed are quantized again.
    `crop_window` (default 32; h2o / hybrid): while a layer has evicted nothing, it keeps the queries of the last
    `crop_window` positions, so that `crop` of up to that many tokens takes the attention mass they gave out of the
    scores (assisted decoding crops the rejected candidates); 0 keeps none (the next forward after a crop raises).
    Not kept when the budget never evicts.
    `evict_every` n (default 1): evict only once the layer holds n tokens over its budget, then back down to the
    budget, so that a decode step ranks and drops tokens once every n new tokens over the budget instead of at every
    step (kvpress's `compression_interval`); the cache holds up to n - 1 tokens over the budget in between, which
    `memory_stats()` counts. For decode speed (README); chunks of more than n new tokens evict at every chunk as
    before. Not with `head_budgets`."""

    budget: int | float = 0.2
    policy: str = "h2o"
    sink_length: int | None = None
    recent_length: int | None = None
    recent_ratio: float | None = None
    heavy_length: int | None = None
    heavy_ratio: float | None = None
    decay: float | None = None
    window: int | None = None
    pool: int | None = None
    future: int | None = None
    mass_share: float | None = None
    sinks_in_softmax: bool | None = None
    value_norm: bool | None = None
    output_error: bool | None = None
    quant_bits: int | None = None
    quant_group_size: int | None = None
    key_quant: str | None = None
    pyramid: float | None = None
    min_budget: int | None = None
    head_budgets: bool = False
    shared_heads: bool = False
    merge: str | None = None
    merge_similarity: float | None = None
    crop_window: int | None = None
    evict_every: int | None = None

    def validate(self) -> None:
        check_choice("policy", self.policy, tuple(POLICIES))
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ValueError(f"budget must be an int (tokens) or a float in (0, 1] (ratio), got {b!r}")
        if isinstance(b, int) and b == 1:
            raise ValueError(
                "budget=1 keeps a single token; for all tokens use budget=1.0 (a float is a ratio of the tokens "
                "seen), for a token count use an int >= 2"
            )
        if isinstance(b, int) and b < 1:
            raise ValueError(f"budget must be at least 2 tokens (an int) or a ratio in (0, 1] (a float), got {b}")
        if isinstance(b, float) and not 0.0 < b <= 1.0:
            raise ValueError(f"a float budget is a ratio of the tokens seen, in (0, 1]; got {b}")
        for name in ("sink_length", "recent_length", "heavy_length"):
            check_int(name, getattr(self, name), lo=0, allow_none=True)
        for name in ("recent_ratio", "heavy_ratio"):
            check_number(name, getattr(self, name), 0.0, 1.0, allow_none=True)
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
                "policies that rank tokens by a score"
            )
        if given and given[0].startswith("heavy") and not policy.needs_scores:
            raise ValueError(
                f"{given[0]} applies to the policies that rank tokens by a score "
                f"({', '.join(sorted(n for n, p in POLICIES.items() if p.needs_scores))}), not {self.policy!r}"
            )
        if self.sink_length is not None and not policy.uses_sinks:
            users = ", ".join(n for n, p in POLICIES.items() if p.uses_sinks)
            raise ValueError(f"sink_length applies to the policies that keep sinks ({users}), not {self.policy!r}")
        if self.decay is not None:
            if not policy.uses_mass:
                raise ValueError(
                    f"decay applies to the policies that accumulate attention mass (h2o, hybrid), not {self.policy!r}"
                )
            check_number("decay", self.decay, 0.0, 1.0, lo_open=True, hint=" (the fading per query)")
        for name, users in (("window", WINDOW_POLICIES), *POLICY_OPTIONS.items()):
            v = getattr(self, name)
            if v is None:
                continue
            if self.policy not in users:
                noun = "policy" if len(users) == 1 else "policies"
                raise ValueError(f"{name} applies to the {' / '.join(users)} {noun}, not {self.policy!r}")
            if name == "future":
                check_int(name, v, lo=0, hint=" (upcoming positions; 0 = no RoPE shift)")
            elif name == "mass_share":
                check_number(name, v, 0.0, 1.0, hi_open=True, hint=" (the share of the received attention mass)")
            elif name in ("value_norm", "sinks_in_softmax", "output_error"):
                if not isinstance(v, bool):
                    raise ValueError(f"{name} must be True or False, got {v!r}")
            else:
                check_positive_int(name, v)
        if self.pool is not None and self.pool % 2 == 0:
            raise ValueError(f"pool must be odd (centred on the slot), got {self.pool}; e.g. pool={self.pool + 1}")
        if self.quant_bits not in QUANT_BITS or isinstance(self.quant_bits, bool):
            raise ValueError(
                f"quant_bits={self.quant_bits!r} is not valid; choose None (the model's dtype), 8, 4 or 2"
            )
        if self.quant_group_size is not None:
            if self.quant_bits is None:
                raise ValueError("quant_group_size applies when quant_bits is set (8, 4 or 2)")
            check_positive_int("quant_group_size", self.quant_group_size)
        if self.key_quant is not None:
            check_choice("key_quant", self.key_quant, KEY_QUANT)
            if self.quant_bits is None:
                raise ValueError("key_quant applies when quant_bits is set (8, 4 or 2)")
        check_int("crop_window", self.crop_window, lo=0, allow_none=True, hint=" (queries kept so that crop can undo them)")
        if self.crop_window is not None and not policy.uses_mass:
            raise ValueError(f"crop_window applies to the policies that accumulate attention mass (h2o, hybrid), not "
                             f"{self.policy!r}")
        if not isinstance(self.head_budgets, bool):
            raise ValueError(f"head_budgets must be True or False, got {self.head_budgets!r}")
        if not isinstance(self.shared_heads, bool):
            raise ValueError(f"shared_heads must be True or False, got {self.shared_heads!r}")
        if self.merge is not None:
            check_choice("merge", self.merge, MERGE_MODES)
            if self.policy not in MERGE_POLICIES:
                raise ValueError(f"merge folds evicted tokens into kept ones weighted by the attention of the last "
                                 f"queries, which the {' / '.join(MERGE_POLICIES)} policies keep; not {self.policy!r}")
        if self.merge_similarity is not None:
            if self.merge is None:
                raise ValueError("merge_similarity applies when merge is set ('value' or 'mass')")
            check_number("merge_similarity", self.merge_similarity, -1.0, 1.0, hint=" (a key cosine)")
        if self.output_error and self.head_budgets:
            raise ValueError("head_budgets compares heads by the attention their tokens receive; output_error scores "
                             "are in units of each head's values and do not compare across heads: set one of them")
        if self.shared_heads and self.head_budgets:
            raise ValueError("shared_heads (one token set per layer) and head_budgets (a budget per head) exclude each "
                             "other: set one of them")
        if self.head_budgets and not policy.ranks_by_attention:
            raise ValueError(
                f"head_budgets shares a layer's budget across its heads by attention, which needs a policy whose "
                f"scores compare across heads ({', '.join(VALUE_NORM_POLICIES)}), not {self.policy!r}"
            )
        if self.evict_every is not None:
            check_positive_int("evict_every", self.evict_every)
            if self.head_budgets and self.evict_every > 1:
                raise ValueError("evict_every applies to uniform budgets; head_budgets re-shares the layer's budget "
                                 "across its heads at every step: set one of them")
        if self.min_budget is not None:
            check_positive_int("min_budget", self.min_budget)
            if not isinstance(b, float):
                raise ValueError("min_budget applies to a ratio budget (a float); an int budget is fixed already")
        p = self.pyramid
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1):
            raise ValueError(
                f"pyramid must be a number in [0, 1) (layer budgets from (1 + pyramid) x budget in the first layer "
                f"down to (1 - pyramid) x in the last), got {p!r}"
            )

    @property
    def prerope_keys(self) -> bool:
        """Whether keys are stored quantized in the pre-RoPE frame (`quant_bits` with `key_quant="prerope"`)."""
        return self.quant_bits is not None and (self.key_quant or "prerope") == "prerope"

    def budget_for(self, seen: int, scale: float = 1.0) -> int:
        """Tokens kept per KV head once `seen` tokens went through, in a layer whose budget is `scale` x the
        budget (per-layer budgets, `pyramid`)."""
        if isinstance(self.budget, float):
            return max(1, self.min_budget or 0, math.ceil(self.budget * scale * seen - 1e-9))
        return max(1, round(self.budget * scale))

    def layer_scales(self, layers: int) -> list[float]:
        """Budget factor of each of `layers` evicting layers: 1 everywhere, or with `pyramid` p a linear ramp from
        1 + p (first layer) down to 1 - p (last), the mean staying 1, so the cache holds the same total."""
        p = self.pyramid or 0.0
        if layers < 2:
            return [1.0] * layers
        return [1.0 + p - 2.0 * p * i / (layers - 1) for i in range(layers)]

    def make_policy(self) -> EvictionPolicy:
        sink = self.sink_length if self.sink_length is not None else DEFAULT_SINK_LENGTH
        extra = {k: getattr(self, k) for k in ("window", *POLICY_OPTIONS) if getattr(self, k) is not None}
        return POLICIES[self.policy](
            sink_length=sink, recent_length=self.recent_length, recent_ratio=self.recent_ratio,
            heavy_length=self.heavy_length, heavy_ratio=self.heavy_ratio, decay=self.decay, **extra,
        )


Stored = Union[torch.Tensor, KIVIQuantized]  # keys / values: in the model's dtype, or KIVI codes per token
RowFn = Callable[[torch.Tensor], torch.Tensor]


def _map(x: Stored, fn: RowFn) -> Stored:
    return x.map_rows(fn) if isinstance(x, KIVIQuantized) else fn(x)


def _tensors(x: Stored) -> list[torch.Tensor]:
    return x.tensors() if isinstance(x, KIVIQuantized) else [x]


@dataclass
class H2OSlots:
    """The slots one H2O layer holds. Rectangular: every tensor `[batch, kv_heads, slots, ...]`, each head's slots in
    order of position; compact (`head_budgets`, between forwards): every tensor flat `[kept, ...]`, in (row, head,
    position) order.

    `keys` / `values [.., head_dim]`: in the model's dtype, or (`quant_bits`) KIVI codes packed along head_dim with
    per-token fp16 scale and zero `[.., groups]`; `positions` int32 (-1: a slot a head does not hold); `valid` bool
    (False for padding and empty slots); `scores` float32, the attention mass received (h2o / hybrid only);
    `log_weight` float32, the log of the tokens each slot stands for (0 unless evicted tokens were folded into it;
    `merge` only)."""

    keys: Stored
    values: Stored
    positions: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor | None = None
    log_weight: torch.Tensor | None = None

    def named(self) -> dict[str, torch.Tensor]:
        """Every tensor by name: `keys` / `values`, or `key_codes`, `key_scale`, `key_zero`, `value_*`; `positions`,
        `valid`, `scores`."""
        out = {}
        for kind, x in (("key", self.keys), ("value", self.values)):
            if isinstance(x, KIVIQuantized):
                out.update({f"{kind}_codes": x.codes, f"{kind}_scale": x.scale, f"{kind}_zero": x.zero})
            else:
                out[f"{kind}s"] = x
        out["positions"], out["valid"] = self.positions, self.valid
        if self.scores is not None:
            out["scores"] = self.scores
        if self.log_weight is not None:
            out["log_weight"] = self.log_weight
        return out

    def tensors(self) -> list[torch.Tensor]:
        return list(self.named().values())

    def map_rows(self, fn: RowFn) -> "H2OSlots":
        """`fn` applied to every tensor (all share their leading dims: a batch-dim operation, a gather or a mask
        along the slots)."""
        return H2OSlots(_map(self.keys, fn), _map(self.values, fn), fn(self.positions), fn(self.valid),
                        None if self.scores is None else fn(self.scores),
                        None if self.log_weight is None else fn(self.log_weight))

    def select(self, index: torch.Tensor) -> "H2OSlots":
        """The slots `index [batch, kv_heads, k]` of each row and head (rectangular storage). Whole slots are copied
        as rows of a flat view (`index_select`), several times faster than an element-wise `gather`."""
        b, h, k = index.shape
        slots = self.positions.shape[2]
        rows = (torch.arange(b * h, device=index.device) * slots)[:, None] + index.reshape(b * h, k)
        rows = rows.reshape(-1)

        def take(t: torch.Tensor) -> torch.Tensor:
            flat = t.reshape(b * h * slots, *t.shape[3:])
            return flat.index_select(0, rows).view(b, h, k, *t.shape[3:])

        return self.map_rows(take)

    def cat(self, newer: "H2OSlots") -> "H2OSlots":
        """These slots followed by `newer` (rectangular storage)."""

        def join(a: Any, b: Any) -> Any:
            if a is None:
                return None
            return a.cat(b) if isinstance(a, KIVIQuantized) else torch.cat([a, b], dim=2)

        return H2OSlots(*(join(getattr(self, f.name), getattr(newer, f.name)) for f in dataclasses.fields(self)))

    def compact(self, keep: torch.Tensor) -> "H2OSlots":
        """Rectangular -> compact: the slots where `keep [batch, kv_heads, slots]` (bool) is True, flat."""
        return self.map_rows(lambda t: t[keep])

    def expand(self, counts: torch.Tensor) -> "H2OSlots":
        """Compact -> rectangular `[batch, kv_heads, M, ...]` (M: the largest of `counts [batch, kv_heads]`), each
        head's slots at the end, the missing ones in front holding nothing (positions -1, valid False, zeros)."""
        m = int(counts.max()) if counts.numel() else 0
        present = torch.arange(m, device=counts.device) >= (m - counts)[..., None]

        def place(t: torch.Tensor, fill: int = 0) -> torch.Tensor:
            out = t.new_full((*counts.shape, m, *t.shape[1:]), fill)
            out[present] = t
            return out

        out = self.map_rows(place)
        out.positions = place(self.positions, -1)
        return out


@dataclass
class DecodedKeys:
    """Quantized keys (`codes`, at `positions`) and their decoding in the model's dtype `[batch, kv_heads, slots,
    head_dim]` (all but the `tail` slots until they are read)."""

    codes: KIVIQuantized
    positions: torch.Tensor
    keys: torch.Tensor
    tail: tuple[KIVIQuantized, torch.Tensor] | None = None  # codes and positions of newer slots, not decoded yet


class H2OLayer(CompressedLayer):
    """One layer's kept tokens, their positions, padding flags and (policy permitting) scores, plus the queries of
    the last `query_window` positions for window policies (see the module docstring)."""

    options: H2OOptions
    wants_attention_mass = True  # all policies: the padding flags of new tokens, and the scores of h2o / hybrid
    mask_from_end = True  # a layer holding fewer slots than the first reads the mask's last columns

    def __init__(self, options: H2OOptions | None = None) -> None:
        super().__init__(options if options is not None else H2OOptions())
        self.policy = self.options.make_policy()
        self.window = self.policy.query_window()  # the queries the policy reads (`view.window`)
        crop = self.options.crop_window
        self.crop_window = DEFAULT_CROP_WINDOW if crop is None else crop
        self.budget_scale = 1.0  # this layer's share of the budget (`pyramid`); set by H2OCache
        self.rope: KeyRotation | None = None  # the model's RoPE, for policies that need it; set by H2OCache
        self.key_codec: PreRopeKeys | None = None  # quant_bits with key_quant="prerope"; set by H2OCache
        self.slots: H2OSlots | None = None  # what the layer holds (None before the first update)
        self.counts: torch.Tensor | None = None  # [batch, kv_heads] slots held while the storage is compact
        self._pending = 0  # tokens of the last update still waiting for their attention mass
        self._decoded_keys: DecodedKeys | None = None  # this step's decoded keys (`_plain_keys`)
        # why a crop left scores it could not correct (the next update raises it); None when they are right
        self.stale_after_crop: str | None = None
        self._clear_queries()

    def _clear_queries(self) -> None:
        self.ring: QueryRing | None = None  # the last `query_window` queries (16- or 8-bit for window policies)
        self._new_queries = 0

    @property
    def query_window(self) -> int:
        """Queries the `"hf_kvcache"` attention reports (`observe_queries`): the policy's window (at least
        `MERGE_WINDOW` with `merge`), plus `crop_window` while `crop` may have to undo what they did (`tracks_crop`)."""
        window = max(self.window, MERGE_WINDOW) if self.options.merge else self.window
        return window + (self.crop_window if self.tracks_crop() else 0)

    def tracks_crop(self) -> bool:
        """Whether the ring keeps queries for `crop`: for the policies that accumulate attention mass (h2o,
        hybrid), while nothing was evicted (crop raises after that), unless the budget never evicts (a ratio of
        1.0). Window policies need none: a crop of n tokens leaves at least n tokens to arrive before the next
        eviction (nothing was evicted with them held), which refill their window."""
        if not self.policy.uses_mass or self._dropped():
            return False
        b = self.options.budget
        return not (isinstance(b, float) and b * self.budget_scale >= 1.0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bits, group = self.options.quant_bits, self.options.quant_group_size
        if bits is not None:
            for name, dim in (("head_dim", key_states.shape[-1]), ("value head_dim", value_states.shape[-1])):
                if (group or dim) > dim or dim % (group or dim) or ((group or dim) * bits) % 8:
                    raise ValueError(
                        f"quant_group_size={group} must divide the {name} {dim} (and hold whole bytes of codes); "
                        f"choose a divisor of {dim} such as {dim // 2}, or leave it None (one group per head)"
                    )
            if self.options.prerope_keys and self.key_codec is None:
                raise ValueError(
                    "quant_bits with key_quant='prerope' (the default) quantizes keys with the model's RoPE undone, "
                    "which the layer gets from H2OCache(config=model.config, ...); or set key_quant='token'"
                )
        super().lazy_initialization(key_states, value_states)

    # ---- storage ------------------------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.options.quant_bits is not None

    def _begin_update(self) -> None:
        self._decoded_keys = None
        if self._pending:
            raise RuntimeError(MISSING_MASS.format(cls=type(self).__name__, policy=self.options.policy))
        if self.stale_after_crop:
            raise ValueError(self.stale_after_crop)
        self._expand()

    def _end_update(self, new_tokens: int) -> None:
        self._pending = new_tokens  # their attention mass is reported by the attention of this forward

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, n = key_states.shape[:3]
        start = self.cumulative_length - n
        dev = key_states.device
        if self.key_codec is not None:
            keys, values = self._quantize_keys(key_states, start), self._quantize(value_states)
        elif self.quantized:
            keys, values = self._quantize(key_states), self._quantize(value_states)
        else:
            keys, values = key_states, value_states
        new = H2OSlots(
            keys, values,
            positions=torch.arange(start, start + n, dtype=torch.int32, device=dev).expand(b, h, n).contiguous(),
            valid=torch.ones(b, h, n, dtype=torch.bool, device=dev),
            scores=torch.zeros(b, h, n, dtype=torch.float32, device=dev) if self.policy.uses_mass else None,
            log_weight=torch.zeros(b, h, n, dtype=torch.float32, device=dev) if self.options.merge == "mass" else None,
        )
        memo, held = self._decoded_keys, self.slots
        self.slots = new if held is None else held.cat(new)
        if memo is not None and held is not None and memo.codes is held.keys and memo.positions is held.positions:
            # the held keys the attention decoded stay valid: the eviction decodes only the new ones
            self._decoded_keys = DecodedKeys(self.slots.keys, self.slots.positions, memo.keys, (keys, new.positions))
        else:
            self._decoded_keys = None

    def _quantize(self, x: torch.Tensor) -> KIVIQuantized:
        """KIVI codes `[b, h, n, packed]`, fp16 scale / zero `[b, h, n, groups]`: token-aligned, so eviction gathers
        them like any other slot tensor."""
        return quantize_kivi(x, self.options.quant_bits, self.options.quant_group_size or x.shape[-1], axis="token")

    def _quantize_keys(self, keys: torch.Tensor, start: int) -> KIVIQuantized:
        """`key_quant="prerope"`: codes of the new `keys [b, h, n, d]` (positions start..start+n-1); the held keys
        are quantized again when the codec fits its statistics now (`PreRopeKeys.encode`)."""
        s = self.slots
        held, new = self.key_codec.encode(keys, start, None if s is None else s.keys, None if s is None else s.valid)
        if s is not None and held is not s.keys:
            self.slots = dataclasses.replace(s, keys=held)
        return new

    def _plain(self, x: Stored) -> torch.Tensor:
        return dequantize_kivi(x, self.dtype) if isinstance(x, KIVIQuantized) else x

    def _plain_keys(self, slots: H2OSlots, keep: bool = False) -> torch.Tensor:
        """The keys of rectangular `slots` in the model's dtype (RoPE redone at their positions with `key_codec`).

        Quantized keys are decoded once per step: the held keys the attention of a forward reads (`materialize`,
        `keep`) are kept, and the eviction after it gets them with only the new tokens decoded (`_decoded_keys`,
        dropped once the step has evicted)."""
        if not isinstance(slots.keys, KIVIQuantized):
            return slots.keys
        memo = self._decoded_keys
        if memo is not None and memo.codes is slots.keys and memo.positions is slots.positions:
            if memo.tail is not None:
                memo.keys = torch.cat([memo.keys, self._decode_keys(*memo.tail)], 2)
                memo.tail = None
            return memo.keys
        keys = self._decode_keys(slots.keys, slots.positions)
        if keep:
            self._decoded_keys = DecodedKeys(slots.keys, slots.positions, keys)
        return keys

    def _decode_keys(self, codes: KIVIQuantized, positions: torch.Tensor) -> torch.Tensor:
        if self.key_codec is None:
            return dequantize_kivi(codes, self.dtype)
        return self.key_codec.dequantize(codes, positions, self.dtype)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._plain_keys(self.slots, keep=True), self._plain(self.slots.values)

    def plain_storage(self) -> bool:
        return not self.quantized and self.counts is None

    def stored_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slots.keys, self.slots.values

    def held_keys(self) -> torch.Tensor:
        """`[batch, kv_heads, slots, head_dim]` the held keys in the model's dtype (dequantized when quantized)."""
        return self._plain_keys(self.slots)

    def held_tensors(self) -> list[torch.Tensor]:
        ring = [] if self.ring is None else self.ring.tensors()
        slots = [] if self.slots is None else self.slots.tensors()
        stats = [] if self.key_codec is None else self.key_codec.tensors()
        decoded = [] if self._decoded_keys is None else [self._decoded_keys.keys]  # only between update and evict
        return slots + ring + stats + decoded + ([] if self.counts is None else [self.counts])

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.slots is None else self.slots.named()

    def batch_size(self) -> int:
        if self.counts is not None:
            return self.counts.shape[0]
        return 0 if self.slots is None else self.slots.positions.shape[0]

    def _map_store(self, fn: RowFn) -> None:
        if self.slots is not None:
            self.slots = self.slots.map_rows(fn)

    # ---- read accessors: rectangular `[batch, kv_heads, slots, ...]` also while the storage is compact ----------
    def _rect(self) -> H2OSlots:
        if self.slots is None:
            raise ValueError("this H2O layer holds no tokens yet: read it after a forward")
        return self.slots if self.counts is None else self.slots.expand(self.counts)

    def held_positions(self) -> torch.Tensor:
        """`[batch, kv_heads, slots]` int64: the position of each held slot (-1: a slot a head does not hold)."""
        return self._rect().positions.long()

    def held_valid(self) -> torch.Tensor:
        """`[batch, kv_heads, slots]` bool: False for padding and for slots a head does not hold."""
        return self._rect().valid

    def held_scores(self) -> torch.Tensor | None:
        """`[batch, kv_heads, slots]` float32: the attention mass each slot received (None unless h2o / hybrid)."""
        return self._rect().scores

    def held_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[batch, kv_heads, slots, head_dim]` and values `[.., value_dim]` held, in the model's dtype
        (dequantized when quantized; zeros in the slots a head does not hold)."""
        r = self._rect()
        return self._plain_keys(r), self._plain(r.values)

    # ---- what the attention function reports --------------------------------------------------------------------
    def observe_queries(self, queries: torch.Tensor, scaling: float) -> None:
        """The last `query_window` queries of this forward `[batch, heads, w, head_dim]` (post-RoPE): kept in a ring
        of the last `query_window` queries, with their positions and padding flags; 16-bit for window policies (what
        they read; 8-bit with `quant_bits` when the ring holds more than one query), the model's dtype for the mass
        policies (`crop` recomputes the mass they gave as the attention computed it)."""
        if not self._pending or not self.query_window:
            return
        w = queries.shape[2]
        if w > self._pending:
            raise ValueError(f"{w} queries reported for {self._pending} new tokens")
        dtype = self.dtype
        if self.window and self.quantized and self.query_window > 1:
            dtype = torch.int8  # one query per head (tova) costs too few bytes to round: 8-bit rings moved its ranks
        elif self.window:
            dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float16
        end = self.cumulative_length
        new = QueryRing.of_forward(queries, end - self._pending, end, scaling, dtype)
        keep = self.query_window
        self.ring = new.last(keep) if self.ring is None else self.ring.extend(new, keep)
        self._new_queries = w

    def observe_visible_keys(self, visible: torch.Tensor | None) -> None:
        if visible is None or not self._pending:
            return
        n = self._pending
        valid = self.slots.valid
        if visible.shape != (valid.shape[0], valid.shape[2]):
            raise ValueError(f"visible keys {tuple(visible.shape)} do not match the held slots {tuple(valid.shape)}")
        valid[:, :, -n:] &= visible[:, None, -n:].to(valid.device)
        if self._new_queries and self.ring is not None:  # a padding position is no query either
            self.ring.mark_invisible(visible, self._new_queries)

    def observe_attention(self, mass: torch.Tensor) -> None:
        if not self._pending:
            return  # e.g. the attention of a layer called twice per forward: count the first call only
        valid = self.slots.valid
        if mass.shape != valid.shape:
            raise ValueError(f"attention mass {tuple(mass.shape)} does not match the held slots {tuple(valid.shape)}")
        if self.policy.uses_mass:
            scores = self.slots.scores
            if self.policy.decay is not None and self.policy.decay < 1:
                # the held tokens' mass fades per new query; the new mass is added as it came
                scores.mul_(self.policy.decay ** self._pending)
            scores += mass.to(scores.device, torch.float32)
        self._pending = 0
        self._new_queries = 0
        self.evict()
        self._decoded_keys = None
        if self.ring is not None and len(self.ring) > self.query_window:  # evicted: crop can no longer undo
            self.ring = self.ring.last(self.query_window) if self.query_window else None

    # ---- eviction -----------------------------------------------------------------------------------------------
    def slot_view(self) -> tuple[SlotView, torch.Tensor | None]:
        """What the policy sees of the held slots, and with `merge` the logits `[batch, kv_heads, group, ring,
        slots]` of every query of the ring over them (what a fold weighs by; the policy's window is their last rows,
        so they are computed once for both)."""
        s = self.slots
        uses_window = self.window > 0
        if uses_window and self.ring is None:
            raise RuntimeError(
                f"policy {self.options.policy!r} ranks tokens by the attention of the last queries, which the "
                "'hf_kvcache' attention reports (layer.observe_queries) before the attention mass; call "
                "observe_queries(query[:, :, -layer.query_window:], scaling) first when driving the layer by hand"
            )
        keys = self.held_keys() if (self.policy.uses_keys or uses_window) else None
        view = SlotView(s.scores, s.positions, s.valid, seen=self.cumulative_length, keys=keys, rope=self.rope,
                        key_bias=s.log_weight)
        if self.policy.uses_values:
            view.values = self._plain(s.values)
        ring_logits = None
        if self.options.merge:  # merge policies all read a window of queries
            r = self.ring
            ring_logits = window_logits(r.queries, r.positions, r.valid, keys, s.positions, s.valid, r.scaling,
                                        key_bias=s.log_weight)
        if uses_window:
            r = self.ring.last(self.window)
            if self.policy.uses_queries:  # the policy reads the queries themselves
                view.queries, view.query_positions, view.query_valid = r.queries, r.positions, r.valid
                view.scaling = r.scaling
            else:
                if ring_logits is not None:
                    logits = ring_logits[:, :, :, -len(r):]
                else:
                    logits = window_logits(r.queries, r.positions, r.valid, keys, s.positions, s.valid, r.scaling,
                                           key_bias=s.log_weight)
                view.window = window_attention(logits, view.values if self.policy.output_error else None)
        return view, ring_logits

    def evict(self, budget: int | None = None, protect_last: int = 0) -> None:
        """Keep the policy's `budget` slots of every (row, KV head) (default: the options' budget for the tokens
        seen, once the layer holds `evict_every` tokens over it), the `protect_last` newest real tokens among them
        whatever their score."""
        if self.slots is None:
            return
        slack = 0
        if budget is None:
            budget = self.options.budget_for(self.cumulative_length, self.budget_scale)
            slack = (self.options.evict_every or 1) - 1
        if self.options.head_budgets:
            view, ring_logits = self.slot_view()
            keep = self.policy.select_across_heads(view, budget, protect_last=protect_last)
            if keep is not None and self.options.merge:
                self._fold(view, ring_logits, keep)
            self._compact(keep if keep is not None else self.slots.positions >= 0)
            return
        if budget + slack >= self.tokens_held():
            return
        view, ring_logits = self.slot_view()
        keep = self.policy.select(view, budget, protect_last=protect_last, shared=self.options.shared_heads)
        if keep is not None:
            if self.options.merge:
                mask = torch.zeros_like(self.slots.valid).scatter_(-1, keep, True)
                self._fold(view, ring_logits, mask)
            self.slots = self.slots.select(keep)

    def _fold(self, view: SlotView, logits: torch.Tensor, keep: torch.Tensor) -> None:
        """`merge`: fold the real tokens about to be evicted (not in `keep [batch, kv_heads, slots]`) into kept slots
        (`caches.merge.fold_evicted`), weighted by the attention of the queries the ring holds (their `logits`, from
        `slot_view`)."""
        s, r = self.slots, self.ring
        b, h, g, w, slots = logits.shape
        similarity = self.options.merge_similarity
        held = view.values if view.values is not None else self._plain(s.values)
        values, log_weight = fold_evicted(
            logits.view(b, h, g * w, slots), r.positions.repeat(g), s.positions, view.keys, keep, s.valid & ~keep,
            held, s.log_weight, DEFAULT_MERGE_SIMILARITY if similarity is None else similarity,
        )
        if self.quantized:  # quantize again only the slots a fold changed; the others keep their codes
            changed = (values != held).any(-1)
            new = self._quantize(values)
            values = dataclasses.replace(s.values, **{
                name: torch.where(changed[..., None], getattr(new, name), getattr(s.values, name))
                for name in ("codes", "scale", "zero")
            })
        self.slots = dataclasses.replace(s, values=values, log_weight=log_weight)  # new tensors: a copy may share `s`

    def key_bias(self) -> torch.Tensor | None:
        """`[batch, kv_heads, slots]` float32 for the keys the last `update` returned: the log of the tokens each slot
        stands for (`merge="mass"`), which the `"hf_kvcache"` attention adds to its logits; None otherwise."""
        if self.options.merge != "mass" or self.slots is None or self.counts is not None:
            return None
        return self.slots.log_weight

    # ---- compact storage of ragged heads (head_budgets) -----------------------------------------------------------
    def _compact(self, keep: torch.Tensor) -> None:
        """Keep the slots `keep [batch, kv_heads, slots]` (bool), flat (`H2OSlots.compact`), with
        `self.counts [batch, kv_heads]`."""
        self.counts = keep.sum(-1)
        self.slots = self.slots.compact(keep)

    def _expand(self) -> None:
        """Compact -> rectangular (`H2OSlots.expand`)."""
        if self.counts is not None:
            counts, self.counts = self.counts, None
            self.slots = self.slots.expand(counts)

    def key_mask(self) -> torch.Tensor | None:
        """`[batch, kv_heads, slots]` bool for the keys the last `update` returned: False for the slots a head does not
        hold (and padding); the `"hf_kvcache"` attention masks them per head. None unless heads hold different
        counts (`head_budgets`)."""
        return self.slots.valid if self.options.head_budgets and self.counts is None and self.slots is not None else None

    def tokens_held(self) -> int:
        if self.counts is not None:
            return int(self.counts.max()) if self.counts.numel() else 0
        return 0 if self.slots is None else self.slots.positions.shape[2]

    def fp16_bytes(self) -> int:
        if self.counts is None:
            return super().fp16_bytes()
        return FP16_BYTES * self.counts.shape[0] * self.num_heads * self.cumulative_length * (self.head_dim + self.value_dim)

    # ---- positions, masks, batch contract -----------------------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.tokens_held()
        return held + query_length, self.cumulative_length - held

    def evicted(self) -> int:
        """Tokens evicted by the head that evicted most (0 while a forward is under way)."""
        return self._dropped() if self._pending == 0 else 0

    def _dropped(self) -> int:
        """Tokens evicted so far by the head that evicted most (the new tokens of a forward count as held)."""
        if self.counts is not None:
            held = int(self.counts.min()) if self.counts.numel() else 0
        elif self.options.head_budgets and self.slots is not None:
            held = int((self.slots.positions >= 0).sum(-1).min())
        else:
            held = self.tokens_held()
        return self.cumulative_length - held

    def _map_queries(self, fn) -> None:
        if self.ring is not None:
            self.ring = self.ring.map_rows(fn)

    def _batch_op(self, op, fn) -> None:
        compact = self.counts is not None
        self._expand()
        op()
        if compact:
            self._compact(self.slots.positions >= 0)
        self._map_queries(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._batch_op(lambda: super(H2OLayer, self).reorder_cache(beam_idx),
                       lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch_op(lambda: super(H2OLayer, self).batch_select_indices(indices), lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_op(lambda: super(H2OLayer, self).batch_repeat_interleave(repeats),
                       lambda t: t.repeat_interleave(repeats, dim=0))

    def _crop_newest(self, n: int) -> None:
        """Drop the newest `n` tokens and what their queries did: the mass they gave (taken out of the scores,
        `_undo_mass`) and their queries in the ring, so the layer is the one that never saw them."""
        if self._dropped() > 0:
            raise ValueError(
                f"H2OCache cannot crop {n} token(s): this layer already evicted "
                f"{self._dropped()} of the {self.cumulative_length} tokens it saw, so the cache before those tokens "
                "cannot be restored. Assisted / speculative decoding needs a cache that does not evict (or a budget "
                "that covers the whole sequence)."
            )
        keep = self.cumulative_length - n
        compact = self.counts is not None
        self._expand()
        if self.tracks_crop():
            self._undo_mass(keep)
        super()._crop_newest(n)
        if compact:
            self._compact(self.slots.positions >= 0)
        if self.ring is not None:  # queries of cropped positions go too
            self.ring = self.ring.before(keep)

    def _undo_mass(self, keep: int) -> None:
        """Take out of the scores `[batch, kv_heads, slots]` what the queries of positions `keep ..` gave, recomputed
        from the ring over the held keys (nothing was evicted: every key they saw is held), so the scores become
        those of the layer that saw `keep` tokens. With `decay`, the forward `start .. end` cut by the crop counted
        its kept queries' mass `M` after fading the older mass by `end - start`: the scores are S d^(seen - keep) +
        ... + M d^(seen - end) with the cropped mass; they become S + ... + M, so M is recomputed too."""
        seen, ring, n = self.cumulative_length, self.ring, self.cumulative_length - keep
        d = self.policy.decay if self.policy.decay is not None and self.policy.decay < 1 else None
        start, part_end = keep, keep
        if d is not None and ring is not None and keep > 0:
            part = ring.forward_of(keep - 1)
            if part is not None and part[1] > keep:
                start, part_end = part
        problem = None
        if self.quantized:
            problem = (
                f"H2OCache cannot crop {n} token(s) with quant_bits={self.options.quant_bits} and policy="
                f"{self.options.policy!r}: its scores hold the attention mass the cropped queries gave, which can be "
                "recomputed only from the keys those queries saw, now stored quantized. Use quant_bits=None, a "
                "policy that keeps no mass (tova, snapkv, expected, knorm, recent, sinks, strided) or budget=1.0 "
                "(nothing evicted: the scores never matter)"
            )
        elif ring is None or not ring.covers(start, seen):
            problem = (
                f"H2OCache cannot crop {n} token(s): its scores hold the attention mass of the queries of positions "
                f"{start} .. {seen - 1}, and this layer keeps the queries of only the last crop_window="
                f"{self.crop_window} positions (reported by the 'hf_kvcache' attention, observe_queries) to take it "
                f"out; build the cache with crop_window >= {seen - start}"
            )
        if problem is not None:  # a copy cropped to be encoded (the prefix store) goes on; this layer may not
            self.stale_after_crop = problem
            return
        s = self.slots
        att = ring.attention(self.held_keys(), s.positions, s.valid, start, seen)  # [b, h, seen - start, slots]
        scores = s.scores
        if d is None:
            self.slots = dataclasses.replace(s, scores=scores - att.sum(2))  # new tensors: a copy may share `s`
            return
        pos = range(start, seen)
        ends = torch.tensor([ring.forward_of(p)[1] for p in pos], dtype=torch.float32, device=att.device)
        cropped = torch.arange(start, seen, device=att.device) >= keep
        gone = (att * torch.where(cropped, d ** (seen - ends), 0.0)[:, None]).sum(2)
        kept = att[:, :, ~cropped].sum(2)
        self.slots = dataclasses.replace(s, scores=(scores - gone - d ** (seen - part_end) * kept) / d**n + kept)

    def reset(self) -> None:
        super().reset()
        self._pending = 0
        self.slots = None
        self.counts = None
        self.stale_after_crop = None
        if self.key_codec is not None:
            self.key_codec.shift = self.key_codec.scale = None
        self._clear_queries()


class H2OCache(CompressedCache):
    """Evicting KV cache: `H2OCache(config=model.config, budget=0.2, policy="h2o")`. See the module docstring."""

    options_class = H2OOptions
    layer_class = H2OLayer

    def __init__(self, config: Any = None, **options: Any) -> None:
        super().__init__(config, **options)
        policy = self.options.make_policy()
        if policy.needs_rope():
            self._attach_rope(config, policy.future)
        if self.options.prerope_keys:
            what = "quant_bits with key_quant='prerope' (the default)"
            ropes = self._layer_ropes(config, what, "key_quant='token'", "undoes RoPE on the keys",
                                      kinds=(H2OLayer, QuantizedWindowLayer))
            for layer, rope in ropes:
                layer.key_codec = PreRopeKeys(rope, self.options.quant_bits, self.options.quant_group_size)
        if self.options.pyramid:
            if config is None:
                raise ValueError("pyramid (per-layer budgets) needs the model config: H2OCache(config=model.config, ...)")
            # the first evicting layer holds the most slots: the shared attention mask is built for it, and every
            # later layer reads the mask's last columns (`mask_from_end`)
            layers = [layer for layer in self.layers if isinstance(layer, H2OLayer)]
            for layer, scale in zip(layers, self.options.layer_scales(len(layers))):
                layer.budget_scale = scale
    needs_attention_mass = True  # generate(cache_implementation=...) switches the model to the hf_kvcache attention

    def _attach_rope(self, config: Any, future: int) -> None:
        """Give every evicting layer the model's RoPE (`KeyRotation`), for a policy that moves queries `future`
        positions ahead with it."""
        what = f"policy={self.options.policy!r} with future={future}"
        for layer, rope in self._layer_ropes(config, what, "future=0", "moves the recent queries by the model's RoPE",
                                             kinds=(H2OLayer,)):
            layer.rope = rope

    def _make_layer(self, layer_type: str, kwargs: dict, layer_idx: int):
        """With `quant_bits`, sliding-window layers hold their window quantized (`QuantizedWindowLayer`)."""
        if layer_type == "sliding_attention" and self.options.quant_bits is not None:
            return QuantizedWindowLayer(self.options, kwargs["sliding_window"])
        return super()._make_layer(layer_type, kwargs, layer_idx)

    def evict_to(self, tokens: int, protect_last: int = 0) -> None:
        """Evict now, between two forwards, every layer down to `tokens` slots per (row, KV head) (`pyramid`: that
        many x the layer's scale), scored by the policy as at the end of a forward (window policies with the last
        queries seen), keeping the `protect_last` newest tokens whatever their score.

        For a compression at a chosen point -- e.g. once a question has been prefilled after its context (question-
        aware passkey, `hf_kvcache.eval.suites.passkey`): build the cache with `budget=1.0` (it then never evicts by
        itself), prefill, call `evict_to(context_budget + question_tokens, protect_last=question_tokens)`, decode.
        A cache whose own budget is smaller evicts again at the end of the next forward."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"evict_to keeps `tokens` slots per KV head: an int >= 1, got {tokens!r}")
        if isinstance(protect_last, bool) or not isinstance(protect_last, int) or not 0 <= protect_last <= tokens:
            raise ValueError(
                f"protect_last must be an int in [0, tokens={tokens}] (the newest tokens kept), got {protect_last!r}"
            )
        for layer in self.layers:
            if not isinstance(layer, H2OLayer) or layer.slots is None:
                continue
            if layer._pending:
                raise RuntimeError(MISSING_MASS.format(cls=type(layer).__name__, policy=layer.options.policy))
            budget = max(protect_last, 1, round(tokens * layer.budget_scale))
            layer._expand()
            layer.evict(budget, protect_last)  # head_budgets: compact again
            if layer.ring is not None and len(layer.ring) > layer.query_window:  # evicted: crop can no longer undo
                layer.ring = layer.ring.last(layer.query_window) if layer.query_window else None

    def tokens_held(self, layer_idx: int = 0) -> int:
        """Slots held per (row, KV head) by layer `layer_idx`."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer.tokens_held() if isinstance(layer, CompressedLayer) else 0
