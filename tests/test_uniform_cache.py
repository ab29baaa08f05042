import json

import pytest
import torch
from transformers import LlamaConfig

from hf_kvcache import UniformQuantCache
from hf_kvcache.caches.uniform import UniformQuantOptions
from random_kv import stream_random

B, H, D, LAYERS = 2, 3, 64, 2


def tiny_config(**kw):
    return LlamaConfig(
        num_hidden_layers=LAYERS, num_attention_heads=6, num_key_value_heads=H, head_dim=D, hidden_size=6 * D,
        vocab_size=128, **kw,
    )


def fill(cache, chunks=(17, 1, 22)):
    return stream_random(cache, chunks, B, H, D, LAYERS)


# bounds about 1.3x the measured relative error of keys / values: int8 0.0061 / 0.0058, int4 0.0974 / 0.0956,
# fp8_e4m3 0.0250 / 0.0251, fp8_e5m2 0.0497 / 0.0500
@pytest.mark.parametrize("dtype,max_err", [("int8", 0.008), ("int4", 0.125), ("fp8_e4m3", 0.033), ("fp8_e5m2", 0.065)])
def test_roundtrip_and_positions(dtype, max_err):
    cache = UniformQuantCache(config=tiny_config(), dtype=dtype)
    k, v = fill(cache)
    assert cache.get_seq_length() == 40
    k_out, v_out = cache.layers[0].materialize()
    assert k_out.shape == k.shape and v_out.dtype == torch.float32
    assert ((k_out - k).norm() / k.norm()) < max_err and ((v_out - v).norm() / v.norm()) < max_err
    assert cache.get_mask_sizes(1, 0) == (41, 0)


def test_update_returns_new_tokens_unquantized():
    cache = UniformQuantCache(config=tiny_config(), dtype="int4")
    fill(cache)
    k_new, v_new = torch.randn(B, H, 2, D), torch.randn(B, H, 2, D)
    keys, values = cache.update(k_new, v_new, 0)
    assert keys.shape[2] == 42 and torch.equal(keys[:, :, -2:], k_new) and torch.equal(values[:, :, -2:], v_new)


@pytest.mark.parametrize("dtype,min_ratio,max_bytes_per_elem", [("int8", 1.9, 1.1), ("int4", 3.3, 0.6), ("fp8", 1.9, 1.1)])
def test_storage_really_shrinks(dtype, min_ratio, max_bytes_per_elem):
    cache = UniformQuantCache(config=tiny_config(), dtype=dtype)
    fill(cache)
    stats = cache.memory_stats()
    elements = 2 * LAYERS * B * H * 40 * D
    held = sum(t.nbytes for layer in cache.layers for t in layer.store.values())
    assert stats["bytes"] == held
    assert stats["fp16_bytes"] == 2 * elements
    assert stats["ratio"] >= min_ratio
    assert held / elements <= max_bytes_per_elem


def test_crop_too_far_raises():
    cache = UniformQuantCache(config=tiny_config(), dtype="int8")
    fill(cache)
    with pytest.raises(ValueError, match="cannot crop 50 tokens"):
        cache.crop(-50)


def test_without_config_layers_are_created_lazily():
    cache = UniformQuantCache(dtype="int4")
    fill(cache)
    assert len(cache.layers) == LAYERS and cache.get_seq_length() == 40


def test_sliding_layers_stay_transformers_layers():
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    cache = UniformQuantCache(config=config, dtype="int8")
    fill(cache)
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    assert cache.memory_stats()["bytes"] > 0


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(dtype="int3"), "dtype='int3' is not valid; choose one of"),
        (dict(dtype="int8", groups=2), r"unknown option\(s\) \['groups'\].*valid options"),
        (dict(dtype="int4", group_size=0), "group_size must be a positive integer"),
        (dict(dtype="fp8", symmetric=False), "fp8 formats are symmetric"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        UniformQuantCache(config=tiny_config(), **options)


def test_group_size_must_divide_head_dim():
    cache = UniformQuantCache(config=tiny_config(), dtype="int4", group_size=48)
    with pytest.raises(ValueError, match="must divide head_dim=64"):
        fill(cache)


def test_bad_states():
    cache = UniformQuantCache(config=tiny_config(), dtype="int8")
    with pytest.raises(ValueError, match="floating-point"):
        cache.update(torch.ones(B, H, 2, D, dtype=torch.int64), torch.ones(B, H, 2, D), 0)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        cache.update(torch.randn(H, 2, D), torch.randn(H, 2, D), 0)
    cache.update(torch.randn(B, H, 2, D), torch.randn(B, H, 2, D), 0)
    with pytest.raises(ValueError, match="head_dim changed from 64 to 32"):
        cache.update(torch.randn(B, H, 2, 32), torch.randn(B, H, 2, 32), 0)


def test_options_json_roundtrip():
    opts = UniformQuantOptions(dtype="int4", group_size=16, symmetric=False)
    again = UniformQuantOptions.from_json(opts.to_json())
    assert again == opts and json.loads(opts.to_json())["group_size"] == 16
    assert UniformQuantOptions(dtype="fp8").dtype == "fp8_e4m3"
