"""Scoring a prefilled context by its reconstruction: the driver of the `reconstruct` policy (`policy.reconstruct`).

    cache = H2OCache(config=model.config, budget=0.25, policy="reconstruct")
    with held_for_scoring(model, cache, context_ids, reconstruction_prompt_ids(tokenizer)):
        model(context_ids, past_key_values=cache)        # the prefill evicts nothing...
    # ... then the context is scored and every layer evicted to its budget: ask, decode (the budget is kept)

    # compress a document once, ask many questions
    cache = H2OCache(config=model.config, budget=1.0, policy="reconstruct")
    model(doc_ids, past_key_values=cache)
    score_context(model, cache, doc_ids, reconstruction_prompt_ids(tokenizer))
    cache.evict_to(512)                                   # then each question over a copy.deepcopy(cache)

`score_context` runs, for each `chunk` of the context, one forward of the reconstruction prompt followed by that
span of the context over the held cache (batch rows left-padded alike: the attention mask marks the padding of the
context and of each span). During that forward every scored layer reports all its queries (`query_window`,
`observe_queries`) and computes what they give the held context (`policy.reconstruct.reconstruction_scores`) instead
of its usual bookkeeping (no attention mass is asked, nothing is evicted); after it, every layer of the cache is put
back as it was (the repeat tokens leave no trace: the layers' attributes are restored, their tensors are never
written in place). The largest (or summed) attention over all forwards becomes the slots' scores. Extra cost: one
more pass of the context through the model, `chunk` + prompt tokens at a time, with attention over the whole
context; extra memory: the activations of one such forward plus `[batch, kv_heads, group, 64, keys]` float32 of
attention probabilities at a time (keys: every held one, or with scope "span" the sinks, the span and the repeat
tokens only). The prefill before it runs on torch SDPA: the policy asks the attention for no mass.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from ...policy.base import INF
from ...policy.reconstruct import reconstruction_scores
from ...transformers_compat import cache_kwargs
from .layer import H2OLayer

if TYPE_CHECKING:
    from .cache import H2OCache

RECONSTRUCTION_PROMPT = "\n\nRepeat the text above, word for word:\n\n"
LEAD_TOKENS = 8  # scope "span": the repeat of a later span starts with this many context tokens before it


def reconstruction_prompt_ids(tokenizer: Any, prompt: str = RECONSTRUCTION_PROMPT) -> list[int]:
    """The token ids of the reconstruction prompt (no special tokens)."""
    return tokenizer(prompt, add_special_tokens=False).input_ids


@dataclass
class ContextScoring:
    """One layer's state during one reconstruction forward: `queries` (W, the forward's tokens), `query_valid
    [batch, W]` (False: padding of the repeated span), `reduce`, and `best [batch, kv_heads, scored]`, the reduction
    over every forward so far (None before the first). `span` (scope "span"): the positions `[start, end)` of the
    context tokens this forward repeats, which with the first `sinks` real tokens are the only held tokens its
    softmax runs over; None: over every held token."""

    queries: int
    query_valid: torch.Tensor
    reduce: str
    best: torch.Tensor | None = None
    span: tuple[int, int] | None = None
    sinks: int = 0

    def observe(self, layer: H2OLayer, queries: torch.Tensor, scaling: float) -> None:
        """The forward's queries `[batch, heads, W, head_dim]` reported by the attention of `layer` (whose slots hold
        the scored context followed by the W repeat tokens): fold what they give the context into `best`."""
        s, w = layer.slots, self.queries
        scored = s.positions.shape[2] - w
        key_valid = s.valid.clone()
        if self.span is not None:
            held, pos = key_valid[:, :, :scored], s.positions[:, :, :scored]
            sink = held & (held.cumsum(-1) <= self.sinks)
            key_valid[:, :, :scored] = sink | (held & (pos >= self.span[0]) & (pos < self.span[1]))
        key_valid[:, :, scored:] = self.query_valid[:, None].to(key_valid.device)
        seen = layer.cumulative_length
        positions = torch.arange(seen - w, seen, device=queries.device)
        keys, key_positions, columns = layer.held_keys(), s.positions, None
        if self.span is not None:  # only the sinks, the span and the repeat tokens are in the softmax: the rest
            # of the held slots gets probability 0 whatever its logit, so its logits are not computed
            columns = key_valid.flatten(0, 1).any(0).nonzero().squeeze(-1)
            keys, key_positions, key_valid = keys[:, :, columns], key_positions[:, :, columns], key_valid[:, :, columns]
            columns = columns[columns < scored]
        part = reconstruction_scores(queries, positions, self.query_valid.to(queries.device), keys, key_positions,
                                     key_valid, scaling, scored if columns is None else len(columns), self.reduce)
        if columns is not None:
            part = part.new_zeros(*part.shape[:2], scored).index_copy_(2, columns.to(part.device), part)
        if self.best is None:
            self.best = part
        else:
            self.best = torch.maximum(self.best, part) if self.reduce == "max" else self.best + part


def scored_layers(cache: Any) -> list[H2OLayer]:
    """The layers of `cache` whose policy is scored by reconstruction (`scored_outside`); [] for any other cache."""
    return [layer for layer in getattr(cache, "layers", [])
            if isinstance(layer, H2OLayer) and layer.policy.scored_outside]


@torch.inference_mode()
def score_context(model: Any, cache: "H2OCache", context_ids: torch.Tensor | Sequence[int],
                  prompt_ids: Sequence[int], attention_mask: torch.Tensor | None = None) -> None:
    """Score the held context of `cache` by the attention the model gives it while repeating it (see the module
    docstring); evicts nothing (`cache.evict_to`, or the layer's own budget at its next forward, does).

    Args:
        model: the model that filled `cache`, on the `"hf_kvcache"` attention.
        cache: an `H2OCache` whose policy is scored by reconstruction (`policy="reconstruct"`), holding the context
            (tokens after it, e.g. a question, may follow: they are not repeated).
        context_ids: `[batch, n]` (or a list of n ids) the context as it was prefilled, left padding included.
        prompt_ids: the reconstruction instruction (`reconstruction_prompt_ids`).
        attention_mask: `[batch, n]` 1 for real tokens, 0 for the left padding (None: no padding).
    """
    layers = scored_layers(cache)
    if not layers:
        raise ValueError("score_context scores an H2OCache built with policy='reconstruct' (a policy that is "
                         "scored_outside); this cache has no such layer")
    ids = torch.as_tensor(context_ids, device=model.device)
    ids = ids[None] if ids.dim() == 1 else ids
    b, n = ids.shape
    seen = cache.get_seq_length()
    if n > seen:
        raise ValueError(f"the cache has seen {seen} tokens, fewer than the {n} context tokens given: prefill the "
                         "context first")
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(ids.device).long()
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must match context_ids {tuple(ids.shape)}")
    seen_mask = torch.cat([mask, mask.new_ones(b, seen - n)], 1)  # tokens after the context: no padding
    prompt = torch.as_tensor(list(prompt_ids), dtype=ids.dtype, device=ids.device)[None].expand(b, -1)
    policy = layers[0].policy.core
    local = policy.scope == "span"
    best: list[torch.Tensor | None] = [None] * len(layers)
    for start in range(0, n, policy.chunk):
        end = min(n, start + policy.chunk)
        lead = min(start, LEAD_TOKENS) if local else 0  # a later span's repeat starts with the tokens before it
        span_mask = torch.cat([mask.new_ones(prompt.shape), mask[:, start - lead : end]], 1)
        span = torch.cat([prompt, ids[:, start - lead : end]], 1)
        positions = (seen_mask.sum(1, keepdim=True) + span_mask.cumsum(1) - 1).clamp_min(0)
        saved = _snapshot(cache)
        for layer, prev in zip(layers, best):
            layer.scoring = ContextScoring(span.shape[1], span_mask.bool(), policy.reduce, prev,
                                           (start, end) if local else None, policy.sink_count)
        try:
            model(input_ids=span, attention_mask=torch.cat([seen_mask, span_mask], 1), position_ids=positions,
                  **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
            best = [layer.scoring.best for layer in layers]
        finally:
            _restore(saved)
    for layer, scores in zip(layers, best):
        compact = layer.counts is not None
        layer._expand()
        layer.slots = dataclasses.replace(layer.slots, scores=scores.to(layer.slots.valid.device))
        if compact:
            layer._compact(layer.slots.positions >= 0)


@contextmanager
def held_for_scoring(model: Any, cache: Any, context_ids: torch.Tensor | Sequence[int], prompt_ids: Sequence[int],
                     attention_mask: torch.Tensor | None = None) -> Iterator[None]:
    """Around the prefill of a context: the layers of a cache scored by reconstruction evict nothing inside the
    block; at its end the context is scored (`score_context`) and every such layer evicted to its own budget. Any
    other cache: nothing changes."""
    layers = scored_layers(cache)
    for layer in layers:
        layer.hold = True
    try:
        yield
    finally:
        for layer in layers:
            layer.hold = False
    if layers:
        score_context(model, cache, context_ids, prompt_ids, attention_mask)
        if layers[0].policy.core.joint_layers:
            share_across_layers(layers, layers[0].options.budget_for(layers[0].cumulative_length))
        for layer in layers:
            layer.evict()


def share_across_layers(layers: list[H2OLayer], tokens: int, protect_last: int = 0) -> None:
    """Per-layer budgets from one ranking of every layer's scores (`layer_budgets="joint"`): of all `(layer, head,
    slot)` of a row, the `tokens x kv_heads x len(layers)` best (by `policy.ranked`, sinks and the `protect_last`
    newest tokens first) are counted per layer, and each layer's `budget_scale` becomes its count over `tokens x
    kv_heads` (averaged over the rows; the mean over the layers stays 1). Evicts nothing: the layers' next eviction
    keeps `scale x` their budget (per head, or shared by the heads with `AdaKV`).

    Args:
        layers: the scored layers of one cache (`scored_layers`), each with the same KV heads.
        tokens: the budget per (row, KV head) the layers keep on average.
        protect_last: the newest real tokens every layer keeps whatever their score (`H2OCache.evict_to`).
    """
    ranked = []
    for layer in layers:
        compact = layer.counts is not None
        layer._expand()
        view, _ = layer.slot_view()
        ranked.append(layer.policy.ranked(view, tokens, protect_last, across_heads=True).flatten(1))
        if compact:
            layer._compact(layer.slots.positions >= 0)
    heads = layers[0].slots.valid.shape[1] if layers[0].counts is None else layers[0].counts.shape[1]
    flat = torch.cat(ranked, 1)  # [batch, sum of heads x slots]
    top = flat.topk(min(flat.shape[1], tokens * heads * len(layers)), dim=-1)
    ends = torch.tensor([r.shape[1] for r in ranked], device=flat.device).cumsum(0)
    owner = torch.bucketize(top.indices, ends, right=True)  # [batch, kept]: the layer of each kept slot
    counts = torch.zeros(flat.shape[0], len(layers), device=flat.device)
    counts.scatter_add_(1, owner, (top.values > -INF).float())  # slots that hold no real token are not kept
    for layer, share in zip(layers, (counts.mean(0) / (tokens * heads)).tolist()):
        layer.budget_scale = share


def _snapshot(cache: Any) -> list[tuple[Any, dict, dict | None]]:
    """Every layer's attributes (and its key codec's), to put back after a forward whose tokens must leave no trace."""
    out = []
    for layer in cache.layers:
        codec = getattr(layer, "key_codec", None)
        out.append((layer, dict(vars(layer)), None if codec is None else dict(vars(codec))))
    return out


def _restore(saved: list[tuple[Any, dict, dict | None]]) -> None:
    for layer, state, codec in saved:
        vars(layer).clear()
        vars(layer).update(state)
        if codec is not None:
            vars(layer.key_codec).clear()
            vars(layer.key_codec).update(codec)
