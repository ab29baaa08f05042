"""Sliding-window layers compressed too: a tiered/KIVI cache on a model that mixes sliding and full attention keeps
its sliding layers quantized and drops what the window no longer sees (tiny random Gemma-3, no download)."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import hf_kvcache  # noqa: F401
from hf_kvcache import KIVICache, TieredQuantCache
from hf_kvcache.caches.tiered import TieredQuantLayer

WINDOW = 24  # the window of the tiny_gemma fixture (conftest.py)
EIGHT_BIT = dict(tail_length=8, warm_length=8, group_size=8, archive_group_size=8, warm_bits=8, archive_bits=8,
                 sink_length=0, rotation="none", sliding=None)


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


# ---- what sliding layers run with (TieredQuantOptions.sliding) ---------------------------------------------------------
def test_sliding_options_default_validate_and_serialize():
    from hf_kvcache.caches.tiered import SLIDING_DEFAULT, KIVIOptions, TieredQuantOptions

    opts = TieredQuantOptions()
    assert opts.sliding == SLIDING_DEFAULT and opts.sliding is not SLIDING_DEFAULT  # a copy per instance
    plan = opts.for_sliding()
    assert (plan.tail_length, plan.warm_length, plan.warm_fraction, plan.warm_bits, plan.archive_bits) == (0, 64, 0.0, 3, 3)
    assert (plan.rotation, plan.clip_on, plan.sink_length, plan.sliding) == ("none", "values", 0, None)
    # keys left out take the full layers' value; None: sliding layers run the full layers' options (without sinks)
    assert TieredQuantOptions(sliding={"archive_bits": 4}).for_sliding().warm_length == 448
    # ... except the archive candidates, which a sliding layer takes only from `sliding`
    assert TieredQuantOptions(sliding=None).for_sliding() == TieredQuantOptions(sliding=None, sink_length=0,
                                                                                archive_candidates=None)
    assert TieredQuantOptions.from_json(opts.to_json()) == opts
    assert KIVIOptions().as_tiered().sliding is None  # KIVI runs one recipe on every layer
    with pytest.raises(ValueError, match="sliding must be a JSON object"):
        TieredQuantOptions(sliding=[0])
    with pytest.raises(ValueError, match=r"\['sink_length'\] cannot be set for sliding-window layers alone; use the keys"):
        TieredQuantOptions(sliding={"sink_length": 4})
    with pytest.raises(ValueError, match=r"sliding=\{'warm_length': 40\}: warm_length=40 must be a multiple of group_size"):
        TieredQuantOptions(sliding={"warm_length": 40})


@pytest.fixture(scope="module")
def gemma_window_128():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, sliding_window=128, max_position_embeddings=1024,
        layer_types=["sliding_attention", "full_attention"],
    )
    return Gemma3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("sliding, tiers, nbytes", [
    # default: 64 positions at 3 bits in groups of 32 (keys, values: 24 code + 8 scale/zero bytes each per position),
    # the rest of the window at 3 bits in groups of 64 (24 + 4 each); no tail at a multiple of 32 positions
    ("default", {"sink": 0, "archive": 64, "warm": 64, "tail": 0}, 64 * 64 + 64 * 56),
    # the full layers' options: a 64-position fp16 tail and a 4-bit warm tier of at least 448 positions, more than
    # the window: nothing reaches the archive, so nothing is dropped (80 bytes per position at 4 bits)
    (None, {"sink": 0, "archive": 0, "warm": 448, "tail": 64}, 64 * 256 + 448 * 80),
])
def test_sliding_layers_take_their_own_options(gemma_window_128, sliding, tiers, nbytes):
    model = gemma_window_128
    ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(3))
    kw = {} if sliding == "default" else {"sliding": sliding}
    cache = TieredQuantCache(config=model.config, **kw)
    stream(model, cache, ids, 32)
    layer, full = cache.layers
    assert layer.is_sliding and layer.tier_tokens() == tiers and layer.dropped + layer.tokens_held() == 512
    assert layer.nbytes() == nbytes and layer.fp16_bytes() == 127 * 2 * 64 * 2
    assert full.plan.tail_length == 64 and full.tier_tokens()["tail"] == 64  # full layers keep the options given
    if sliding == "default":
        assert layer.recipe.rotation == "none" and layer.specs["arch"].bits == layer.specs["warm"].bits == 3
        assert layer.fp16_bytes() / layer.nbytes() > 4.2  # 4.23x (the full layers' options: 0.62x)


@pytest.mark.parametrize("quantizer", ["subspace", "adaptive"])
def test_sliding_layers_keep_a_kivi_archive_by_default(quantizer):
    """A subspace basis fitted on the few positions a sliding layer's 64-token warm tier hands over misses most
    directions (Gemma-3-270M, 1024 tokens: subspace +33 %, adaptive +4057 %), so by default sliding layers archive
    with KIVI codes whatever `archive_quantizer` says; `sliding=None` still gives them the full layers' options."""
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=64,
                           layer_types=["sliding_attention", "full_attention"])
    cache = TieredQuantCache(config=cfg, archive_quantizer=quantizer, archive_rank=16)
    sliding, full = cache.layers
    assert sliding.plan.archive_quantizer == "kivi" and sliding.plan.archive_rank is None
    assert full.plan.archive_quantizer == quantizer and full.plan.archive_rank == 16
    same = TieredQuantCache(config=cfg, archive_quantizer=quantizer, sliding=None).layers[0]
    assert same.plan.archive_quantizer == quantizer


