"""A user's own loop on an sdpa model (`model(ids, past_key_values=cache)`, no `attached`): layers of ours that ask
the attention for queries, mass or masks are served by the "hf_kvcache" attention; every other call is transformers'
own SDPA, untouched (`hf_kvcache.attention.plain`)."""

import pytest
import torch
from models import eviction_llama, tiny_llama
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_kvcache
from hf_kvcache import H2OCache, TieredQuantCache, UniformQuantCache
from hf_kvcache.attention import plain

TIERED = dict(tail_length=16, warm_length=32, group_size=16, archive_group_size=16)


@pytest.fixture
def counted(monkeypatch):
    """How many calls the sdpa wrapper handed to the hf_kvcache attention."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[2].shape[2])
        return hf_kvcache.attention.hf_kvcache_attention(*args, **kwargs)

    monkeypatch.setattr(plain, "hf_kvcache_attention", counting)
    return calls


@pytest.fixture
def unserved():
    """Plain loops without the service (transformers' sdpa as registered), restored afterwards."""
    hf_kvcache.serve_plain_loops(False)
    try:
        yield
    finally:
        hf_kvcache.serve_plain_loops(True)


def stream(model, cache, ids, first=20):
    """Prefill `first` tokens, then one token per forward; the logits of every forward, concatenated."""
    out = [model(ids[:, :first], past_key_values=cache).logits]
    out += [model(ids[:, i : i + 1], past_key_values=cache).logits for i in range(first, ids.shape[1])]
    return torch.cat(out, dim=1)


def test_import_wraps_the_registered_sdpa_and_the_switch_restores_it(unserved):
    assert not hf_kvcache.attention.serving() and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    hf_kvcache.serve_plain_loops(True)
    hf_kvcache.serve_plain_loops(True)  # idempotent: wrapped once
    assert hf_kvcache.attention.serving() and ALL_ATTENTION_FUNCTIONS["sdpa"].wrapped is sdpa_attention_forward
    hf_kvcache.serve_plain_loops(False)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


@torch.inference_mode()
def test_eviction_in_a_plain_sdpa_loop_equals_the_hf_kvcache_attention(counted):
    """H2O ranks by attention mass: in a plain sdpa loop it now gets it, and evicts exactly as under the
    "hf_kvcache" attention (every call of its layers is served)."""
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    sdpa_model, ours = eviction_llama(), eviction_llama("hf_kvcache")
    got_cache, want_cache = H2OCache(config=sdpa_model.config, budget=8), H2OCache(config=ours.config, budget=8)
    got = stream(sdpa_model, got_cache, ids)
    want = stream(ours, want_cache, ids)
    assert sdpa_model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got_cache.tokens_held() == want_cache.tokens_held() == 8
    assert len(counted) == 11 * sdpa_model.config.num_hidden_layers  # prefill + 10 decode steps, every layer


@torch.inference_mode()
def test_without_the_service_eviction_still_says_what_is_missing(unserved):
    model = eviction_llama()
    cache = H2OCache(config=model.config, budget=4)
    ids = torch.randint(0, 97, (1, 6))
    model(ids, past_key_values=cache)
    with pytest.raises(RuntimeError, match="serve_plain_loops"):
        model(ids[:, :1], past_key_values=cache)


@pytest.mark.parametrize("make", [lambda cfg: DynamicCache(config=cfg),
                                  lambda cfg: UniformQuantCache(config=cfg, dtype="int4")], ids=["dynamic", "int4"])
@torch.inference_mode()
def test_calls_that_ask_nothing_stay_transformers_own(make, counted):
    """Keys no layer of ours returned, and layers that ask nothing: bit-identical to the unwrapped sdpa."""
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    served = stream(model, make(model.config), ids)
    hf_kvcache.serve_plain_loops(False)
    try:
        unwrapped = stream(model, make(model.config), ids)
    finally:
        hf_kvcache.serve_plain_loops(True)
    torch.testing.assert_close(served, unwrapped, atol=0, rtol=0)
    assert counted == []


@torch.inference_mode()
def test_tiered_calibrates_in_a_plain_loop_as_it_does_attached(counted):
    """A calibrating tiered layer asks for its queries: served until it has chosen, then transformers' sdpa again;
    the recipes are those the same stream chooses under `attached`."""
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(2))
    plain_cache = TieredQuantCache(config=model.config, **TIERED)
    stream(model, plain_cache, ids, first=120)
    served = len(counted)
    attached_cache = TieredQuantCache(config=model.config, **TIERED)
    with hf_kvcache.attached(model, attached_cache):
        stream(model, attached_cache, ids, first=120)
    assert [r["source"] for r in plain_cache.recipes()] == ["queries"] * 2
    assert plain_cache.recipes() == attached_cache.recipes()
    assert served == 2  # the prefill of each layer; the layers chose at the next update and asked nothing more


@torch.inference_mode()
def test_without_the_service_tiered_sees_no_queries(unserved):
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(2))
    cache = TieredQuantCache(config=model.config, **TIERED)
    stream(model, cache, ids, first=120)
    assert [r["source"] for r in cache.recipes()] == ["no-queries"] * 2
