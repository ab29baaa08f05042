"""Per-layer recipe calibration (rotation="auto"): choice by the attention error of the layer's own queries."""

import json

import pytest
import torch

import hf_kvcache
from hf_kvcache import TieredQuantCache
from hf_kvcache.caches.tiered import TieredQuantOptions
from hf_kvcache.calibrate import LayerRecipe, attention_error, choose_recipe
from hf_kvcache.calibrate.recipe import ARCHIVE_FORMAT_NAMES, QueryAttention, choose_archive_format
from hf_kvcache.caches.archive import ARCHIVE_FORMATS
from hf_kvcache.quant.kivi import KIVIQuantized
from hf_kvcache.quant.subspace import SubspaceRows
from hf_kvcache.eval import load_tokens


def test_attention_error_is_zero_for_exact_and_grows_with_noise():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g),
               torch.randn(1, 2, 40, 16, generator=g))
    assert attention_error(q, k, v, k, v, 0.25) == 0.0
    small = attention_error(q, k, v, k + 0.01 * torch.randn_like(k), v, 0.25)
    large = attention_error(q, k, v, k + 0.5 * torch.randn_like(k), v, 0.25)
    assert 0 < small < large


def test_choose_recipe_takes_the_smallest_attention_error():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 1, 32, 8, generator=g),
               torch.randn(1, 1, 32, 8, generator=g))
    noise = {"none": 0.3, "keys": 0.1, "values": 0.2, "both": 0.4}
    eps = torch.randn(k.shape, generator=g)  # the same noise pattern, scaled per candidate
    recipe = choose_recipe(QueryAttention(q, k, v, 0.3), lambda c, tier: (k + noise[c] * eps, v))
    assert recipe.rotation == "keys" and recipe.source == "queries"
    assert min(recipe.errors, key=recipe.errors.get) == "keys" and set(recipe.errors) == set(noise)
    # a rotation has to beat "none" by the margin
    close = {"none": 0.3, "keys": 0.29, "values": 0.35, "both": 0.4}
    assert choose_recipe(QueryAttention(q, k, v, 0.3), lambda c, tier: (k + close[c] * eps, v)).rotation == "none"


def test_recipe_json_and_errors():
    r = LayerRecipe("both", {"none": 0.2}, "queries")
    assert LayerRecipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert LayerRecipe.from_dict("keys").rotation == "keys"
    with pytest.raises(ValueError, match="choose one of"):
        LayerRecipe("diagonal")
    with pytest.raises(ValueError, match="unknown recipe field"):
        LayerRecipe.from_dict({"rotation": "none", "bits": 3})
    full = LayerRecipe("none", {}, "queries", archive_bits=3, clip_keys=True)
    assert LayerRecipe.from_dict(json.loads(json.dumps(full.to_dict()))) == full
    with pytest.raises(ValueError, match="clip_keys"):
        LayerRecipe("none", clip_keys="yes")
    with pytest.raises(ValueError, match="archive_bits"):
        LayerRecipe("none", archive_bits=9)
    with pytest.raises(ValueError, match="one entry per model layer"):
        TieredQuantCache(recipes="none")
    chosen = LayerRecipe("none", {"format-kivi": 0.2, "format-subspace": 0.1}, "queries", archive_format="subspace")
    assert LayerRecipe.from_dict(json.loads(json.dumps(chosen.to_dict()))) == chosen
    with pytest.raises(ValueError, match="archive_format"):
        LayerRecipe("none", archive_format="pca")
    assert ARCHIVE_FORMAT_NAMES == ARCHIVE_FORMATS  # the recipe checks names without importing the caches


def test_choose_archive_format_takes_a_candidate_only_by_the_margin():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 1, 32, 8, generator=g),
               torch.randn(1, 1, 32, 8, generator=g))
    eps = torch.randn(k.shape, generator=g)
    noise = {"kivi": 0.3, "subspace": 0.1, "kvquant": 0.2}
    name, errors = choose_archive_format(QueryAttention(q, k, v, 0.3), lambda n: (k + noise[n] * eps, v), "kivi",
                                         ("subspace", "kvquant"))
    assert name == "subspace" and set(errors) == {"format-kivi", "format-subspace", "format-kvquant"}
    assert errors["format-subspace"] < errors["format-kvquant"] < errors["format-kivi"]
    close = {"kivi": 0.3, "subspace": 0.29}  # a 3 % lead does not replace the options' format
    attention = QueryAttention(q, k, v, 0.3)
    assert choose_archive_format(attention, lambda n: (k + close[n] * eps, v), "kivi", ("subspace",))[0] == "kivi"


