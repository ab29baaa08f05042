import json

import pytest
import torch
import hf_kvcache.caches.archive as archive_mod
from hf_kvcache import KIVICache, TieredQuantCache, build_cache, memory_stats
from hf_kvcache.caches.tiered import KIVIOptions, TieredQuantLayer, TieredQuantOptions
from models import cache_config as tiny_config
from random_kv import stream_random

B, H, D, LAYERS = 2, 3, 64, 2
# small tiers; one group size everywhere, no sinks, an exact (model dtype) tail: easy to count
SMALL = dict(tail_length=8, warm_length=32, group_size=16, archive_group_size=16, sink_length=0, tail_dtype=None,
             rotation="none", clip_search=False)


def feed(cache, chunks, seed=0):
    return stream_random(cache, chunks, B, H, D, LAYERS, seed)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def raw_counts(layer):
    return {t: layer.tiers.tokens(t) for t in ("archive", "warm", "tail")}


def test_tokens_flow_through_the_tiers_in_whole_groups():
    cache = TieredQuantCache(config=tiny_config(), **{**SMALL, "sink_length": 2})
    torch.manual_seed(0)
    for n in range(1, 121):
        k = torch.randn(B, H, 1, D)
        for layer in range(LAYERS):
            cache.update(k, k, layer)
        raw, served = raw_counts(cache.layers[0]), cache.layers[0].tier_tokens()
        assert sum(raw.values()) == sum(served.values()) == n == cache.get_seq_length()
        assert served["sink"] == min(n, 2)
        assert raw["warm"] % 16 == 0 and raw["archive"] % 16 == 0
        if n >= 8 + 16:
            assert 8 <= raw["tail"] < 8 + 16
        if raw["archive"]:
            assert 32 <= raw["warm"] < 32 + 16  # the archive only grows once the warm tier is full
    assert raw == {"archive": 80, "warm": 32, "tail": 8}
    assert served == {"sink": 2, "archive": 78, "warm": 32, "tail": 8}


def test_archive_groups_can_be_larger():
    cache = TieredQuantCache(config=tiny_config(), **{**SMALL, "archive_group_size": 64})
    feed(cache, [1] * 200)
    raw = raw_counts(cache.layers[0])
    assert raw == {"archive": 128, "warm": 64, "tail": 8}  # warm stays >= 32, archive moves in 64s
    layer = cache.layers[0]
    assert layer.tiers.archive.keys.scale.shape[2] == 128 // 64 and layer.tiers.warm.keys.scale.shape[2] == 64 // 16
    assert layer.tiers.archive.values.scale.shape[3] == 1 and layer.tiers.warm.values.scale.shape[3] == 4  # value groups: 64 / 16 channels


def test_big_chunks_graduate_at_once():
    cache = TieredQuantCache(config=tiny_config(), **SMALL)
    feed(cache, [100])
    assert cache.layers[1].tier_tokens() == {"sink": 0, "archive": 48, "warm": 32, "tail": 20}


def test_tail_and_sinks_are_exact_and_older_tiers_close():
    cache = TieredQuantCache(config=tiny_config(), **{**SMALL, "sink_length": 4})
    k, v = feed(cache, [50, 1, 1, 30, 7, 3])
    t = cache.layers[0].tier_tokens()
    km, vm = cache.layers[0].materialize()
    assert km.shape == k.shape and vm.dtype == torch.float32
    assert torch.equal(km[:, :, :4], k[:, :, :4]) and torch.equal(vm[:, :, -t["tail"]:], v[:, :, -t["tail"]:])
    a, w = slice(4, 4 + t["archive"]), slice(4 + t["archive"], 4 + t["archive"] + t["warm"])
    assert rel(km[:, :, w], k[:, :, w]) < 0.15  # 4-bit
    assert 0.15 < rel(km[:, :, a], k[:, :, a]) < 0.45 and rel(vm[:, :, a], v[:, :, a]) < 0.45  # 2-bit


