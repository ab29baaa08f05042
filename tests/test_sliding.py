"""Sliding-window layers compressed too: a tiered/KIVI cache on a model that mixes sliding and full attention keeps
its sliding layers quantized and drops what the window no longer sees (tiny random Gemma-3, no download)."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import hf_kvcache  # noqa: F401
from hf_kvcache import KIVICache, TieredQuantCache
from hf_kvcache.caches.tiered import TieredQuantLayer

WINDOW = 24
EIGHT_BIT = dict(tail_length=8, warm_length=8, group_size=8, archive_group_size=8, warm_bits=8, archive_bits=8,
                 sink_length=0, rotation="none")


@pytest.fixture(scope="module")
def tiny_gemma():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=WINDOW, max_position_embeddings=512,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )
    return Gemma3ForCausalLM(cfg).eval()


def stream(model, cache, ids, chunk):
    with torch.no_grad():
        return torch.cat([model(ids[:, i : i + chunk], past_key_values=cache).logits
                          for i in range(0, ids.shape[1], chunk)], 1)


@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
def test_sliding_layers_quantized_and_bounded(tiny_gemma, attn):
    model = tiny_gemma
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    cache = TieredQuantCache(config=model.config, **EIGHT_BIT)
    model.set_attn_implementation(attn)
    try:
        cache.bind(model)
        got = stream(model, cache, ids, 4)
    finally:
        model.set_attn_implementation("sdpa")
    sliding = cache.layers[0]
    assert isinstance(sliding, TieredQuantLayer) and sliding.is_sliding and not cache.layers[3].is_sliding
    # a sliding layer holds the window plus at most the groups in flight, never what the window left behind
    assert WINDOW <= sliding.tokens_held() <= WINDOW + 3 * 8
    assert sliding.dropped + sliding.tokens_held() == 200 and cache.layers[3].tokens_held() == 200
    assert sliding.get_mask_sizes(1) == (sliding.tokens_held() + 1, sliding.dropped)
    # 8-bit tiers: the logits stay those of the full-precision model (measured max difference 2.6e-3 of 0.66)
    torch.testing.assert_close(got, ref, atol=4e-3, rtol=0)


def test_sliding_bytes_compared_with_what_an_fp16_window_holds(tiny_gemma):
    model = tiny_gemma
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    cache = KIVICache(config=model.config, residual_length=8, group_size=8, bits=2)
    stream(model, cache, ids, 8)
    sliding = cache.layers[0]
    assert sliding.fp16_bytes() == 2 * 1 * (WINDOW - 1) * (32 + 32)
    assert sliding.nbytes() < sliding.fp16_bytes()
    stats = cache.memory_stats()
    assert stats["ratio"] > 1.5  # every layer quantized (with transformers' fp32 sliding layers it was below 1)