@pytest.mark.parametrize("options, match", [
    ({"archive_candidates": "subspace"}, "JSON list"),
    ({"archive_candidates": ["kivi", "pca"]}, "archive_candidates entry"),
    ({"archive_candidates": ["kivi", "subspace"], "rotation": "static"}, "rotation='auto'"),
    ({"archive_candidates": ["kivi", "subspace"], "archive_quantizer": "adaptive"}, "one format per layer"),
])
def test_archive_candidates_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        TieredQuantCache(**options)


@pytest.mark.slow
@torch.no_grad()
def test_calibration_chooses_each_layers_archive_format_by_its_queries(smol, moby_text):
    """`archive_candidates`: each layer round-trips its held positions through every format and keeps the one its
    queries read best (another format than `archive_quantizer` by the 10 % margin); the archive then holds codes of
    that format, fitted as usual, and a saved recipe list gives the same formats without calibrating."""
    model, tok = smol
    model.set_attn_implementation("sdpa")
    ids = load_tokens(tok, moby_text, 5000, 1024)
    # a fitted format competes after a fit on 2 positions per dimension, as before round 17 (the default 10 would
    # leave the subspace basis out on a 960-position prompt)
    cache = TieredQuantCache(config=model.config, archive_candidates=["kivi", "subspace"], candidate_fit_per_dim=2)
    model(ids[:, :960], past_key_values=cache)  # the queries reach a layer after its update: it calibrates on the next
    model(ids[:, 960:], past_key_values=cache)
    recipes = cache.recipes()
    for r, layer in zip(recipes, cache.layers):
        kivi, sub = r["errors"]["format-kivi"], r["errors"]["format-subspace"]
        assert r.get("archive_format") == ("subspace" if sub < 0.9 * kivi else None)
        archived = layer.tiers.archive
        assert isinstance(archived.keys, SubspaceRows if r.get("archive_format") else KIVIQuantized)
        assert set(layer.formats) <= {"warm", "kivi", "subspace"}
    chosen = sum("archive_format" in r for r in recipes)
    assert 0 < chosen < len(recipes)  # measured: 20 of 30 layers take the subspace archive on this prompt
    again = TieredQuantCache(config=model.config, recipes=json.loads(json.dumps(recipes)))
    model(ids[:, :960], past_key_values=again)
    assert [r.get("archive_format") for r in again.recipes()] == [r.get("archive_format") for r in recipes]
    assert [type(la.tiers.archive.keys) for la in again.layers] == [type(la.tiers.archive.keys) for la in cache.layers]