def test_update_returns_new_tokens_unquantized():
    cache = TieredQuantCache(config=tiny_config(), **SMALL)
    feed(cache, [70])
    k_new, v_new = torch.randn(B, H, 3, D), torch.randn(B, H, 3, D)
    keys, values = cache.update(k_new, v_new, 0)
    assert keys.shape[2] == 73 and torch.equal(keys[:, :, -3:], k_new) and torch.equal(values[:, :, -3:], v_new)
    assert torch.equal(keys[:, :, :70], cache.layers[1].materialize()[0])


def test_codes_are_packed_and_bytes_are_the_tensors_held():
    cache = TieredQuantCache(config=tiny_config(), **{**SMALL, "sink_length": 4})
    feed(cache, [200])
    layer = cache.layers[0]
    assert layer.tiers.archive.keys.codes.shape[-1] == D // 4 and layer.tiers.warm.keys.codes.shape[-1] == D // 2
    assert layer.tiers.archive.keys.scale.dtype == torch.float16 and layer.tiers.archive.keys.scale.shape[2] == layer.tiers.archive.keys.codes.shape[2] // 16
    stats = cache.memory_stats()
    held = sum(t.nbytes for lay in cache.layers for t in lay.tiers.tensors())
    assert stats["bytes"] == held == memory_stats(cache)["bytes"]
    assert stats["fp16_bytes"] == 2 * LAYERS * B * H * 200 * 2 * D
    assert stats["ratio"] == pytest.approx(stats["fp16_bytes"] / held)
    tiers = stats["tiers"]
    assert sum(t["bytes"] for t in tiers.values()) == held
    assert {n: t["tokens"] for n, t in tiers.items()} == layer.tier_tokens()
    # 2-bit codes + fp16 scale/zero per group of 16: 2 + 32/16 = 4 bits per element
    assert tiers["sink"]["tokens"] == 4 and tiers["archive"]["tokens"] == raw_counts(layer)["archive"] - 4
    assert tiers["archive"]["bytes"] == LAYERS * B * H * raw_counts(layer)["archive"] * 2 * D * 4 // 8


def test_ratio_grows_with_the_archive():
    cache = TieredQuantCache(config=tiny_config(), tail_length=16, warm_length=32, group_size=32, archive_group_size=32)
    feed(cache, [64])
    early = cache.memory_stats()["ratio"]
    feed(cache, [1024])
    late = cache.memory_stats()["ratio"]
    assert late > early and late > 4.0  # 2-bit codes + fp16 scale/zero per 32 = 3 bits per element in the archive


def test_append_only_quantizes_the_groups_that_move(monkeypatch):
    """O(new tokens): every quantize call sees one group of new tokens, never the stored tiers."""
    calls = []
    real = archive_mod.quantize_kivi

    def spy(x, **kw):
        calls.append((x.shape[2], kw["bits"]))
        return real(x, **kw)

    monkeypatch.setattr(archive_mod, "quantize_kivi", spy)  # the KIVI format quantizes
    cache = TieredQuantCache(config=tiny_config(), **SMALL)
    feed(cache, [1] * 300)
    assert calls and all(n == 16 for n, _ in calls)
    warm = sum(n for n, bits in calls if bits == 4) // (2 * LAYERS)  # keys and values, every layer
    archive = sum(n for n, bits in calls if bits == 2) // (2 * LAYERS)
    t = cache.layers[0].tier_tokens()
    assert warm == t["warm"] + t["archive"] and archive == t["archive"]  # each token quantized once per tier


@pytest.mark.parametrize("extra", [{}, {"rotation": "both", "rotation_dtype": "bfloat16"}])
def test_crop_into_quantized_tiers_reopens_groups(extra):
    cache = TieredQuantCache(config=tiny_config(), **{**SMALL, **extra})
    feed(cache, [100])  # archive 48 | warm 32 | tail 20
    before = cache.layers[0].materialize()[0]
    cache.crop(-30)  # whole tail + 10 warm tokens: the newest warm group is reopened, 6 of its tokens survive
    t = cache.layers[0].tier_tokens()
    assert t == {"sink": 0, "archive": 48, "warm": 16, "tail": 6} and cache.get_seq_length() == 70
    assert torch.allclose(cache.layers[0].materialize()[0], before[:, :, :70], atol=1e-5)
    cache.crop(-40)  # the rest of warm and 18 archive tokens
    assert cache.layers[0].tier_tokens() == {"sink": 0, "archive": 16, "warm": 0, "tail": 14}
    assert torch.allclose(cache.layers[0].materialize()[0], before[:, :, :30], atol=1e-5)
    feed(cache, [40])  # and it grows again
    assert cache.get_seq_length() == 70 and cache.layers[0].tokens_held() == 70


