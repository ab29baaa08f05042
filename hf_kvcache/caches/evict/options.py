"""`EvictOptions`: an evicting cache's budget, policy and quantization -- and the flat `cache_config` keys mapped
onto them.

    EvictOptions(budget=0.2, policy=SnapKVPolicy(window=16), quant=TokenQuant(bits=4))
    EvictOptions.from_dict({"budget": 0.2, "policy": "snapkv", "window": 16, "quant_bits": 4})   # the same

`budget`: tokens kept per KV head -- an int >= 2 (that many) or a float in (0, 1] (that fraction of the tokens seen,
rounded up; 1.0 keeps everything); `min_budget`: with a ratio budget, never fewer than this many tokens (a ratio of
the few tokens seen at the start of a stream is tiny); `evict_every` n (default 1): evict only once a layer holds n
tokens over its budget, then back down to it, so a decode step ranks and drops tokens once every n steps (kvpress's
`compression_interval`; the layer holds up to n - 1 tokens over the budget in between, counted in `memory_stats()`).
`policy`: an `EvictionPolicy` (its own options are its fields; wrappers add Ada-KV head budgets, pyramid budgets,
shared heads, merging: `hf_kvcache.policy`), a registered name, or a `to_dict()` of one. `quant`: None keeps the
kept tokens in the model's dtype, a `TokenQuant` (or its dict) stores them quantized per token.

Flat keys (`from_dict`, what `cache_implementation="h2o"` / `cache_config` and `H2OOptions(**keys)` take): a key a
registered policy declares goes to the policy named by `policy` (an option it does not declare raises, naming the
policies that take it); `quant_bits` / `quant_group_size` / `key_quant` make the `TokenQuant`; `head_budgets=True`,
`shared_heads=True`, `pyramid=p` and `merge="value" | "mass"` (with `merge_similarity`) wrap the policy in `AdaKV`,
`SharedHeads`, `Pyramid` and `Merge`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ...options import CacheOptions, check_bool, check_choice, check_positive_int
from ...policy import POLICIES, EvictionPolicy, policy_from_dict, policy_from_options
from ...policy.wrappers import DEFAULT_MERGE_SIMILARITY, AdaKV, Merge, Pyramid, SharedHeads
from ...quant.token import KEY_QUANT, TokenQuant

QUANT_KEYS = ("quant_bits", "quant_group_size", "key_quant")
WRAPPER_KEYS = ("merge", "merge_similarity", "shared_heads", "head_budgets", "pyramid")


@dataclass
class EvictOptions(CacheOptions):
    """See the module docstring."""

    budget: int | float = 0.2
    policy: EvictionPolicy | str | dict = "h2o"
    quant: TokenQuant | dict | None = None
    min_budget: int | None = None
    evict_every: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.policy, (str, dict)):
            self.policy = policy_from_dict(self.policy)
        if isinstance(self.quant, dict):
            self.quant = TokenQuant(**self.quant)
        super().__post_init__()

    def validate(self) -> None:
        if not isinstance(self.policy, EvictionPolicy):
            raise ValueError(f"policy must be an EvictionPolicy, one of {list(POLICIES)} or a policy dict, got "
                             f"{self.policy!r}")
        if self.quant is not None and not isinstance(self.quant, TokenQuant):
            raise ValueError(f"quant must be None or a TokenQuant (e.g. TokenQuant(bits=4)), got {self.quant!r}")
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ValueError(f"budget must be an int (tokens) or a float in (0, 1] (ratio), got {b!r}")
        if isinstance(b, int) and b == 1:
            raise ValueError("budget=1 keeps a single token; for all tokens use budget=1.0 (a ratio), else an int >= 2")
        if isinstance(b, int) and b < 2:
            raise ValueError(f"budget must be at least 2 tokens (an int) or a ratio in (0, 1] (a float), got {b}")
        if isinstance(b, float) and not 0.0 < b <= 1.0:
            raise ValueError(f"a float budget is a ratio of the tokens seen, in (0, 1]; got {b}")
        if self.min_budget is not None:
            check_positive_int("min_budget", self.min_budget)
            if not isinstance(b, float):
                raise ValueError("min_budget applies to a ratio budget (a float); an int budget is fixed already")
        if self.evict_every is not None:
            check_positive_int("evict_every", self.evict_every)
            if self.policy.ragged_heads and self.evict_every > 1:
                raise ValueError("evict_every applies to uniform budgets; head_budgets (AdaKV) re-shares the layer's "
                                 "budget across its heads at every step: set one of them")

    @property
    def prerope_keys(self) -> bool:
        """Whether keys are stored quantized in the pre-RoPE frame (`quant` with `key_quant="prerope"`)."""
        return self.quant is not None and self.quant.prerope_keys

    def budget_for(self, seen: int, scale: float = 1.0) -> int:
        """Tokens kept per KV head once `seen` tokens went through, in a layer whose budget is `scale` x the budget
        (per-layer budgets, `Pyramid`)."""
        if isinstance(self.budget, float):
            return max(1, self.min_budget or 0, math.ceil(self.budget * scale * seen - 1e-9))
        return max(1, round(self.budget * scale))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable: the policy as `EvictionPolicy.to_dict()`, the quantization as a dict."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["policy"] = self.policy.to_dict()
        out["quant"] = None if self.quant is None else dataclasses.asdict(self.quant)
        return out

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> "EvictOptions":
        """From the fields, or from the flat keys (see the module docstring), or a mix of both."""
        fields = set(cls.field_names())
        knobs = {name for policy in POLICIES.values() for name in policy.option_names()}
        unknown = sorted(set(options) - fields - knobs - set(QUANT_KEYS) - set(WRAPPER_KEYS))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for {cls.__name__}; valid options: {cls.field_names()}, the flat keys "
                f"{list(QUANT_KEYS + WRAPPER_KEYS)} and the options of the policies ({sorted(knobs)})"
            )
        direct = {k: v for k, v in options.items() if k in fields}
        flat = {k: v for k, v in options.items() if k not in fields}
        if flat:
            direct["policy"] = _policy_from_flat(direct.get("policy", cls.policy), flat)
            quant = _quant_from_flat(flat)
            if quant is not None:
                if direct.get("quant") is not None:
                    raise ValueError("give the quantization once: quant=TokenQuant(...) or quant_bits=...")
                direct["quant"] = quant
        return cls(**direct)


def _quant_from_flat(flat: dict[str, Any]) -> TokenQuant | None:
    """`TokenQuant` from `quant_bits` / `quant_group_size` / `key_quant` (None without `quant_bits`)."""
    bits, group, key_quant = (flat.get(k) for k in QUANT_KEYS)
    if bits is None:
        if key_quant is not None:
            check_choice("key_quant", key_quant, KEY_QUANT)
        for name in ("quant_group_size", "key_quant"):
            if flat.get(name) is not None:
                raise ValueError(f"{name} applies when quant_bits is set (8, 4 or 2)")
        return None
    return TokenQuant(bits, group, key_quant or "prerope")


def _policy_from_flat(policy: EvictionPolicy | str | dict, flat: dict[str, Any]) -> EvictionPolicy:
    """The policy named `policy` with the flat keys it declares, wrapped as the flat wrapper keys say."""
    knobs = {k: v for k, v in flat.items() if k not in QUANT_KEYS and k not in WRAPPER_KEYS}
    if knobs:
        if not isinstance(policy, str):
            raise ValueError(f"give {sorted(knobs)} to the policy itself ({policy!r}), or name it: policy='tova'")
        policy = policy_from_options(policy, knobs)
    elif not isinstance(policy, EvictionPolicy):
        policy = policy_from_dict(policy)
    merge, similarity = flat.get("merge"), flat.get("merge_similarity")
    if merge is not None:
        policy = Merge(policy, merge, DEFAULT_MERGE_SIMILARITY if similarity is None else similarity)
    elif similarity is not None:
        raise ValueError("merge_similarity applies when merge is set ('value' or 'mass')")
    for name, wrapper in (("shared_heads", SharedHeads), ("head_budgets", AdaKV)):
        on = flat.get(name, False)
        check_bool(name, on)
        if on:
            policy = wrapper(policy)
    if flat.get("pyramid") is not None:
        policy = Pyramid(policy, flat["pyramid"])
    return policy


def H2OOptions(**options: Any) -> EvictOptions:  # noqa: N802 -- the options class's former name, kept for its keys
    """`EvictOptions` from flat `cache_config` keys (`EvictOptions.from_dict`), e.g.
    `H2OOptions(budget=0.2, policy="snapkv", window=16, quant_bits=4)`."""
    return EvictOptions.from_dict(options)