@pytest.mark.slow
@torch.no_grad()
def test_generate_calibrates_every_layer_from_its_queries(smol, moby_text):
    model, tok = smol
    model.set_attn_implementation("sdpa")
    ids = load_tokens(tok, moby_text, 5000, 400)  # the first prefill holds enough positions to round-trip
    out = model.generate(ids, cache_implementation="tiered", cache_config={"archive_error_target": 0.15},
                         max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    recipes = cache.recipes()
    assert len(recipes) == model.config.num_hidden_layers
    for r, layer in zip(recipes, cache.layers):
        rotations = {c: e for c, e in r["errors"].items() if not c.startswith(("archive-", "keys-"))}
        assert r["source"] == "queries" and set(rotations) == {"none", "keys", "values", "both"}
        best = min(rotations, key=rotations.get)
        taken = best if rotations[best] <= 0.9 * rotations["none"] else "none"  # the 10 % margin
        assert r["rotation"] == taken
        # clip_on="auto": key groups clipped where that lowers the attention error (same rotation)
        assert r["clip_keys"] == (r["errors"]["keys-clipped"] < 0.8 * r["errors"]["keys-unclipped"])  # 20 % margin
        assert layer.clips("keys") == r["clip_keys"] and layer.clips("values")
        # archive_error_target 0.15: the narrowest width from 2 bits within it (up to the warm tier's 4)
        widths = {int(c.split("-")[1]): e for c, e in r["errors"].items() if c.startswith("archive-")}
        width = r.get("archive_bits", 2)
        assert min(widths) == 2 and max(widths) == width and layer.specs["arch"].bits == width
        assert all(e > 0.15 for w, e in widths.items() if w < width) and (widths[width] <= 0.15 or width == 4)
    assert any("archive_bits" in r for r in recipes)  # measured: 17 of 30 layers widen on this prompt
    assert 0 < sum(r["clip_keys"] for r in recipes) < len(recipes)  # measured: 5 of 30 layers clip their keys
    assert not any(layer.calibrating for layer in cache.layers)
    # a saved calibration is reused as is: no calibration, same rotations
    again = TieredQuantCache(config=model.config, recipes=json.loads(json.dumps(recipes)))
    model(ids, past_key_values=again)
    assert [r["rotation"] for r in again.recipes()] == [r["rotation"] for r in recipes]
    assert [la.specs["arch"].bits for la in again.layers] == [la.specs["arch"].bits for la in cache.layers]
    assert [la.clips("keys") for la in again.layers] == [la.clips("keys") for la in cache.layers]
    assert all(r["source"] == "queries" for r in again.recipes())


@pytest.mark.slow
@torch.no_grad()
def test_without_queries_a_layer_takes_no_rotation(smol, moby_text):
    """Plain forwards with the eager attention report no queries (sdpa ones are served: `attention.plain`): after
    one update a layer stops waiting."""
    model, tok = smol
    model.set_attn_implementation("eager")
    try:
        ids = load_tokens(tok, moby_text, 5000, 300)
        cache = TieredQuantCache(config=model.config)
        model(ids[:, :280], past_key_values=cache)
        assert cache.layers[0].calibrating and cache.layers[0].tier_tokens()["warm"] == 0  # waiting one update
        model(ids[:, 280:], past_key_values=cache)
        assert all(r == {"rotation": "none", "errors": {}, "source": "no-queries"} for r in cache.recipes())
        assert cache.layers[0].tier_tokens()["warm"] > 0
    finally:
        model.set_attn_implementation("sdpa")


def calibrating_layer(smol, moby_text):
    """The first layer of a default tiered cache after a 600-token prompt through `attached`: still calibrating
    (its queries arrive after its update), every position in its tail."""
    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 600)
    cache = TieredQuantCache(config=model.config)
    with hf_kvcache.attached(model, cache):
        model(ids, past_key_values=cache)
    layer = cache.layers[0]
    assert layer.calibrating
    return layer


@torch.no_grad()
def test_a_calibrating_layer_holds_its_last_queries_not_the_forwards_whole_query_tensor(smol, moby_text):
    """The queries a layer keeps until it calibrates are a copy of the last `calibration_queries`: a view would keep
    the whole prefill's query tensor alive (and counted in its bytes) until the next update."""
    layer = calibrating_layer(smol, moby_text)
    queries = layer._calib_queries
    assert queries.shape[2] == layer.plan.calibration_queries == 64
    assert queries.untyped_storage().nbytes() == queries.numel() * queries.element_size()


@pytest.mark.slow
@torch.no_grad()
def test_a_fitted_archive_format_competes_only_with_enough_positions_to_fit(smol, moby_text):
    """A basis fitted on fewer than `candidate_fit_per_dim` positions per head dimension is not a candidate: the
    layer keeps `archive_quantizer` without round-tripping it."""
    model, tok = smol
    model.set_attn_implementation("sdpa")
    ids = load_tokens(tok, moby_text, 5000, 448)

    def recipes(per_dim: int) -> list[dict]:
        cache = TieredQuantCache(config=model.config, archive_candidates=["kivi", "subspace"],
                                 candidate_fit_per_dim=per_dim)
        model(ids[:, :384], past_key_values=cache)  # calibrates on 384 held positions: 2 of 5 archive groups fitted on
        model(ids[:, 384:], past_key_values=cache)
        return cache.recipes()

    short = recipes(3)  # 192 positions for SmolLM2's 64-dim heads: more than the 128 fitted on
    assert all(r["source"] == "queries" and not any(e.startswith("format-") for e in r["errors"]) for r in short)
    assert all("archive_format" not in r for r in short)
    assert all("format-subspace" in r["errors"] for r in recipes(2))  # 128: the two groups are enough (the default)


def test_candidate_fit_per_dim_is_checked():
    with pytest.raises(ValueError, match="candidate_fit_per_dim must be a positive integer"):
        TieredQuantOptions(candidate_fit_per_dim=0)


