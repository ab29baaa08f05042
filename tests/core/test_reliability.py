"""One test per fault found by the reliability review (issue 15): each failed before its fix."""

import copy

import pytest
import torch

import hf_kvcache  # noqa: F401
from hf_kvcache.attention import pending_requests
from hf_kvcache import KIVICache, TieredQuantCache
from hf_kvcache.caches.base import Placeholder
from hf_kvcache.eval import load_tokens

pytestmark = pytest.mark.slow

GRAD_CACHES = {
    "int8": {}, "int4": {}, "fp8": {}, "tiered": {}, "kivi": {}, "cpac": {"page_size": 8},
}


# ---- 1. grad mode ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GRAD_CACHES))
def test_every_cache_works_in_grad_mode(smol, moby_text, name):
    """Outside torch.no_grad, as a training or attribution loop runs: stored tensors are detached, gradients reach
    the new tokens of the forward."""
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 200)
    cache = hf_kvcache.build_cache(name, model.config, **GRAD_CACHES[name])
    model(input_ids=ids[:, :180], past_key_values=cache)
    out = model(input_ids=ids[:, 180:], past_key_values=cache)
    assert out.logits.requires_grad
    out.logits[0, -1].logsumexp(-1).backward()
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)
    for layer in cache.layers:
        assert not any(t.requires_grad for t in layer.held_tensors())


# ---- 2. switching the attention implementation ------------------------------------------------------------------------
@torch.no_grad()
def test_switching_attention_after_fused_reads_stays_right(smol, moby_text):
    """A cache bound to the fused attention, then the model switched to sdpa: the next forward gets dequantized
    tensors (same logits as an unbound copy of the cache), never the placeholders."""
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 300)
    cache = TieredQuantCache(config=model.config, tail_length=16, warm_length=64, group_size=16)
    try:
        model.set_attn_implementation("hf_kvcache")
        assert cache.bind(model)
        model(ids[:, :280], past_key_values=cache)
        for i in range(280, 290):  # decode steps read the codes in place
            model(ids[:, i : i + 1], past_key_values=cache)
        assert pending_requests(cache.layers) == 0  # no request outlives the forward that made it
        reference = copy.deepcopy(cache)
        reference.unbind()
        model.set_attn_implementation("sdpa")
        got = model(ids[:, 290:291], past_key_values=cache).logits
        want = model(ids[:, 290:291], past_key_values=reference).logits
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    finally:
        model.set_attn_implementation("sdpa")


def test_placeholders_cannot_be_read():
    p = Placeholder.like(torch.randn(1, 2, 3, 4), 5)
    assert p.shape == (1, 2, 5, 4) and p.dim() == 4 and p.dtype == torch.float32
    with pytest.raises(RuntimeError, match="attn_implementation='hf_kvcache'"):
        torch.matmul(torch.randn(1, 2, 1, 4), p.transpose(2, 3))
    with pytest.raises(RuntimeError, match="placeholder"):
        p + 1


@torch.no_grad()
def test_generate_binds_then_hands_the_model_back(smol, pydoc_text):
    model, tok = smol
    model.set_attn_implementation("sdpa")
    ids = load_tokens(tok, pydoc_text, 0, 120)
    out = model.generate(ids, cache_implementation="tiered", cache_config={"tail_length": 16, "warm_length": 32,
                         "group_size": 16}, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert model.config._attn_implementation == "sdpa"
    assert all(layer.fused_binding is None for layer in out.past_key_values.layers)


# ---- 3. padding -----------------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("cache_class", [TieredQuantCache, KIVICache])
def test_padding_values_never_change_real_codes(smol, moby_text, cache_class):
    """The same left-padded batch with two different pad tokens: every stored tensor of the real positions is
    identical (before the fix the pad keys entered the per-channel key groups' min/max)."""
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 160)
    short = ids[:, :100]
    mask = torch.ones(2, 160, dtype=torch.long)
    mask[1, :60] = 0
    stores = []
    for pad_id in (0, 17):
        batch = torch.cat([ids, torch.cat([torch.full((1, 60), pad_id), short], 1)])
        cache = cache_class(config=model.config, **({"residual_length": 32} if cache_class is KIVICache else
                                                    {"tail_length": 32, "warm_length": 32, "rotation": "none"}))
        cache.set_padding(mask)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        model(batch, attention_mask=mask, position_ids=position_ids, past_key_values=cache)
        stores.append(cache.layers[3].state_tensors())
    assert stores[0].keys() == stores[1].keys()
    assert any(name.startswith(("warm", "archive")) for name in stores[0])  # quantized tiers are compared
    for name in stores[0]:
        if name.startswith(("tail", "sink")):
            continue  # full-precision positions: the padding positions themselves differ there
        assert torch.equal(stores[0][name][1], stores[1][name][1]), name
        assert torch.equal(stores[0][name][0], stores[1][name][0]), name


@torch.no_grad()
def test_left_padded_batch_generates_what_each_prompt_does_alone(smol, moby_text):
    """KIVI (no sinks): each row of a left-padded batch of 3 generates the tokens it generates alone
    (before the fix: row 2 had 15 of 20)."""
    model, tok = smol
    tok.padding_side = "left"
    prompts = [moby_text[20000:20900], moby_text[30000:30300], moby_text[40000:40150]]
    batch = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    out = model.generate(**batch, cache_implementation="kivi", **kw)
    width = batch.input_ids.shape[1]
    for i, p in enumerate(prompts):
        one = tok(p, return_tensors="pt")
        alone = model.generate(**one, cache_implementation="kivi", **kw)
        assert torch.equal(out[i, width:], alone[0, one.input_ids.shape[1]:]), i


