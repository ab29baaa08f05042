"""The fused attention path on SmolLM2: same logits as dequantize + SDPA (30 steps over all tiers), and it really
runs fused."""

import pytest
import torch

import hf_kvcache  # noqa: F401
from hf_kvcache import TieredQuantCache
from hf_kvcache.eval import load_tokens

pytestmark = pytest.mark.slow

# small tiers, so that 300 steps cross tail -> warm -> archive many times; no sinks (the fused path does not read
# the sink overlay nor rotated tiers yet: then the layer hands over dequantized tensors)
OPTIONS = dict(tail_length=16, warm_length=64, group_size=16, sink_length=0, rotation="none")


def generate_logits(model, ids, attn, steps):
    model.set_attn_implementation(attn)
    try:
        cache = TieredQuantCache(config=model.config, **OPTIONS)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    finally:
        model.set_attn_implementation("sdpa")
    return out, cache


def test_fused_logits_equal_dequantize_sdpa(smol, moby_text):
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 130)
    ref, _ = generate_logits(model, ids, "sdpa", 30)
    fused, cache = generate_logits(model, ids, "hf_kvcache", 30)
    assert all(layer.fused_reader for layer in cache.layers), "the fused kernel did not take over"
    tiers = cache.layers[0].tier_tokens()
    assert tiers["archive"] > 0 and tiers["warm"] > 0
    torch.testing.assert_close(torch.stack(fused.logits), torch.stack(ref.logits), atol=1e-2, rtol=1e-3)
    assert torch.equal(fused.sequences, ref.sequences)