@pytest.mark.slow
@torch.no_grad()
def test_a_chunked_prefill_calibrates_on_calibration_positions(smol, moby_text, monkeypatch):
    """`calibration_positions`: a sequence whose first update is a chunk long enough to calibrate on keeps its
    positions in full precision until it holds that many (or a shorter update arrives), then calibrates on all of
    them; a stream of short chunks calibrates as without the option."""
    from hf_kvcache.caches.tiered.layer import TieredQuantLayer

    model, tok = smol
    model.set_attn_implementation("sdpa")
    ids = load_tokens(tok, moby_text, 5000, 1100)
    opts = dict(archive_candidates=["kivi", "subspace"], candidate_fit_per_dim=2)  # as measured before round 17
    seen = []  # positions each layer calibrated on
    calibrate = TieredQuantLayer._calibrate
    monkeypatch.setattr(TieredQuantLayer, "_calibrate", lambda la, k, v: (seen.append(k.shape[2]), calibrate(la, k, v)))

    def chunked(cache, sizes):
        seen.clear()
        pos = 0
        for n in sizes:
            model(ids[:, pos : pos + n], past_key_values=cache)
            pos += n
        return cache

    layers = model.config.num_hidden_layers
    cache = chunked(TieredQuantCache(config=model.config, calibration_positions=768, **opts), [384, 384])
    assert all(la.calibrating and la.tier_tokens()["warm"] == la.tiers.tokens("archive") == 0 for la in cache.layers)
    chunked(cache, [384])  # the update after 768 positions: every layer calibrates on them
    assert seen == [768] * layers and all(la.tiers.tokens("archive") > 0 for la in cache.layers)
    assert 0 < sum("archive_format" in r for r in cache.recipes()) < layers  # measured: 21 of 30 layers
    chunked(TieredQuantCache(config=model.config, calibration_positions=0, **opts), [384, 384])
    assert seen == [384] * layers  # without it: on the first chunk
    # a shorter update (the prompt's last chunk, a decoding step) ends the wait: the same choices from the same forwards
    ended = chunked(TieredQuantCache(config=model.config, calibration_positions=2048, **opts), [384, 384, 100])
    assert seen == [768] * layers and ended.recipes() == cache.recipes()
    # short chunks: the same stored tensors as without the option
    streams = [chunked(TieredQuantCache(config=model.config, calibration_positions=n, **opts), [32] * 20)
               for n in (0, 768)]
    for a, b in zip(*(s.layers for s in streams)):
        assert all(torch.equal(x, y) for x, y in zip(a.stored_tensors(), b.stored_tensors()))


@torch.no_grad()
def test_calibration_round_trips_are_shared_between_candidates_with_the_same_bits(smol, moby_text):
    """A calibration codes keys and values apart and gives a half again where only the other half's rotation (or
    clipping) changed; what it gives is what the tier's own quantize / dequantize gives, bit for bit, and so are the
    attention errors `QueryAttention` keeps."""
    from hf_kvcache.calibrate.recipe import relative_error

    layer = calibrating_layer(smol, moby_text)
    keys, values = layer.tiers.tail.keys, layer.tiers.tail.values
    roundtrip = layer._kivi_roundtrips(keys, values)
    attention = QueryAttention(layer._calib_queries, keys, values, layer._calib_scaling)
    tiers = layer._kivi_tiers()
    assert tiers == ("warm", "arch")
    for rotation in ("none", "keys", "values", "both"):
        for tier in tiers:
            k, v = roundtrip(rotation, tier)
            direct = layer._held_roundtrip(keys, values, lambda a, b: layer._dequantize(layer._quantize(a, b, tier), 0))
            assert torch.equal(k, direct[0]) and torch.equal(v, direct[1])
            fresh = QueryAttention(layer._calib_queries, keys, values, layer._calib_scaling)
            exact = fresh.output(keys, values)
            assert attention.error(k, v) == fresh.error(k, v) == relative_error(exact, fresh.output(k, v))
    for tier in tiers:
        assert roundtrip("none", tier)[0] is roundtrip("values", tier)[0]
        assert roundtrip("keys", tier)[0] is roundtrip("both", tier)[0]
        assert roundtrip("none", tier)[1] is roundtrip("keys", tier)[1]
        assert roundtrip("none", tier)[0] is not roundtrip("keys", tier)[0]
