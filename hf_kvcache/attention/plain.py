"""Caches of ours in a user's own loop: transformers' `"sdpa"` attention, wrapped so that a layer of ours that asks
the attention for something is served by the `"hf_kvcache"` attention, as under `generate` and `attached`.

    import hf_kvcache
    cache = hf_kvcache.TieredQuantCache(config=model.config)
    model(ids, past_key_values=cache)  # an sdpa model in a plain loop: the tiered layers still see their queries

What a layer asks (its `AttentionRequest`, `attention.request`): its queries while it calibrates (`query_window`),
the attention mass an eviction policy ranks by (`wants_attention_mass`), a per-head mask of empty slots (`key_mask()`),
a key bias, or compressed segments to attend in place (`view`). Such a call goes to `hf_kvcache_attention`, which
computes what SDPA computes and also reports back. Every other call (keys no cache of ours returned, a layer that asks
nothing, such as a tiered layer once calibrated or a uniform INT4 layer) goes to transformers' own function untouched.

Covered: models whose `config._attn_implementation` is `"sdpa"` (the default on CPU and for most models). Not
covered: `"eager"` (transformers calls each model's own function, not the registry), flash and flex attention. Under
those a calibrating tiered layer sees no queries and stores its codes uncalibrated, and an eviction cache raises
at its next update that the mass never arrived.

`import hf_kvcache` calls `serve_plain_loops()`; `serve_plain_loops(False)` hands the `"sdpa"` entry back as it was.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from transformers import AttentionInterface

from .function import hf_kvcache_attention
from .request import AttentionRequest, pending_requests, request_for

SDPA = "sdpa"


def asks_attention(request: AttentionRequest) -> bool:
    """Whether the layer behind `request` needs more than the attention output (see the module docstring)."""
    layer = request.layer
    return (request.view is not None or layer.wants_attention_mass or layer.wants_visible_keys
            or int(layer.query_window or 0) > 0
            or layer.key_mask() is not None or layer.key_bias() is not None)


def _serving(sdpa: Callable) -> Callable:
    """`sdpa` wrapped: calls whose keys carry a request that asks something go to `hf_kvcache_attention`."""

    def sdpa_serving_hf_kvcache(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any):
        # no request of ours pending (no cache of this library in play), or a compiled graph (our caches are not
        # compiled): transformers' own function, without even looking the key tensor up
        request = None if torch.compiler.is_compiling() or not pending_requests() else request_for(key)
        if request is not None and kwargs.get("softcap") is None and asks_attention(request):
            return hf_kvcache_attention(module, query, key, value, attention_mask, **kwargs)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    sdpa_serving_hf_kvcache.wrapped = sdpa
    return sdpa_serving_hf_kvcache


def _current() -> Callable | None:
    return AttentionInterface._global_mapping.get(SDPA)


def serving() -> bool:
    """Whether the registered `"sdpa"` attention serves our layers (see `serve_plain_loops`)."""
    return hasattr(_current(), "wrapped")


def serve_plain_loops(enabled: bool = True) -> None:
    """Wrap (True) or unwrap (False) transformers' registered `"sdpa"` attention; idempotent.

    Args:
        enabled: True serves calibrating, evicting and masking layers of ours in plain loops of sdpa models; False
            restores transformers' function, so that such a loop reports nothing to the cache (as before
            `import hf_kvcache`).
    """
    current = _current()
    if current is None or serving() == enabled:
        return
    AttentionInterface.register(SDPA, _serving(current) if enabled else current.wrapped)


@contextlib.contextmanager
def unserved() -> Iterator[None]:
    """Plain loops without the service while the block runs (how an eager model's loop, or any loop before this
    service existed, reports to the cache: nothing); the previous setting is restored on exit."""
    was = serving()
    serve_plain_loops(False)
    try:
        yield
    finally:
        serve_plain_loops(was)