def test_crop_too_far_or_positive_raises():
    cache = TieredQuantCache(config=tiny_config(), **SMALL)
    feed(cache, [40])
    with pytest.raises(ValueError, match="cannot crop 50 tokens"):
        cache.crop(-50)
    with pytest.raises(ValueError, match="negative count"):
        cache.layers[0].crop(3)


def test_kivi_cache_has_two_tiers():
    cache = KIVICache(config=tiny_config(), residual_length=32, group_size=16)
    feed(cache, [100])
    assert cache.layers[0].tier_tokens() == {"sink": 0, "archive": 64, "warm": 0, "tail": 36}
    assert cache.layers[0].tiers.archive.keys.scale.shape[2] == 64 // 16  # KIVI: one group size, 16 tokens per key group
    assert cache.layers[0].tiers.archive.values.scale.shape[3] == D // 16 and cache.layers[0].tiers.tail.keys.dtype == torch.float16  # 16-bit window, as the tiered tail
    assert cache.layers[0].tiers.archive.keys.codes.shape[-1] == D // 4
    assert isinstance(build_cache("kivi", tiny_config()), KIVICache)
    assert isinstance(build_cache("tiered", tiny_config()), TieredQuantCache)


@pytest.mark.parametrize(
    "options,bound",
    [  # about 1.3x the larger measured relative error of keys / values (in the comments)
        (dict(rotation="both"), 0.35),  # 0.265 / 0.263
        (dict(rotation="values", clip_search=True), 0.34),  # 0.262 / 0.226
        (dict(key_axis="token"), 0.35),  # 0.263 / 0.265
        (dict(clip_ratio=0.9, value_group_size=64), 0.40),  # 0.262 / 0.309
        (dict(warm_bits=3, archive_bits=3), 0.17),  # 0.129 / 0.130
        (dict(warm_length=0, tail_length=0), 0.42),  # 0.320 / 0.323
    ],
)
def test_recipes_reconstruct(options, bound):
    cache = TieredQuantCache(config=tiny_config(), **{**SMALL, **options})
    k, v = feed(cache, [150])
    km, vm = cache.layers[0].materialize()
    assert rel(km, k) < bound and rel(vm, v) < bound, (rel(km, k), rel(vm, v))


def test_low_precision_tail():
    cache = TieredQuantCache(config=tiny_config(), **{**SMALL, "tail_dtype": "auto"})
    k, _ = feed(cache, [60])
    assert cache.layers[0].tiers.tail.keys.dtype == torch.float16  # "auto": 16 bits for an fp32 model
    assert cache.layers[0].materialize()[0].dtype == torch.float32


def test_sliding_layers_are_tiered_and_drop_what_the_window_left():
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    cache = TieredQuantCache(config=config, **SMALL)
    feed(cache, [100])
    sliding, full = cache.layers
    assert isinstance(sliding, TieredQuantLayer) and sliding.is_sliding and not full.is_sliding
    assert sliding.dropped > 0 and sliding.dropped + sliding.tokens_held() == 100 == full.tokens_held()
    assert sliding.tier_tokens()["sink"] == 0  # the first positions leave the window: no sinks kept
    stats = cache.memory_stats()
    assert stats["bytes"] >= sum(t["bytes"] for t in stats["tiers"].values()) > 0


