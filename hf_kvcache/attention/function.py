"""The `"hf_kvcache"` attention function (`hf_kvcache_attention`), how a call is prepared from what transformers
passes and what the cache layer's `AttentionRequest` asks, its registration with transformers, and the switch of a
model to it for caches that need the attention mass. The package docstring (`hf_kvcache.attention`) says how a call
is served."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kernels import KERNELS, AttentionCall
from .masks import mask_as_bool, visible_keys, with_key_bias, with_key_mask
from .request import request_for

NAME = "hf_kvcache"

logger = logging.getLogger(__name__)


def prepare(module, query, key, value, attention_mask, dropout, scaling, is_causal) -> AttentionCall:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"hf_kvcache attention takes [batch, heads, tokens, head_dim] tensors, got query {tuple(query.shape)}, "
            f"key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot be grouped over {kv_heads} KV heads")
    request = request_for(key)
    layer = None if request is None else request.layer
    want_mass = layer is not None and layer.wants_attention_mass
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4D [batch, 1|heads, q, kv], got shape {tuple(attention_mask.shape)}")
    if attention_mask is not None:
        if layer is not None and layer.mask_from_end and attention_mask.shape[-1] > kv_len:
            # a layer that holds fewer slots than the layer the mask was built for (per-layer budgets): its held
            # slots are the newest of that layer's, so the mask's last columns are its own
            attention_mask = attention_mask[..., -kv_len:]
        else:
            attention_mask = attention_mask[..., :kv_len]  # static caches may hand over a longer mask
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    key_mask = None if layer is None else layer.key_mask()
    if key_mask is not None:
        attention_mask = with_key_mask(attention_mask, key_mask, heads, q_len, bool(is_causal))
    key_bias = None if layer is None else layer.key_bias()
    if key_bias is not None:
        attention_mask = with_key_bias(attention_mask, key_bias, heads, q_len, kv_len, bool(is_causal))
    causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if causal and kv_len > q_len:
        # as transformers' SDPA integration: a skipped causal mask with more keys than queries only happens on the
        # prefill of a static cache, whose extra keys are empty slots
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    return AttentionCall(
        query, key, value, attention_mask, causal, query.shape[-1] ** -0.5 if scaling is None else scaling,
        dropout, request, want_mass, kv_len,
    )


def hf_kvcache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Drop-in for transformers' `sdpa_attention_forward`; returns `(attn_output [batch, q_len, heads, dim], None)`.

    Reports attention mass to the hf-kvcache layer that returned `key` when that layer asks for it."""
    if kwargs.get("softcap") is not None:
        raise ValueError("the hf_kvcache attention does not support `softcap`; use eager or flex attention")
    special = kwargs.get("position_bias") is not None or kwargs.get("cache") is not None or kwargs.get("s_aux") is not None
    if special:
        request = request_for(key, take=True)
        if request is not None and (request.layer.wants_attention_mass or request.layer.wants_visible_keys):
            raise NotImplementedError(
                "the hf_kvcache attention cannot report attention mass or visible keys (an evicting cache) together "
                "with position_bias / paged caches / attention sinks (s_aux)"
            )
        if request is not None and request.view is not None:  # placeholders: attend to the decoded tensors instead
            key, value = request.view.dense()
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    call = prepare(module, query, key, value, attention_mask, dropout, scaling, is_causal)
    for kernel in KERNELS:
        if kernel.supports(call):
            out, mass = kernel(call)
            break
    else:  # pragma: no cover - the blockwise kernel supports everything
        raise RuntimeError("no hf_kvcache attention kernel supports this call")
    window = 0 if call.layer is None else int(call.layer.query_window or 0)
    if window > 0:  # the last queries: policies that score by a recent window, layers calibrating their recipe
        call.layer.observe_queries(query[:, :, -window:].detach(), call.scaling)  # statistics: never a graph
    if call.want_mass or (call.layer is not None and call.layer.wants_visible_keys):
        if call.want_mass and mass is None:
            raise RuntimeError(f"kernel {kernel.name!r} was asked for the attention mass and returned none")
        call.layer.observe_visible_keys(visible_keys(call.mask, query.shape[0]))
        call.layer.observe_attention(None if mass is None else mass.detach())
    return out, None


def unsupported(config) -> str | None:
    """Why this attention cannot run a model of `config` at all (None when it can): attention logit soft-capping."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping (attn_logit_softcapping)"
    return None


def register() -> None:
    """Register `"hf_kvcache"` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(NAME, hf_kvcache_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_for_cache(model, cache) -> bool:
    """Switch `model` to `attn_implementation="hf_kvcache"` when `cache` declares `needs_attention_mass`.

    The switch stays (it is not undone after generation): for every other cache this attention computes exactly what
    SDPA computes, so later calls are unaffected. Returns True when it switched."""
    if not cache.needs_attention_mass:
        return False
    current = getattr(model.config, "_attn_implementation", None)
    if current == NAME:
        return False
    model.set_attn_implementation(NAME)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        raise ValueError(
            f"{type(cache).__name__} needs the attention mass that only attn_implementation='{NAME}' reports, and "
            f"{type(model).__name__} could not be switched to it; load the model with attn_implementation='{NAME}'"
        )
    logger.warning(
        "%s ranks tokens by the attention they receive: switched the model's attn_implementation from %r to %r "
        "(same outputs as sdpa for every other cache)", type(cache).__name__, current, NAME,
    )
    return True
