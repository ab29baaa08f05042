"""The fused attention path on SmolLM2: same logits as dequantize + SDPA, and it really runs fused."""

import pytest
import torch

import hf_kvcache  # noqa: F401
from hf_kvcache import TieredQuantCache
from hf_kvcache.eval import load_tokens

pytestmark = pytest.mark.slow

# small tiers, so that 300 steps cross tail -> warm -> archive many times
OPTIONS = dict(tail_length=16, warm_length=64, group_size=16)


def generate_logits(model, ids, attn, steps):
    model.set_attn_implementation(attn)
    try:
        cache = TieredQuantCache(config=model.config, **OPTIONS)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    finally:
        model.set_attn_implementation("sdpa")
    return out, cache


def test_fused_logits_equal_dequantize_sdpa_over_300_tokens(smol, moby_text):
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 40)
    ref, _ = generate_logits(model, ids, "sdpa", 300)
    fused, cache = generate_logits(model, ids, "hf_kvcache", 300)
    assert all(layer.fused_reader for layer in cache.layers), "the fused kernel did not take over"
    tiers = cache.layers[0].tier_tokens()
    assert tiers["archive"] > 0 and tiers["warm"] > 0
    ref_logits, fused_logits = torch.stack(ref.logits), torch.stack(fused.logits)
    torch.testing.assert_close(fused_logits, ref_logits, atol=2e-3, rtol=1e-3)
    assert torch.equal(fused.sequences, ref.sequences)


def test_fused_batch_with_left_padding(smol, pydoc_text, moby_text):
    model, tok = smol
    tok.padding_side = "left"
    prompts = [tok.decode(load_tokens(tok, pydoc_text, 0, 10)[0]), tok.decode(load_tokens(tok, moby_text, 5000, 70)[0])]
    batch = tok(prompts, return_tensors="pt", padding=True)
    outs = []
    for attn in ("sdpa", "hf_kvcache"):
        model.set_attn_implementation(attn)
        try:
            cache = TieredQuantCache(config=model.config, **OPTIONS)
            outs.append(model.generate(**batch, past_key_values=cache, max_new_tokens=40, do_sample=False,
                                       pad_token_id=tok.pad_token_id, output_logits=True,
                                       return_dict_in_generate=True))
        finally:
            model.set_attn_implementation("sdpa")
    torch.testing.assert_close(torch.stack(outs[1].logits), torch.stack(outs[0].logits), atol=2e-3, rtol=1e-3)