# ---- 4. bytes ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_tiered_bytes_count_the_rotations(smol, moby_text):
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 100)
    cache = TieredQuantCache(config=model.config, rotation="both")
    model(ids, past_key_values=cache)
    layer = cache.layers[0]
    rotations = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in (*layer.rot_k.tensors(), *layer.rot_v.tensors())}
    store = sum(t.nbytes for l in cache.layers for t in l.tiers.tensors())
    # the rotations (signs and Sylvester factors) are shared by every layer (one per size and seed): counted once
    assert cache.memory_stats()["bytes"] == store + sum(rotations.values())


@torch.no_grad()
def test_peer_fp8_quantized_cache_bytes_are_counted(smol, moby_text):
    from transformers import QuantizedCache, cache_utils

    if not hasattr(cache_utils, "Fp8QuantizedLayer"):
        pytest.skip("transformers before 5.21 has no fp8 QuantizedCache backend")
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 64)
    cache = QuantizedCache(backend="fp8", config=model.config)
    model(ids, past_key_values=cache)
    stats = hf_kvcache.memory_stats(cache)
    layers = model.config.num_hidden_layers
    per_layer = 2 * 3 * 64 * 64  # keys + values, 3 KV heads, 64 tokens, head_dim 64, one byte each
    assert stats["bytes"] >= layers * per_layer
    assert stats["bytes"] <= layers * (per_layer + 2 * 8)  # plus a per-tensor scale each
    assert stats["fp16_bytes"] == 2 * layers * per_layer


# ---- 6. KIVI's residual window ----------------------------------------------------------------------------------------
@torch.no_grad()
def test_kivi_compresses_on_an_fp32_model(smol, moby_text):
    """The residual window is stored in 16 bits, as the tiered tail is (was: the model's fp32, 1.06x at 330 tokens)."""
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 330)
    cache = KIVICache(config=model.config)
    model(ids, past_key_values=cache)
    assert cache.layers[0].tiers.tail.keys.dtype == torch.float16
    assert cache.memory_stats()["ratio"] > 1.85  # measured 1.90 (138 of 330 tokens still in the 16-bit window)


# ---- 5. error paths -------------------------------------------------------------------------------------------------
def test_bench_checks_every_spec_before_measuring(monkeypatch, capsys):
    """A bad spec late in the list fails at once, before the first row is measured."""
    from hf_kvcache.cli import main
    from hf_kvcache.eval import bench

    measured = []
    monkeypatch.setattr(bench, "streaming_perplexity", lambda *a, **k: measured.append(a) or pytest.fail("measured"))
    code = main(["bench", "--tokens", "16", "--caches", "dynamic", "int8", 'uniform:{"dtype": "int9"}'])
    assert code == 2 and not measured
    assert "dtype='int9' is not valid" in capsys.readouterr().err


def test_invalid_json_cache_config_names_the_fix(capsys):
    from hf_kvcache.cli import main

    assert main(["ppl", "--tokens", "8", "--cache", "uniform", "--cache-config", "{dtype: int4}"]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and '\'{"dtype": "int4"}\'' in err


def test_missing_peer_backend_says_what_to_install(monkeypatch, capsys):
    from hf_kvcache.cli import main
    from hf_kvcache.eval import bench

    monkeypatch.setitem(bench.PEER_PACKAGES, "hf-quanto", ("no_such_module_xyz", "optimum-quanto"))
    assert main(["caches"]) == 0
    assert "hf-quanto  (needs: pip install optimum-quanto" in capsys.readouterr().out
    with pytest.raises(ValueError, match="pip install optimum-quanto"):
        bench.build_peer_cache("hf-quanto", None)


@torch.no_grad()
def test_cache_for_a_smaller_config_is_a_clear_error(smol):
    model, tok = smol
    small = copy.deepcopy(model.config)
    small.num_hidden_layers = 4
    cache = hf_kvcache.build_cache("int8", small)
    with pytest.raises(ValueError, match=r"built for a config with 4 layers.*config=model.config"):
        model(torch.tensor([[1, 2, 3]]), past_key_values=cache)


@torch.no_grad()
def test_generate_inside_attached_keeps_the_outer_binding(smol, pydoc_text):
    """An inner generate with the cache an outer `attached` holds takes no lease of its own, so it hands back
    nothing the outer call set up."""
    model, tok = smol
    model.set_attn_implementation("sdpa")
    ids = load_tokens(tok, pydoc_text, 0, 40)
    cache = TieredQuantCache(config=model.config, rotation="none")
    with hf_kvcache.attached(model, cache):
        model(ids, past_key_values=cache)
        model.generate(torch.cat([ids, ids[:, :1]], 1), past_key_values=cache, max_new_tokens=3, do_sample=False)
        assert model.config._attn_implementation == "hf_kvcache"
        assert all(layer.fused_binding is not None for layer in cache.layers)
    assert model.config._attn_implementation == "sdpa"
    assert all(layer.fused_binding is None for layer in cache.layers)