# ---- H2OCache with quant_bits: sliding layers hold their window quantized ------------------------------------------
def test_h2o_quant_bits_keeps_sliding_windows_quantized(tiny_gemma):
    """A sliding layer holds the newest WINDOW - 1 tokens as 8-bit codes (keys pre-RoPE), with transformers' mask
    sizes; with nothing evicted the logits stay the full model's (measured max difference 6.6e-3 of 0.65)."""
    from hf_kvcache import H2OCache
    from hf_kvcache.caches.coded import CodedLayer
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = tiny_gemma
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    cache = H2OCache(config=model.config, budget=1.0, policy="tova", quant_bits=8)
    model.set_attn_implementation("hf_kvcache")
    try:
        got = stream(model, cache, ids, 4)
    finally:
        model.set_attn_implementation("sdpa")
    sliding = cache.layers[0]
    assert isinstance(sliding, CodedLayer) and sliding.tokens_held() == WINDOW - 1
    assert sliding.get_mask_sizes(1) == (WINDOW, 200 - WINDOW + 1)
    assert sliding.key_codec.fitted  # a window under 32 tokens fits its key statistics too
    # codes (32 B) + fp16 scale and zero (4 B) per token and tensor, + float32 shift and scale of the keys
    assert sliding.nbytes() == 2 * (WINDOW - 1) * (32 + 4) + 2 * 32 * 4
    assert sliding.nbytes() < sliding.fp16_bytes() / 1.5  # 1.54x at this tiny window (the stats are 256 B)
    torch.testing.assert_close(got, ref, atol=8e-3, rtol=0)
    assert isinstance(H2OCache(config=model.config, budget=0.5).layers[0], DynamicSlidingWindowLayer)


