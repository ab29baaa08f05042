"""CPACCache: pages, deltas, pressure, importance, byte accounting, the batch / beam contract, generate()."""

import copy
import json
import logging

import pytest
import torch
from transformers import LlamaForCausalLM

import hf_kvcache
from attention_driver import drive
from hf_kvcache import CPACCache
from hf_kvcache.caches.cpac import BASE, DELTA, RAW, CPACOptions, decode_delta, encode_delta
from hf_kvcache.caches.cpac.features import importance_weight, page_features, threshold_for_pressure
from hf_kvcache.rope import KeyRotation
from models import cache_config as tiny_config

B, H, D, LAYERS = 2, 3, 64, 2


def feed(cache, chunks, seed=0, mass=None):
    """Update every layer chunk by chunk; report the last queries and the attention mass when `mass(n_keys)` is
    given, as the 'hf_kvcache' attention does. Returns all K, V."""
    g = torch.Generator().manual_seed(seed)
    ks, vs = [], []
    for n in chunks:
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        q = torch.randn(B, 2 * H, n, D, generator=g)
        drive(cache, k, v, queries=q, mass=mass, scaling=D**-0.5, layers=LAYERS, report=mass is not None)
        ks.append(k)
        vs.append(v)
    return torch.cat(ks, 2), torch.cat(vs, 2)


def uniform_mass(n):
    return torch.ones(B, H, n)


ALL_DELTA = dict(thresholds=[-1, -1, -1])  # every page similar enough: all deltas after the first base


