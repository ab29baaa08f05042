"""Question-aware eviction scored with the model's own draft of its answer (`evict_with_lookahead`).

    cache = H2OCache(config=model.config, budget=1.0, policy="snapkv", window=len(question_ids), pool=15,
                     pool_mode="max")
    with hf_kvcache.attached(model, cache):
        logits = model(context_and_question, past_key_values=cache).logits[:, -1]
        evict_with_lookahead(model, cache, logits, keep + len(question_ids), protect_last=len(question_ids),
                             lookahead=8)
        ...  # decode the answer over the evicted cache, starting from `logits`

A window policy (SnapKV, TOVA) scores the held tokens by the attention of the last queries it saw: once a question
has been prefilled after its context, the question's. What the model reads while it answers can differ from what the
question's tokens look at (a chain of assignments that leads from the asked value to the names, the values of a key
listed one after another). `evict_with_lookahead` lets the model draft the first `lookahead` tokens of its answer
greedily over a copy of the full cache, and scores with the queries of the question *and* of that draft; the copy
and the draft are then dropped, so the answer itself is decoded over the evicted cache only. Extra cost: `lookahead`
decode steps over the full cache and a copy of the cache while they run (peak memory about twice the cache's).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from ...options import check_int
from ...transformers_compat import cache_kwargs
from .layer import H2OLayer

if TYPE_CHECKING:
    from .cache import H2OCache


def _window_layers(cache: H2OCache) -> list[H2OLayer]:
    """The cache's evicting layers that hold tokens, checked for a lookahead eviction (see `evict_with_lookahead`)."""
    layers = [layer for layer in cache.layers if isinstance(layer, H2OLayer) and layer.slots is not None]
    if not layers:
        raise ValueError("evict_with_lookahead needs an H2OCache that holds tokens: prefill the context and the "
                         "question through it first")
    for layer in layers:
        if not layer.window:
            raise ValueError(
                f"evict_with_lookahead scores with the queries of the question and the draft, which policy "
                f"{layer.policy.core.name!r} does not read: use a window policy (snapkv, tova)")
        if layer._dropped():
            raise ValueError("evict_with_lookahead scores a cache that evicted nothing yet: build it with "
                             "budget=1.0 (it then never evicts by itself)")
    return layers


@torch.inference_mode()
def evict_with_lookahead(model, cache: H2OCache, logits: torch.Tensor, tokens: int, protect_last: int,
                         lookahead: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Evict `cache` to `tokens` slots per (row, KV head) as `H2OCache.evict_to(tokens, protect_last)` does, each
    layer's policy reading the queries of its window (SnapKV with `window` = the question's tokens: the question's)
    and those of `lookahead` tokens the model drafts greedily over a copy of the full cache (module docstring).

    Args:
        model: the model that filled `cache`, under the `"hf_kvcache"` attention (`hf_kvcache.attached`).
        cache: an `H2OCache` with a window policy (snapkv, tova) that evicted nothing yet (`budget=1.0`).
        logits: `[batch, vocab]` the logits of the last prefilled position (they give the draft's first token).
        tokens: slots kept per (row, KV head), as in `evict_to`.
        protect_last: the newest tokens kept whatever their score (the question).
        lookahead: draft tokens (>= 1) whose queries score beside the question's.
        attention_mask: `[batch, held]` the prefill's mask of a padded batch (None: no padding); the draft extends
            it by one real token a step.

    Returns:
        `[batch, lookahead]` the drafted token ids (the cache keeps neither them nor their keys).
    """
    check_int("lookahead", lookahead, lo=1, hint=" (the draft tokens)")
    if logits.dim() != 2:
        raise ValueError(f"logits are the last position's [batch, vocab]; got shape {tuple(logits.shape)}")
    layers = _window_layers(cache)
    draft_cache = copy.deepcopy(cache)
    draft_layers = [draft_cache.layers[cache.layers.index(layer)] for layer in layers]  # the same layers, copied
    for layer in draft_layers:  # the draft's ring keeps the question's queries and every draft token's
        layer.window = layer.window + lookahead
    drafted, nxt, mask = [], logits.argmax(-1, keepdim=True), attention_mask
    for _ in range(lookahead):
        drafted.append(nxt)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        out = model(input_ids=nxt, attention_mask=mask, use_cache=True, **cache_kwargs(draft_cache))
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for layer, draft in zip(layers, draft_layers):
        layer.ring = draft.ring  # the question's queries and the draft's
        layer.window += lookahead  # read every query of the ring; the policy itself still protects its window
    try:
        cache.evict_to(tokens, protect_last)
    finally:
        for layer in layers:
            layer.window -= lookahead
            ring = layer.ring.before(layer.cumulative_length)  # the draft's queries go with the draft
            layer.ring = ring.last(layer.query_window) if len(ring) and layer.query_window else None
    return torch.cat(drafted, 1)
