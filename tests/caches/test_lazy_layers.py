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


def test_options_replaced_before_the_first_update_reach_the_layers_made_then():
    """`replace_options` on a config-less cache: the layers made at the first update take the new options (each
    cache class makes its own kind of layer, CPAC's with its shared budget), and a deep copy makes its layers for
    itself."""
    import copy
    import dataclasses

    cache = build_cache("tiered")
    cache.replace_options(dataclasses.replace(cache.options, tail_length=32, archive_bits=3))
    twin = copy.deepcopy(cache)
    k = torch.randn(1, 2, 8, 64)
    cache.update(k, k, 0)
    assert cache.layers[0].plan.tail_length == 32 and cache.layers[0].plan.archive_bits == 3
    assert twin.layers == []
    twin.update(k, k, 0)
    assert twin.layers[0].options is twin.options
    cpac = build_cache("cpac")
    cpac.update(k, k, 0)
    assert type(cpac.layers[0]).__name__ == "CPACLayer"


def test_replace_options_refuses_what_the_layers_cannot_take():
    """Options of another class, invalid options, and caches whose layers keep the options they were built with
    get a ValueError that says what to do."""
    import dataclasses

    import pytest

    tiered = build_cache("tiered")
    with pytest.raises(ValueError, match="takes TieredQuantOptions"):
        tiered.replace_options(build_cache("int4").options)
    with pytest.raises(ValueError):
        tiered.replace_options(dataclasses.replace(tiered.options, tail_length=-1))
    h2o = build_cache("h2o")
    k = torch.randn(1, 2, 8, 64)
    h2o.update(k, k, 0)
    with pytest.raises(ValueError, match="build a new H2OCache"):
        h2o.replace_options(dataclasses.replace(h2o.options))