@pytest.fixture(autouse=True)
def one_thread():
    """CPAC runs many small tensor ops: on a busy 2-core machine they run far faster unthreaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- pages -----------------------------------------------------------------------------------------------------------
def test_pages_compress_only_when_full_and_older_than_recent():
    cache = CPACCache(config=tiny_config(), page_size=4, recent_pages=2, **ALL_DELTA)
    layer = cache.layers[0]
    feed(cache, [11], mass=uniform_mass)  # 2 full pages, both recent
    assert layer.n_pages == 0 and layer.tail_tokens() == 11
    feed(cache, [4], mass=uniform_mass)  # 15 tokens: 3 full pages, the oldest is old enough
    assert layer.n_pages == 1 and layer.tail_tokens() == 11
    feed(cache, [9], mass=uniform_mass)  # 24 tokens: 6 full pages
    assert layer.n_pages == 4 and layer.tail_tokens() == 8 and layer.tokens_held() == 24
    counts = layer.page_counts()
    assert counts["base_pages"] == 2 * B * H and counts["delta_pages"] == 2 * 3 * B * H  # keys and values


def test_without_attention_mass_compression_waits_one_update_then_falls_back(caplog):
    cache = CPACCache(config=tiny_config(), page_size=4, recent_pages=0)
    layer = cache.layers[0]
    with caplog.at_level(logging.WARNING, logger="hf_kvcache.caches.cpac"):
        feed(cache, [8])
        assert layer.n_pages == 0  # waiting for the attention mass of this update
        feed(cache, [8])
    assert layer.n_pages == 4 and layer.tail_tokens() == 0
    notes = [r for r in caplog.records if "falls back to uniform" in r.getMessage()]
    assert len(notes) == 1  # one note per cache, not per layer
    assert torch.count_nonzero(layer.importance()) == 0


# ---- deltas ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("scale", ["page", "token", "channel"])
def test_delta_roundtrip_error_bound(bits, scale):
    torch.manual_seed(0)
    delta = torch.randn(5, 16, D) * torch.linspace(0.1, 4, D)
    codes, scales, zeros = encode_delta(delta, bits, scale)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float16 and zeros is None
    assert codes.shape[1] == 16 * D * bits // 8  # really packed
    back = decode_delta(codes, scales, bits, scale, 16, D)
    # each element within half a quantization step of its group's scale
    shape = {"page": (5, 1, 1), "token": (5, 16, 1), "channel": (5, 1, D)}[scale]
    step = scales.float().view(shape)
    assert ((back - delta).abs() <= step / 2 + 1e-5).all()


def test_layer_roundtrip_and_decompress_page():
    cache = CPACCache(config=tiny_config(), page_size=8, recent_pages=1, **ALL_DELTA)
    k, v = feed(cache, [30, 17], mass=uniform_mass)
    layer = cache.layers[1]
    k_out, v_out = layer.materialize()
    assert k_out.shape == k.shape and v_out.dtype == torch.float32
    assert (k_out - k).norm() / k.norm() < 0.02 and (v_out - v).norm() / v.norm() < 0.02
    assert torch.equal(k_out[:, :, -layer.tail_tokens():], k[:, :, -layer.tail_tokens():].half().float())
    for page in range(layer.n_pages):
        part = k_out[1, 2, page * 8 : (page + 1) * 8]
        assert torch.allclose(layer.decompress_page("k", 1, 2, page), part)


@pytest.mark.parametrize("reference", ["base", "keys", "zero"])
def test_references(reference):
    cache = CPACCache(config=tiny_config(), page_size=8, recent_pages=0, delta_bits=4, reference=reference, **ALL_DELTA)
    k, v = feed(cache, [32], mass=uniform_mass)
    layer = cache.layers[0]
    k_out, v_out = layer.materialize()
    assert (v_out - v).norm() / v.norm() < 0.18  # measured 0.129 (base), 0.118 (keys, zero): 4-bit deltas
    bases = {s: int((layer.pools[s].mode == BASE).sum()) for s in "kv"}
    expected = {"base": (B * H, B * H), "keys": (B * H, 0), "zero": (0, 0)}[reference]
    assert (bases["k"], bases["v"]) == expected
    if reference == "zero":
        assert (layer.pools["k"].dbase == -1).all()
    if reference == "keys":  # the keys' own features decide (values have no bases to compare with)
        same = CPACCache(config=tiny_config(), page_size=8, recent_pages=0, delta_bits=4, similarity_on="keys",
                         thresholds=[0.9, 0.9, 0.9])
        ref = CPACCache(config=tiny_config(), page_size=8, recent_pages=0, delta_bits=4, reference="keys",
                        thresholds=[0.9, 0.9, 0.9])
        feed(same, [32], mass=uniform_mass)
        feed(ref, [32], mass=uniform_mass)
        assert torch.equal(same.layers[0].pools["k"].mode, ref.layers[0].pools["k"].mode)


def test_asymmetric_deltas_carry_zero_points():
    g = torch.Generator().manual_seed(3)
    offset = torch.linspace(-8, 8, D)  # per-channel offsets: what a symmetric code wastes its range on
    k = torch.randn(B, H, 32, D, generator=g) + offset
    errs = {}
    for asym in (False, True):
        cache = CPACCache(config=tiny_config(), page_size=8, recent_pages=0, delta_bits=3, delta_scale="channel",
                          reference="zero", delta_asymmetric=asym)
        for i in range(LAYERS):
            keys, _ = cache.update(k, k, i)
            cache.layers[i].observe_attention(torch.ones(B, H, keys.shape[2]))
        layer = cache.layers[0]
        assert (layer.pools["k"].dzero is not None) == asym
        assert cache.memory_stats()["bytes"] == sum(t.nbytes for lay in cache.layers for t in lay.held_tensors())
        errs[asym] = ((layer.materialize()[0] - k).norm() / k.norm()).item()
        assert torch.allclose(layer.decompress_page("k", 1, 1, 2), layer.materialize()[0][1, 1, 16:24])
    assert errs[True] < errs[False] / 2


def test_derotated_keys_roundtrip():
    config = tiny_config()
    rotation = KeyRotation.from_config(config)
    x = torch.randn(B, H, 40, D)
    assert torch.allclose(rotation.rotate(rotation.derotate(x, 7), 7), x, atol=1e-5)
    cache = CPACCache(config=config, key_space="derotated", page_size=8, recent_pages=1, **ALL_DELTA)
    k, _ = feed(cache, [40], mass=uniform_mass)
    k_out, _ = cache.layers[0].materialize()
    assert (k_out - k).norm() / k.norm() < 0.02


# ---- bytes, pressure, importance -------------------------------------------------------------------------------------
def test_bytes_are_sum_of_nbytes_and_storage_shrinks():
    # crop_window=0: the query ring kept for crop (32 queries of 6 heads, half the fp16 size of these 64 tokens) is
    # counted in test_crop_takes_the_cropped_queries_out_of_the_importance
    cache = CPACCache(config=tiny_config(), page_size=8, recent_pages=1, crop_window=0, **ALL_DELTA)
    feed(cache, [64], mass=uniform_mass)
    stats = cache.memory_stats()
    held = sum(t.nbytes for layer in cache.layers for t in layer.held_tensors())
    assert stats["bytes"] == held
    assert stats["full_bytes"] + stats["delta_bytes"] + stats["tail_bytes"] + stats["meta_bytes"] == held
    assert stats["fp16_bytes"] == 2 * 2 * LAYERS * B * H * 64 * D
    assert stats["delta_pages"] == 2 * LAYERS * B * H * 6 and stats["delta_bytes"] > 0
    assert stats["ratio"] > 1.5
    assert cache.layers[0].pools["k"].dcodes.dtype == torch.uint8


def test_thresholds_follow_pressure():
    t, levels = (0.95, 0.85, 0.70), (0.6, 0.8)
    assert [threshold_for_pressure(p, t, levels) for p in (0.0, 0.3, 0.59, 0.6, 0.79, 0.8, 0.9, 5)] == [
        0.95, 0.95, 0.95, 0.85, 0.85, 0.70, 0.70, 0.70]
    for p, thr in ((0.3, 0.95), (0.6, 0.85), (0.9, 0.70)):
        assert CPACCache(config=tiny_config(), pressure=p).memory_stats()["threshold"] == thr
    # measured pressure: bytes held / budget (a fraction of the fp16 size of the tokens seen, or bytes)
    cache = CPACCache(config=tiny_config(), memory_budget=0.5, page_size=8)
    feed(cache, [40], mass=uniform_mass)
    s = cache.memory_stats()
    assert s["pressure"] == pytest.approx(s["bytes"] / (0.5 * s["fp16_bytes"]))
    assert s["threshold"] == 0.70  # nothing compressible yet is much: pressure > 0.8
    cache = CPACCache(config=tiny_config(), memory_budget=10**9)
    feed(cache, [40], mass=uniform_mass)
    assert cache.memory_stats()["pressure"] == pytest.approx(cache.memory_stats()["bytes"] / 1e9)


def test_more_pressure_more_deltas():
    """Pages built with a known similarity to the first page: a stricter threshold keeps more of them full."""
    g = torch.Generator().manual_seed(1)
    first = torch.randn(B, H, 8, D, generator=g)
    chunks = [first]
    for mix in (0.97, 0.9, 0.8, 0.75):  # page-feature cosines to `first` fall with the mix
        noise = torch.randn(B, H, 8, D, generator=g)
        chunks.append(mix * first + (1 - mix**2) ** 0.5 * noise)
    deltas = []
    for p in (0.3, 0.6, 0.9):
        cache = CPACCache(config=tiny_config(), pressure=p, page_size=8, recent_pages=0, features="page",
                          similarity_on="values", protect_importance=None, importance_weighting=False)
        for c in chunks:
            for i in range(LAYERS):
                keys, _ = cache.update(c, c, i)
                cache.layers[i].observe_attention(torch.ones(B, H, keys.shape[2]))
        deltas.append(cache.memory_stats()["delta_pages"])
    assert deltas[0] < deltas[1] < deltas[2]


def test_importance_protects_attended_pages():
    cache = CPACCache(config=tiny_config(), page_size=4, recent_pages=0, protect_importance=0.5, **ALL_DELTA)

    def sink_mass(n):  # the first page draws most attention
        m = torch.full((B, H, n), 0.01)
        m[:, :, :4] = 1.0
        return m

    feed(cache, [4, 4, 4, 4], mass=sink_mass)
    layer = cache.layers[0]
    imp = layer.importance()
    assert imp.shape == (B, H, 4) and torch.allclose(imp[..., 0], torch.ones(B, H))
    mode = layer.pools["k"].mode
    assert (mode[..., 0] == RAW).all()  # protected: kept as it is
    assert (mode[..., 1] == BASE).all() and (mode[..., 2:] == DELTA).all()
    assert importance_weight(torch.tensor(0.9), torch.tensor(0.2)).item() == pytest.approx(0.3)


def test_observe_attention_checks_shape():
    cache = CPACCache(config=tiny_config())
    feed(cache, [5])
    with pytest.raises(ValueError, match=r"expects mass \[batch, kv_heads, tokens\]"):
        cache.layers[0].observe_attention(torch.ones(B, H, 4))


def test_page_features():
    """The dot product of the features of two pages is the cosine the features module describes for each kind,
    computed here from its description (mean, variance, signature, orthonormal DCT-II rows 1..4)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 16, D, generator=g), torch.randn(7, 16, D, generator=g) + 0.3

    def cos(a, b):
        return torch.nn.functional.cosine_similarity(a, b, dim=-1)

    dct = torch.stack([(2 / 16) ** 0.5 * torch.cos(torch.pi * k * (torch.arange(16) + 0.5) / 16) for k in range(1, 5)])

    def summary(p):
        sig = p.abs().mean(-1)
        return torch.cat([p.mean((1, 2))[:, None], p.var((1, 2), correction=0)[:, None], sig, sig @ dct.T], -1)

    def blocks(p):
        return [p.mean(1), p.var(1, correction=0), p.abs().mean(1), torch.einsum("kp,npd->nkd", dct, p).flatten(1)]

    expected = {
        "summary": cos(summary(x), summary(y)),
        "channel": torch.stack([cos(a, b) for a, b in zip(blocks(x), blocks(y))]).mean(0),
        "page": cos(x.flatten(1), y.flatten(1)),
    }
    for kind, want in expected.items():
        f = page_features(x, 4, kind)
        assert torch.allclose(f.norm(dim=-1), torch.ones(7), atol=1e-5)
        assert torch.allclose((f * page_features(y, 4, kind)).sum(-1), want, atol=1e-5), kind
    assert page_features(x, 4, "summary").shape[-1] == 2 + 16 + 4


