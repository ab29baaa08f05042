"""One prefill of a context for every cache that only stores what it is given: the full cache's forward is recorded
(the keys and values each layer's `update` received), and a cache whose state after a one-forward prefill depends on
nothing else is filled by replaying those updates instead of running the model again.

Why it holds: in a single prefill forward over an empty cache, every layer of ours returns the keys and values it is
given (`CompressedLayer.update` with nothing held), so the model computes the same keys and values for every layer
as with the full cache; what a cache stores then depends only on them, unless a layer asks the attention for
something (queries while a tiered layer calibrates, the attention mass of an eviction or CPAC layer). A replay checks
exactly that after each layer's update and gives up (returns False) at the first layer that asks: the caller then
prefills through the model as usual, with a fresh cache. `tests/eval/test_replay.py` checks the stored tensors of
replayed caches against their own prefill, bit for bit.

    prefill = PrefillReplay(prompt_ids)
    with prefill.recording(full_cache):            # a transformers DynamicCache
        model(context, past_key_values=full_cache)
    if not prefill.replay(cache):                  # any other cache, freshly built
        cache = build_again(); model(context, past_key_values=cache)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LayerUpdate:
    """The arguments of one `Cache.update` call: keys / values `[batch, kv_heads, tokens, head_dim]`, the layer, and
    the rest as given (transformers passes `cache_kwargs`)."""

    keys: torch.Tensor
    values: torch.Tensor
    layer_idx: int
    args: tuple
    kwargs: dict


@dataclass
class PrefillReplay:
    """The updates of one recorded prefill of `prompt_ids` (empty until `recording` has run), and the logits of its
    last position `[vocab]` where the caller keeps them (the first answer token of a prompt that ends with its
    question)."""

    prompt_ids: list[int]
    updates: list[LayerUpdate] = field(default_factory=list)
    logits: torch.Tensor | None = None
    replays: int = 0  # caches filled by `replay` so far

    @contextmanager
    def recording(self, cache: Any) -> Iterator[None]:
        """Record every `update` of `cache` (a transformers `DynamicCache`, whose prefill is the model's own) inside
        the block, which must be one forward of `prompt_ids` over the empty cache."""
        from transformers import DynamicCache

        if type(cache) is not DynamicCache:
            raise ValueError(f"record the prefill of the full cache (a DynamicCache), not of {type(cache).__name__}: "
                             "a cache of ours may change what later layers are given")
        if cache.get_seq_length() != 0:
            raise ValueError("record a prefill over an empty cache")
        self.updates.clear()
        original = cache.update

        def update(keys, values, layer_idx, *args, **kwargs):
            self.updates.append(LayerUpdate(keys, values, layer_idx, args, kwargs))
            return original(keys, values, layer_idx, *args, **kwargs)

        cache.update = update
        try:
            yield
        finally:
            del cache.update  # the class's own method again
        tokens = {u.keys.shape[2] for u in self.updates}
        if tokens != {len(self.prompt_ids)}:
            self.updates.clear()  # not one forward of the whole context: nothing to replay
            raise ValueError(f"recording expects one forward of the {len(self.prompt_ids)} prompt tokens; the "
                             f"updates held {sorted(tokens)} tokens")

    def replay(self, cache: Any) -> bool:
        """Fill the empty `cache` with the recorded updates. Returns False (leaving `cache` partly filled: build a
        fresh one) when nothing was recorded, or when a layer would have asked the attention of the prefill for
        something that changes what it stores (`query_window > 0` or `wants_attention_mass`)."""
        if not self.updates or getattr(cache, "needs_attention_mass", False):
            return False
        if cache.get_seq_length() != 0:
            raise ValueError("replay fills an empty cache: build a fresh one")
        with torch.inference_mode():
            for u in self.updates:
                cache.update(u.keys, u.values, u.layer_idx, *u.args, **u.kwargs)
                layer = cache.layers[u.layer_idx]
                if getattr(layer, "query_window", 0) or getattr(layer, "wants_attention_mass", False):
                    return False
        self.replays += 1
        return True
