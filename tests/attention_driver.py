"""One forward's worth of cache traffic without a model: what the `"hf_kvcache"` attention does to every layer of a
cache, driven by hand (shared by the tests of the evicting and CPAC caches)."""

from __future__ import annotations

from typing import Callable

import torch

Mass = Callable[[int], torch.Tensor]  # number of keys -> attention mass `[batch, kv_heads, keys]`


def drive(
    cache,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None = None,
    mass: Mass | None = None,
    visible: torch.Tensor | None = None,
    scaling: float = 1.0,
    layers: int | None = None,
    report: bool = True,
) -> None:
    """Update every layer with `keys` / `values [batch, kv_heads, n, dim]`, then report to it, as the attention
    would: the last `layer.query_window` of `queries [batch, heads, n, dim]` (when given and the layer asks for
    queries), which keys are `visible [batch, keys]` (None: no mask) and the attention `mass(keys)` each key received
    (zeros when `mass` is None).

    Args:
        layers: how many layers to drive (default: the layers the cache holds; a cache built without a config
            has none until the first update, so give it).
        report: False updates the layers only (a cache whose layers never hear from the attention).
    """
    count = len(cache.layers) if layers is None else layers
    if count == 0:
        raise ValueError("the cache holds no layers yet (built without a config): pass layers=")
    for i in range(count):
        held, _ = cache.update(keys, values, i)
        if not report:
            continue
        layer = cache.layers[i]
        if queries is not None and layer.query_window:
            layer.observe_queries(queries[:, :, -layer.query_window:], scaling)
        layer.observe_visible_keys(visible)
        n = held.shape[2]
        layer.observe_attention(torch.zeros(*keys.shape[:2], n) if mass is None else mass(n))