# ---- batch / beam contract -------------------------------------------------------------------------------------------
def pool_nbytes(layer):
    return layer.pools["k"].full.nbytes + layer.pools["k"].dcodes.nbytes


def test_beam_and_batch_contract():
    cache = CPACCache(config=tiny_config(), page_size=4, recent_pages=1, **ALL_DELTA)
    feed(cache, [17, 1, 22], mass=uniform_mass)
    before = cache.layers[1].materialize()[0]
    pool_bytes = pool_nbytes(cache.layers[1])
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[1].materialize()[0], before.flip(0))
    cache.batch_repeat_interleave(2)  # pools are shared, not copied
    assert cache.layers[1].materialize()[0].shape[0] == 4
    assert pool_nbytes(cache.layers[1]) == pool_bytes
    cache.batch_select_indices(torch.tensor([0, 3]))
    assert torch.equal(cache.layers[1].materialize()[0], before.flip(0)[[0, 1]])
    cache.reorder_cache(torch.tensor([0, 0]))  # row 1 dropped: its pages leave the pools
    assert pool_nbytes(cache.layers[1]) < pool_bytes
    assert torch.equal(cache.layers[1].materialize()[0], before.flip(0)[[0, 0]])
    feed(cache, [6], mass=uniform_mass)  # keeps working after the remapping
    assert cache.get_seq_length() == 46