def test_quantized_window_crops_until_it_drops_and_follows_beams(tiny_gemma):
    from hf_kvcache import H2OCache

    model = tiny_gemma
    model.set_attn_implementation("hf_kvcache")
    try:
        ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(3))
        cache = H2OCache(config=model.config, budget=1.0, policy="tova", quant_bits=4)
        with torch.no_grad():
            model(ids[:, :20], past_key_values=cache)
            cache.crop(-3)  # nothing dropped yet: crop works
            assert cache.layers[0].tokens_held() == 17 and cache.get_seq_length() == 17
            model(ids[:, 17:30], past_key_values=cache)  # 30 seen: the window dropped the oldest
            with pytest.raises(ValueError, match="has dropped the tokens before its window"):
                cache.layers[0].crop(-2)
            before, _ = cache.layers[0].materialize()
            cache.reorder_cache(torch.tensor([1, 0]))
            after, _ = cache.layers[0].materialize()
            torch.testing.assert_close(after, before.flip(0))
        out = model.generate(ids[:, :12], max_new_tokens=20, num_beams=2, do_sample=False, cache_implementation="h2o",
                             cache_config={"budget": 0.5, "policy": "snapkv", "quant_bits": 4})
        assert out.shape == (2, 32)
    finally:
        model.set_attn_implementation("sdpa")


# ---- caches whose own layers keep every token (paged, CPAC): sliding layers held per token ----------------------------
@pytest.mark.parametrize("name,auto", [("paged_quant", "int4"), ("cpac", "int8")])
def test_paged_and_cpac_quantize_their_sliding_layers(tiny_gemma, name, auto):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from hf_kvcache.caches.uniform import UniformQuantLayer
    from hf_kvcache.registry import build_cache

    model = tiny_gemma
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
    model.set_attn_implementation("hf_kvcache")
    try:
        caches = {d: build_cache(name, model.config, sliding_dtype=d) for d in ("auto", "int8", None)}
        logits = {d: stream(model, c, ids, 8) for d, c in caches.items()}
    finally:
        model.set_attn_implementation("sdpa")
    sliding, plain = caches["auto"].layers[0], caches[None].layers[0]
    assert isinstance(sliding, UniformQuantLayer) and sliding.options.dtype == auto and sliding.is_sliding
    assert sliding.key_codec is not None  # keys pre-RoPE, as the uniform cache holds them
    assert isinstance(plain, DynamicSlidingWindowLayer)
    full = caches["auto"].layers[3]
    assert type(full) is type(caches[None].layers[3]) and not full.is_sliding
    assert sliding.tokens_held() == WINDOW - 1  # what transformers' sliding layer keeps
    # the window's bytes: codes and scales instead of fp32 (the full layer is the same in both)
    held = {d: c.memory_stats()["bytes"] for d, c in caches.items()}
    assert held["auto"] <= held["int8"] < held[None]
    # head_dim 32: scales and the pre-RoPE statistics weigh more than on a real model (measured 2.72x and 1.62x)
    assert sliding.fp16_bytes() / sliding.nbytes() > {"int4": 2.5, "int8": 1.5}[auto]
    # int8 windows leave the logits where the full-precision sliding layers put them (max difference from the
    # model without a cache measured 0.009 and 0.007, vs 0.004 and 2e-5 with full-precision windows)
    err = {d: float((lg - ref).abs().max()) for d, lg in logits.items()}
    assert err["int8"] <= err[None] + 0.01, err
    with pytest.raises(ValueError, match="sliding_dtype"):
        build_cache(name, model.config, sliding_dtype="int3")


@pytest.mark.parametrize("name", ["paged_quant", "cpac"])
def test_paged_and_cpac_generate_with_quantized_windows_and_beams(tiny_gemma, name):
    """generate with beams (rows reordered every step) and several returned sequences, past the window: the quantized
    sliding layers follow the rows; left padding keeps each row's tokens."""
    from hf_kvcache.caches.uniform import UniformQuantLayer

    model = tiny_gemma
    ids = torch.randint(1, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # the second row left-padded
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=2, num_return_sequences=2,
                         do_sample=False, cache_implementation=name, cache_config={}, return_dict_in_generate=True)
    assert out.sequences.shape == (4, 52)
    cache = out.past_key_values
    sliding = cache.layers[0]
    assert isinstance(sliding, UniformQuantLayer) and sliding.tokens_held() == WINDOW - 1
    assert sliding.batch_size() == cache.layers[3].batch_size() == 4