def test_without_config_layers_are_created_lazily():
    cache = TieredQuantCache(**SMALL)
    feed(cache, [40])
    assert len(cache.layers) == LAYERS and cache.get_seq_length() == 40


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(archive_quantizer="hqq"), r"archive_quantizer='hqq' is not valid; choose one of \['kivi', 'kvquant', 'subspace', 'adaptive'\]"),
        (dict(key_axis="head"), r"key_axis='head' is not valid; choose one of \['channel', 'token'\]"),
        (dict(rotation="queries"), r"rotation='queries' is not valid; choose one of \['auto', 'static', 'none', 'keys', 'values', 'both'\]"),
        (dict(tail_dtype="int8"), r"tail_dtype='int8' is not valid; choose one of \['auto', None, 'float32'"),
        (dict(warm_bits=9), "warm_bits must be an integer in 1..8"),
        (dict(group_size=0), "group_size must be a positive integer"),
        (dict(warm_length=100), "warm_length=100 must be a multiple of group_size=32"),
        (dict(tail_length=-1), "tail_length must be a non-negative integer"),
        (dict(clip_ratio=0), r"clip_ratio must be a number in \(0, 1\]"),
        (dict(warm=4), r"unknown option\(s\) \['warm'\].*valid options"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        TieredQuantCache(config=tiny_config(), **options)


def test_group_and_rotation_must_fit_head_dim():
    cache = TieredQuantCache(config=tiny_config(), value_group_size=48)
    with pytest.raises(ValueError, match="value_group_size=48 must divide the value head_dim=64"):
        feed(cache, [4])
    cache = TieredQuantCache(rotation="keys", value_group_size=16)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        cache.update(torch.randn(1, 1, 2, 48), torch.randn(1, 1, 2, 48), 0)


def test_options_json_roundtrip():
    opts = TieredQuantOptions(tail_length=32, warm_length=64, sink_length=4, rotation="values", clip_search=True)
    again = TieredQuantOptions.from_json(opts.to_json())
    assert again == opts and json.loads(opts.to_json())["rotation"] == "values"
    k = KIVIOptions(residual_length=64, bits=4)
    assert KIVIOptions.from_json(k.to_json()) == k and k.as_tiered().warm_length == 0
    with pytest.raises(ValueError, match="bits must be an integer"):
        KIVIOptions(bits=0)


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_peer_quantized_cache_bytes_are_counted(backend):
    """transformers' QuantizedCache with each backend (optimum-quanto and hqq are in the `test` extra, so this runs in
    CI: a missing backend fails instead of skipping)."""
    from transformers import QuantizedCache

    cache = QuantizedCache(backend=backend, config=tiny_config(), nbits=2, q_group_size=32, residual_length=16)
    feed(cache, [40, 1, 1])
    stats = memory_stats(cache)
    layer = cache.layers[0]
    q = layer._quantized_keys
    codes = q[0] if backend == "hqq" else q._data._data
    assert codes.dtype == torch.uint8
    assert stats["fp16_bytes"] == 2 * LAYERS * B * H * 42 * 2 * D
    # packed 2-bit codes: a quarter of a byte per element, plus fp32 scale/zero and the fp32 residual tokens
    floor = LAYERS * (2 * B * H * 40 * D // 4 + 2 * layer.keys.nbytes)
    assert floor < stats["bytes"] < stats["fp16_bytes"]


def test_sinks_are_exact_and_do_not_stretch_their_group():
    torch.manual_seed(8)
    k = torch.randn(1, H, 100, D)
    k[:, :, :2] *= 100  # attention-sink-like outliers at the first positions
    errs = {}
    for sinks in (0, 2):
        cache = TieredQuantCache(config=tiny_config(), **{**SMALL, "sink_length": sinks})
        for layer in range(LAYERS):
            cache.update(k, k, layer)
        km, _ = cache.layers[0].materialize()
        assert raw_counts(cache.layers[0])["archive"] == 48  # sinks do not shift the group boundaries
        errs[sinks] = rel(km[:, :, 2:16], k[:, :, 2:16])  # the rest of the first group
        if sinks:
            assert torch.equal(km[:, :, :2], k[:, :, :2])
    assert errs[2] < 0.5 * errs[0], errs


def test_sinks_follow_a_crop_below_them():
    cache = TieredQuantCache(config=tiny_config(), **{**SMALL, "sink_length": 4})
    k, _ = feed(cache, [3])
    cache.crop(-2)
    assert cache.layers[0].tier_tokens() == {"sink": 1, "archive": 0, "warm": 0, "tail": 0}
    k2, _ = feed(cache, [40], seed=1)
    km, _ = cache.layers[0].materialize()
    assert torch.equal(km[:, :, :1], k[:, :, :1]) and torch.equal(km[:, :, 1:4], k2[:, :, :3])
    assert cache.layers[0].tier_tokens()["sink"] == 4


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_rotation_held_as_signs_and_small_factors(dim):
    """A rotated layer holds no dim x dim matrix: each rotation is its dim int8 signs plus float32 Sylvester factors
    (8 x 8 for 64; 16 x 16 and 8 x 8 for 128; 16 x 16 for 256), the factors shared by keys and values; and it
    reads back what the dense matrix gives."""
    from hf_kvcache.caches.accounting import held_bytes
    from hf_kvcache.quant.rotation import HadamardRotation, rotation_matrix

    layer = TieredQuantLayer(TieredQuantOptions(rotation="both", rotation_dtype=None, tail_length=16, warm_length=0,
                                                warm_fraction=0.0, sink_length=0))
    k, v = torch.randn(1, 1, 200, dim), torch.randn(1, 1, 200, dim)
    layer.update(k, v)
    assert isinstance(layer.rot_k, HadamardRotation) and layer.rot_k is not layer.rot_v
    torch.testing.assert_close(layer.rot_k.matrix(), rotation_matrix(dim, 0), atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.rot_v.matrix(), rotation_matrix(dim, 1), atol=1e-6, rtol=0)
    factors = {64: 8 * 8, 128: 16 * 16 + 8 * 8, 256: 16 * 16}[dim] * 4
    assert held_bytes([*layer.rot_k.tensors(), *layer.rot_v.tensors()]) == 2 * dim + factors
    # the quantized tiers un-rotated by the transform equal their codes un-rotated by the dense matrix
    km, vm = layer.materialize()
    codes = layer.tiers.archive
    ka, va = layer.formats["warm"].decode(codes, 0, rotated=True)
    n = codes.tokens
    torch.testing.assert_close(km[:, :, :n], ka @ rotation_matrix(dim, 0).t(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vm[:, :, :n], va @ rotation_matrix(dim, 1).t(), atol=1e-5, rtol=1e-5)


def test_prefill_warm_positions_keep_a_chunked_prompt_warm_until_it_ends():
    """`prefill_warm_positions`: while equal chunks keep coming (a chunked prefill), at least that many positions
    past the tail stay at warm_bits; a shorter update ends the prompt and the excess goes to the archive at once, to
    the same stored tensors as without the option. One forward and short-chunk streams are unchanged."""
    small = dict(SMALL, warm_fraction=0.22, target_ratio=None)  # the warm tier sized by the positions seen
    held = TieredQuantCache(config=tiny_config(), **small, prefill_warm_positions=256)
    plain = TieredQuantCache(config=tiny_config(), **small)
    for cache in (held, plain):
        feed(cache, [80] * 4)  # the first chunk (80 >= tail 8 + 4 archive groups) opens a chunked prefill
    assert raw_counts(held.layers[0]) == {"archive": 48, "warm": 256, "tail": 16}
    assert raw_counts(plain.layers[0])["warm"] == 64
    feed(held, [80], seed=1)  # a stream of equal chunks keeps its newest 256 positions warm
    assert raw_counts(held.layers[0])["warm"] == 256
    for cache in (held, plain):
        cache.reset()
        feed(cache, [80] * 4 + [1])  # the decoding step ends the prompt
    assert raw_counts(held.layers[0]) == raw_counts(plain.layers[0]) == {"archive": 240, "warm": 64, "tail": 17}
    # the archive is coded from the warm codes either way: the same stored tensors once the prompt ended
    for a, b in zip(held.layers, plain.layers):
        assert all(torch.equal(x, y) for x, y in zip(a.stored_tensors(), b.stored_tensors()))
    for chunks in ([320, 1], [16] * 20):  # one forward, then a decoding step; a stream of short chunks
        caches = [TieredQuantCache(config=tiny_config(), **SMALL, prefill_warm_positions=n) for n in (0, 256)]
        for cache in caches:
            feed(cache, chunks)
        for a, b in zip(*(c.layers for c in caches)):
            assert all(torch.equal(x, y) for x, y in zip(a.stored_tensors(), b.stored_tensors()))
    with pytest.raises(ValueError, match="warm_length > 0"):
        TieredQuantCache(config=tiny_config(), **{**SMALL, "warm_length": 0}, prefill_warm_positions=256)