def test_crop_into_compressed_pages():
    cache = CPACCache(config=tiny_config(), page_size=4, recent_pages=1, **ALL_DELTA)
    feed(cache, [40], mass=uniform_mass)
    layer = cache.layers[0]
    before = layer.materialize()[0]
    assert layer.n_pages == 9
    cache.crop(-3)  # within the tail
    assert cache.get_seq_length() == 37 and torch.equal(layer.materialize()[0], before[:, :, :37])
    cache.crop(-15)  # reaches into the compressed pages: they come back decompressed
    assert cache.get_seq_length() == 22 and layer.n_pages == 5
    assert torch.allclose(layer.materialize()[0], before[:, :, :22], rtol=1e-3, atol=1e-3)  # back in fp16
    assert cache.memory_stats()["bytes"] == sum(t.nbytes for t in layer.held_tensors()) + cache.layers[1].nbytes()
    feed(cache, [10], mass=uniform_mass)
    assert cache.get_seq_length() == 32
    with pytest.raises(ValueError, match="cannot crop 50 tokens"):
        cache.crop(-50)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.memory_stats()["bytes"] == 0


def test_crop_takes_the_cropped_queries_out_of_the_importance():
    """A forward of 5 tokens cropped by 3 (assisted decoding rejecting candidates) leaves the page importance that a
    forward of the 2 kept tokens leaves: without the attention the cropped queries gave (kept per query and page for
    the last forward, counted in memory_stats) and without their observations, also of the cropped tokens of a page
    cut by the crop. After a crop reaching before the last forward, the next forward raises."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(intermediate_size=64)).eval()
    model.set_attn_implementation("hf_kvcache")
    ids = torch.randint(0, 128, (B, 16), generator=torch.Generator().manual_seed(1))
    cache = CPACCache(config=model.config, page_size=4, recent_pages=1)
    with torch.inference_mode():
        model(ids[:, :10], past_key_values=cache)
        never = copy.deepcopy(cache)
        model(ids[:, 10:15], past_key_values=cache)
        cache.crop(-3)
        model(ids[:, 10:12], past_key_values=never)
        for a, b in zip(cache.layers, never.layers):
            torch.testing.assert_close(a.imp_mass, b.imp_mass, atol=1e-5, rtol=0)
            assert torch.equal(a.imp_obs, b.imp_obs) and torch.equal(a.query_mass_positions, b.query_mass_positions)
        layer = cache.layers[0]
        assert layer.query_mass.shape == (B, H, 2, 3)  # the 2 kept queries of the last forward, 3 pages
        stats = cache.memory_stats()
        assert stats["bytes"] == sum(t.nbytes for lay in cache.layers for t in lay.held_tensors())
        assert stats["full_bytes"] + stats["delta_bytes"] + stats["tail_bytes"] + stats["meta_bytes"] == stats["bytes"]
        assert all(lay.state_tensors()["query_mass"] is lay.query_mass for lay in cache.layers)
        model(ids[:, 12:13], past_key_values=cache)
        cache.crop(-2)  # reaches before the last forward: the storage is cropped, the next forward raises
        assert cache.get_seq_length() == 11
        with pytest.raises(ValueError, match="CPACCache cannot crop 2 token.*crop right after the forward"):
            model(ids[:, 11:12], past_key_values=cache)


def test_a_shallow_copy_crops_without_touching_the_original():
    """The prefix store crops `copy.copy(layer)` before encoding it: the layer it was copied from keeps its pages."""
    cache = CPACCache(config=tiny_config(), page_size=4, recent_pages=1, **ALL_DELTA)
    feed(cache, [40], mass=uniform_mass)
    layer = cache.layers[0]
    before, held = layer.materialize()[0], cache.memory_stats()["bytes"]
    snap = copy.copy(layer)
    snap.crop(-15)
    assert snap.n_pages == 6 and layer.n_pages == 9
    assert torch.allclose(snap.materialize()[0], before[:, :, :25], rtol=1e-3, atol=1e-3)  # back in fp16
    assert torch.equal(layer.materialize()[0], before) and cache.memory_stats()["bytes"] == held


def test_without_config_layers_are_created_lazily():
    cache = CPACCache(page_size=4, recent_pages=1)
    feed(cache, [20], mass=uniform_mass)
    assert len(cache.layers) == LAYERS and cache.layers[1].n_pages == 4
    with pytest.raises(ValueError, match="needs config=model.config"):
        CPACCache(key_space="derotated")


# ---- options ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,match",
    [
        (dict(delta_bits=1), r"delta_bits=1 is not valid; choose one of \[2, 3, 4, 5, 6, 7, 8\]"),
        (dict(delta_scale="row"), r"delta_scale='row' is not valid; choose one of \['page', 'token', 'channel'\]"),
        (dict(similarity_on="queries"), "similarity_on='queries' is not valid; choose one of"),
        (dict(features="dct"), r"features='dct' is not valid; choose one of \['summary', 'channel', 'page'\]"),
        (dict(key_space="pre"), "key_space='pre' is not valid; choose one of"),
        (dict(reference="none"), r"reference='none' is not valid; choose one of \['base', 'keys', 'zero'\]"),
        (dict(page_size=0), "page_size must be a positive integer"),
        (dict(recent_pages=-1), "recent_pages must be a non-negative integer"),
        (dict(thresholds=[0.9, 0.8]), "one more entry than pressure_levels"),
        (dict(thresholds=[0.7, 0.8, 0.9]), "must not increase"),
        (dict(memory_budget=0), "memory_budget must be a positive int"),
        (dict(memory_budget=0.5, pressure=0.3), "either memory_budget"),
        (dict(protect_importance=2), r"protect_importance must be in \[0, 1\]"),
        (dict(n_dct=-1), "n_dct must be a non-negative integer"),
        (dict(full_dtype="int8"), "full_dtype='int8' is not valid"),
        (dict(budget=0.5), r"unknown option\(s\) \['budget'\].*valid options"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        CPACCache(config=tiny_config(), **options)


def test_options_json_roundtrip():
    opts = CPACOptions(delta_bits=4, delta_scale=["channel", "token"], thresholds=[0.9, 0.8, 0.5], memory_budget=0.5)
    again = CPACOptions.from_json(opts.to_json())
    assert again == opts and json.loads(opts.to_json())["delta_scale"] == ["channel", "token"]
    assert again.scale_of("k") == "channel" and again.scale_of("v") == "token"
    assert CPACOptions(delta_scale=["page", "page"]).delta_scale == "page"
    assert "cpac" in hf_kvcache.cache_names()


# ---- real model ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_batch_left_padded_and_beams(smol, pydoc_text, moby_text):
    from hf_kvcache.eval import load_tokens

    model, tok = smol
    tok.padding_side = "left"
    prompts = [tok.decode(load_tokens(tok, pydoc_text, 0, 25)[0]), tok.decode(load_tokens(tok, moby_text, 5000, 48)[0])]
    batch = tok(prompts, return_tensors="pt", padding=True)
    config = {"page_size": 8, "recent_pages": 1}
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    before = model.config._attn_implementation
    out = model.generate(**batch, cache_implementation="cpac", cache_config=config, return_dict_in_generate=True, **kw)
    ref = model.generate(**batch, **kw)
    cache = out.past_key_values
    # generate switched the model to the hf_kvcache attention for the cache, and handed it back afterwards
    assert isinstance(cache, CPACCache) and model.config._attn_implementation == before
    stats = cache.memory_stats()
    assert stats["delta_pages"] > 0 and stats["bytes"] == sum(l.nbytes() for l in cache.layers)
    assert cache.layers[0]._mass_seen  # the importance came from the attention
    # 8-bit deltas: the greedy continuation of the padded batch stays that of an uncompressed cache
    width = batch.input_ids.shape[1]
    assert torch.equal(out.sequences[:, width : width + 4], ref[:, width : width + 4])
    beams = model.generate(**batch, cache_implementation="cpac", cache_config=config, num_beams=2, **kw)
    assert beams.shape[0] == 2 and beams.shape[1] <= width + 8
