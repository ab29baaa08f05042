"""One prefill of a context for every cache that needs nothing of it but the keys, values and last queries: the full
cache's forward is recorded (the keys and values each layer's `update` received, and the last queries each attention
call was given), and a cache whose state after a one-forward prefill depends on nothing else is filled by replaying
those instead of running the model again.

Why it holds: in a single prefill forward over an empty cache, every layer of ours returns the keys and values it is
given (`CompressedLayer.update` with nothing held), so the model computes the same keys, values and queries for every
layer as with the full cache; what a cache stores then depends only on them and on what its layers ask the
attention: a tiered layer calibrating asks for its last queries (`query_window`), which the recording kept; an
eviction or CPAC layer asks for the attention mass, which it did not. A replay hands each layer what it asks right
after its update, as the attention would, and gives up (returns False) at the first layer that asks for what was
not recorded: the caller then prefills through the model as usual, with a fresh cache.
`tests/eval/test_replay.py` checks the stored tensors of replayed caches against their own prefill, bit for bit.

    prefill = PrefillReplay(context_ids)
    with prefill.recording(full_cache):            # a transformers DynamicCache, on an "sdpa" model
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
class LayerQueries:
    """The last queries one attention call of the recorded forward was given, `[batch, heads, <= QUERIES_KEPT,
    head_dim]` (post-RoPE, copied with the strides of the original), and the call's scaling."""

    queries: torch.Tensor
    scaling: float


QUERIES_KEPT = 256  # the most queries a replayed layer may ask of the prefill (a tiered layer calibrates with 64)


@dataclass
class PrefillReplay:
    """The updates of one recorded prefill of `prompt_ids` (empty until `recording` has run), and the logits of its
    last position `[vocab]` where the caller keeps them (the first answer token of a prompt that ends with its
    question)."""

    prompt_ids: list[int]
    updates: list[LayerUpdate] = field(default_factory=list)
    queries: list[LayerQueries] = field(default_factory=list)  # one per update, when the model runs "sdpa"
    logits: torch.Tensor | None = None
    replays: int = 0  # caches filled by `replay` so far

    @contextmanager
    def recording(self, cache: Any) -> Iterator[None]:
        """Record every `update` of `cache` (a transformers `DynamicCache`, whose prefill is the model's own) inside
        the block, which must be one forward of `prompt_ids` over the empty cache, and the last `QUERIES_KEPT`
        queries of every call to the registered "sdpa" attention (none on a model that runs another attention)."""
        from transformers import AttentionInterface, DynamicCache

        from hf_kvcache.attention.plain import SDPA  # the entry a user's sdpa model calls (and we wrap)

        if type(cache) is not DynamicCache:
            raise ValueError(f"record the prefill of the full cache (a DynamicCache), not of {type(cache).__name__}: "
                             "a cache of ours may change what later layers are given")
        if cache.get_seq_length() != 0:
            raise ValueError("record a prefill over an empty cache")
        self.updates.clear()
        self.queries.clear()
        original = cache.update
        sdpa = AttentionInterface._global_mapping.get(SDPA)

        def update(keys, values, layer_idx, *args, **kwargs):
            self.updates.append(LayerUpdate(keys, values, layer_idx, args, kwargs))
            return original(keys, values, layer_idx, *args, **kwargs)

        def attention(module, query, key, value, attention_mask, **kwargs):
            last = query[:, :, -QUERIES_KEPT:].detach()
            scaling = kwargs.get("scaling")
            self.queries.append(LayerQueries(torch.empty_like(last).copy_(last),
                                             query.shape[-1] ** -0.5 if scaling is None else scaling))
            return sdpa(module, query, key, value, attention_mask, **kwargs)

        cache.update = update
        if sdpa is not None:
            AttentionInterface._global_mapping[SDPA] = attention
        try:
            yield
        finally:
            del cache.update  # the class's own method again
            if sdpa is not None:
                AttentionInterface._global_mapping[SDPA] = sdpa
        tokens = {u.keys.shape[2] for u in self.updates}
        if tokens != {len(self.prompt_ids)}:
            self.updates.clear()  # not one forward of the whole context: nothing to replay
            raise ValueError(f"recording expects one forward of the {len(self.prompt_ids)} prompt tokens; the "
                             f"updates held {sorted(tokens)} tokens")
        if len(self.queries) != len(self.updates):
            self.queries.clear()  # another attention ran (eager, flash): layers that ask for queries run their own

    def save(self, path: str) -> None:
        """Write the recording (prompt ids, updates, kept queries, last logits) to `path` with `torch.save`, each
        tensor compact (a view is not saved with the tensor it views).

        Raises:
            ValueError: when nothing was recorded."""
        if not self.updates:
            raise ValueError("nothing recorded to save: record the full cache's prefill first")

        def compact(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.detach().clone()
            if isinstance(x, dict):
                return {k: compact(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [compact(v) for v in x]
            return x

        torch.save({"prompt_ids": list(self.prompt_ids), "logits": compact(self.logits),
                    "updates": [{"keys": compact(u.keys), "values": compact(u.values), "layer_idx": u.layer_idx,
                                 "args": compact(list(u.args)), "kwargs": compact(u.kwargs)} for u in self.updates],
                    "queries": [{"queries": compact(q.queries), "scaling": q.scaling} for q in self.queries]}, path)

    @classmethod
    def load(cls, path: str, prompt_ids: list[int]) -> "PrefillReplay":
        """The recording `save` wrote to `path`, which must be of `prompt_ids`.

        Raises:
            ValueError: when the file holds the prefill of another prompt."""
        data = torch.load(path, weights_only=True)
        if data["prompt_ids"] != list(prompt_ids):
            raise ValueError(f"{path} holds the prefill of another prompt ({len(data['prompt_ids'])} tokens); delete "
                             "it, or keep the prefills of other prompts in another folder")
        return cls(list(prompt_ids),
                   [LayerUpdate(u["keys"], u["values"], u["layer_idx"], tuple(u["args"]), u["kwargs"])
                    for u in data["updates"]],
                   [LayerQueries(q["queries"], q["scaling"]) for q in data["queries"]], data["logits"])

    def replay(self, cache: Any) -> bool:
        """Fill the empty `cache` with the recorded updates; a layer that asks for its last queries after its update
        (`query_window > 0`: a tiered layer calibrating) is handed the recorded ones (`observe_queries`), as the
        attention hands them. Returns False (leaving `cache` partly filled: build a fresh one) when nothing was
        recorded, or when a layer would have asked the attention of the prefill for something the recording cannot
        give: the attention mass (`wants_attention_mass`), or more queries than were kept."""
        if not self.updates or getattr(cache, "needs_attention_mass", False):
            return False
        if cache.get_seq_length() != 0:
            raise ValueError("replay fills an empty cache: build a fresh one")
        with torch.inference_mode():
            for i, u in enumerate(self.updates):
                cache.update(u.keys, u.values, u.layer_idx, *u.args, **u.kwargs)
                layer = cache.layers[u.layer_idx]
                if getattr(layer, "wants_attention_mass", False):
                    return False
                window = int(getattr(layer, "query_window", 0) or 0)
                if window:
                    kept = self.queries[i] if self.queries else None
                    short = window > kept.queries.shape[2] and kept.queries.shape[2] < u.keys.shape[2] if kept else True
                    if short:  # no queries recorded (not an sdpa model), or fewer than the layer asks
                        return False
                    layer.observe_queries(kept.queries[:, :, -window:], kept.scaling)
        self.replays += 1
        return True
