"""A cache built without a config creates its layers at their first update: what `bind` and `set_padding` gave
before that must reach those layers (it used to be dropped silently)."""

from __future__ import annotations

import torch

from hf_kvcache.caches.base import FusedBinding
from hf_kvcache.registry import build_cache


class _Model:
    class config:
        _attn_implementation = "hf_kvcache"


def test_binding_and_padding_reach_layers_created_later():
    cache = build_cache("int4")
    assert cache.bind(_Model()) is True and cache.layers == []
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    cache.set_padding(mask)
    k = torch.randn(2, 2, 4, 64)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    for layer in cache.layers:
        assert isinstance(layer.fused_binding, FusedBinding) and layer.fused_binding.active()
        assert layer.padding.tolist() == [2, 0]
    cache.unbind()
    cache.update(k, k, 2)
    assert all(layer.fused_binding is None for layer in cache.layers)
