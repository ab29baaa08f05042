"""SmolLM2-135M on real text: the cache contract as generate() uses it."""

import math

import pytest
import torch
from transformers import DynamicCache

import hf_kvcache  # noqa: F401  (registers the cache names)
from hf_kvcache import UniformQuantCache
from hf_kvcache.eval import forward_perplexity, load_tokens, streaming_perplexity

pytestmark = pytest.mark.slow


def prompt_ids(tokenizer, text, n):
    return load_tokens(tokenizer, text, 0, n)


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_streaming_dynamic_equals_one_forward(smol, moby_text, chunk):
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 96)
    ref = forward_perplexity(model, ids)
    res = streaming_perplexity(model, ids, DynamicCache(config=model.config), chunk)
    assert abs(res.perplexity / ref - 1) < 1e-3
    assert res.tokens == 96 and res.bytes > 0
    # per-chunk nll (what `hf-kvcache paired` resamples) adds up to the perplexity; 95 tokens scored
    assert len(res.chunk_nll) == -(-96 // chunk) and math.exp(sum(res.chunk_nll) / 95) == res.perplexity


def test_int8_perplexity_close_to_dynamic(smol, moby_text):
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 256)
    ref = streaming_perplexity(model, ids, DynamicCache(config=model.config), 32)
    res = streaming_perplexity(model, ids, UniformQuantCache(config=model.config, dtype="int8"), 32)
    assert abs(res.perplexity / ref.perplexity - 1) < 0.002
    assert res.ratio >= 1.9


def test_int8_greedy_equals_dynamic(smol, pydoc_text):
    model, tok = smol
    ids = prompt_ids(tok, pydoc_text, 60)
    kw = dict(max_new_tokens=24, do_sample=False, min_new_tokens=24)
    ref = model.generate(ids, **kw)
    out = model.generate(ids, past_key_values=UniformQuantCache(config=model.config, dtype="int8"), **kw)
    assert out.shape[1] - ids.shape[1] == 24
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_cache_implementation_equals_past_key_values(smol, pydoc_text, name):
    model, tok = smol
    ids = prompt_ids(tok, pydoc_text, 40)
    kw = dict(max_new_tokens=12, do_sample=False)
    by_name = model.generate(ids, cache_implementation=name, return_dict_in_generate=True, **kw)
    cache = hf_kvcache.build_cache(name, model.config)
    by_object = model.generate(ids, past_key_values=cache, **kw)
    assert isinstance(by_name.past_key_values, UniformQuantCache)
    assert by_name.past_key_values.options == cache.options
    assert torch.equal(by_name.sequences, by_object)


def test_cache_config_reaches_the_cache(smol, pydoc_text):
    model, tok = smol
    ids = prompt_ids(tok, pydoc_text, 20)
    out = model.generate(
        ids, cache_implementation="uniform", cache_config={"dtype": "int4", "group_size": 16},
        max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
    )
    assert out.past_key_values.options.group_size == 16 and out.past_key_values.options.dtype == "int4"


def test_unknown_names_and_options_raise(smol, pydoc_text):
    model, tok = smol
    ids = prompt_ids(tok, pydoc_text, 10)
    with pytest.raises(ValueError, match="Invalid `cache_implementation`"):
        model.generate(ids, cache_implementation="int9", max_new_tokens=2)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['bits'\]"):
        model.generate(ids, cache_implementation="uniform", cache_config={"bits": 3}, max_new_tokens=2)
    with pytest.raises(ValueError, match="fixed by this cache name"):
        model.generate(ids, cache_implementation="int8", cache_config={"dtype": "int4"}, max_new_tokens=2)


def test_int4_hadamard_rotation_through_generate_and_its_perplexity(smol, pydoc_text, moby_text):
    """`cache_config={"rotation": "hadamard"}` reaches the cache through generate (which binds it: the rotated codes
    are read dequantized) and gives what the same cache passed as an object gives; on real text its int4 codes
    lose less perplexity than int4's."""
    model, tok = smol
    ids = prompt_ids(tok, pydoc_text, 40)
    kw = {"max_new_tokens": 12, "do_sample": False}
    by_name = model.generate(ids, cache_implementation="int4", cache_config={"rotation": "hadamard"},
                             return_dict_in_generate=True, **kw)
    assert by_name.past_key_values.options.rotation == "hadamard"
    by_object = model.generate(ids, past_key_values=UniformQuantCache(config=model.config, dtype="int4",
                                                                      rotation="hadamard"), **kw)
    assert torch.equal(by_name.sequences, by_object)
    text = load_tokens(tok, moby_text, 5000, 512)
    ref = streaming_perplexity(model, text, DynamicCache(config=model.config), 64).perplexity
    delta = {rot: streaming_perplexity(model, text, UniformQuantCache(config=model.config, dtype="int4",
                                                                      rotation=rot), 64).perplexity / ref - 1
             for rot in ("none", "hadamard")}
    print(f"int4 perplexity vs dynamic, 512 tokens: {delta}")
    assert delta["hadamard"] < delta["none"], delta
