"""hf_kvcache.codec: lossless round trips are bit-exact for every cache kind it supports, lossy round trips stay within
their measured error bound for every cache type, bad blobs raise ValueError naming what is wrong, and SmolLM2 decodes
the same greedy tokens after a lossless round trip of a tiered cache."""

from __future__ import annotations

import copy
import struct

import pytest
import torch
from transformers import DynamicCache

import hf_kvcache  # noqa: F401  (registers the attention implementation)
from hf_kvcache import codec
from hf_kvcache.caches import CPACCache, H2OCache, KIVICache, TieredQuantCache, UniformQuantCache
from hf_kvcache.codec.container import MAGIC
from hf_kvcache.paged import PagedCache
from hf_kvcache.codec.layers import set_dynamic_layer
from models import codec_llama

TOKENS = 300


@pytest.fixture(scope="module")
def tiny():
    model = codec_llama(layers=3, max_positions=1024)
    cfg = model.config
    ids = torch.randint(0, 128, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    return model, cfg, ids


def _fill(model, cache, ids, attn="sdpa", chunk=100):
    model.set_attn_implementation(attn)
    with torch.inference_mode():
        for s in range(0, ids.shape[1], chunk):
            model(ids[:, s : s + chunk], past_key_values=cache, use_cache=True)
    return cache


def _kv(layer):
    return layer.materialize() if hasattr(layer, "materialize") else (layer.keys, layer.values)


LOSSLESS = {
    "dynamic": lambda cfg: DynamicCache(config=cfg),
    "int8": lambda cfg: UniformQuantCache(config=cfg, dtype="int8"),
    "int4": lambda cfg: UniformQuantCache(config=cfg, dtype="int4"),
    "fp8": lambda cfg: UniformQuantCache(config=cfg, dtype="fp8"),
    "tiered": lambda cfg: TieredQuantCache(config=cfg, tail_length=16, warm_length=64),
    "tiered-kvquant": lambda cfg: TieredQuantCache(config=cfg, tail_length=16, warm_length=64, archive_quantizer="kvquant",
                                                   archive_bits=3),
    # filled through the "hf_kvcache" attention: the fused path, and per-layer calibration where the layer has one
    "tiered-fused": lambda cfg: TieredQuantCache(config=cfg, tail_length=16, warm_length=64),
    "kivi": lambda cfg: KIVICache(config=cfg, residual_length=32),
}
FUSED = ("tiered-fused", "cpac", "h2o-no-eviction")


@pytest.mark.parametrize("name", sorted(LOSSLESS))
def test_lossless_round_trip_is_bit_exact(tiny, name):
    model, cfg, ids = tiny
    cache = _fill(model, LOSSLESS[name](cfg), ids, attn="hf_kvcache" if name in FUSED else "sdpa")
    model.set_attn_implementation("sdpa")
    blob = codec.encode(cache, config=cfg, mode="lossless")
    back = codec.decode(blob, config=cfg)
    assert type(back) is type(cache) and back.get_seq_length() == TOKENS
    for a, b in zip(cache.layers, back.layers):
        if hasattr(a, "state_tensors"):
            sa, sb = a.state_tensors(), b.state_tensors()
            assert sa.keys() == sb.keys()
            for k in sa:
                assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
            assert a.cumulative_length == b.cumulative_length
            recipe = getattr(a, "recipe", None)
            if recipe is not None:
                assert b.recipe.to_dict() == recipe.to_dict()
        ka, va = _kv(a)
        kb, vb = _kv(b)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # the rebuilt cache continues: one more forward gives the logits the original gives
    nxt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        la = model(nxt, past_key_values=copy.deepcopy(cache)).logits
        lb = model(nxt, past_key_values=back).logits
    assert torch.equal(la, lb)


def test_lossless_codes_shrink_below_the_cache_bytes(tiny):
    model, cfg, ids = tiny
    cache = _fill(model, UniformQuantCache(config=cfg, dtype="int4"), ids)
    blob = codec.encode(cache, config=cfg, mode="lossless")
    assert len(blob) < cache.memory_stats()["bytes"]


LOSSY = {
    **LOSSLESS,
    "cpac": lambda cfg: CPACCache(config=cfg),
    "h2o-no-eviction": lambda cfg: H2OCache(config=cfg, budget=1.0),
    "paged_quant": lambda cfg: PagedCache(config=cfg, page_size=64),
}


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_lossy_round_trip_error_is_bounded(tiny, name):
    model, cfg, ids = tiny
    attn = "hf_kvcache" if name in FUSED else "sdpa"
    cache = _fill(model, LOSSY[name](cfg), ids, attn=attn)
    blob = codec.encode(cache, config=cfg, bins=32, chunk_size=16, step_from="values")
    back = codec.decode(blob, config=cfg)
    assert isinstance(back, DynamicCache) and back.get_seq_length() == TOKENS
    for i, (a, b) in enumerate(zip(cache.layers, back.layers)):
        for x, y in zip(_kv(a), _kv(b)):
            assert x.shape == y.shape
            x, y = x.float(), y.float()
            # bound: a delta-coded element is within step / 2 (deltas are taken to the dequantized anchor, so the
            # anchor's error does not carry over), an anchor within half an int8 step of its absmax / 127;
            # step = 4 * std(channel) / bins
            std = x.permute(1, 3, 0, 2).reshape(x.shape[1] * x.shape[3], -1).std(dim=1, correction=0)
            step = (4 * std / 32).view(1, x.shape[1], 1, x.shape[3])
            anchor_err = x[:, :, ::16].abs().amax(-1, keepdim=True) / 127 / 2
            bound = step / 2 * 1.01 + anchor_err.repeat_interleave(16, dim=2)[:, :, : x.shape[2]] + 1e-3 * step
            assert ((x - y).abs() <= bound).all(), (name, i)
            rel = ((x - y).norm() / x.norm()).item()
            # uniform quantization error is step / sqrt(12) = std / (8 sqrt(12)) = 0.036 std at bins=32: at most
            # that relative to the norm (less where channels have a mean); measured 0.005-0.035 here
            assert rel < 0.037, (name, i, rel)


def test_lossy_head_step_bounds_every_channel_alike(tiny):
    """step_from="head": one step per KV head (4 * RMS of its channels' spreads / bins), so every delta-coded element
    of a head is within half of that step, whatever its channel's own spread."""
    model, cfg, ids = tiny
    cache = _fill(model, DynamicCache(config=cfg), ids)
    back = codec.decode(codec.encode(cache, config=cfg, bins=8, chunk_size=16, step_from="head"), config=cfg)
    for a, b in zip(cache.layers, back.layers):
        for x, y in zip(_kv(a), _kv(b)):
            x, y = x.float(), y.float()
            std = x.permute(1, 3, 0, 2).reshape(x.shape[1], x.shape[3], -1).std(dim=-1, correction=0)
            step = (4 * std.square().mean(-1).sqrt() / 8).view(1, x.shape[1], 1, 1)
            err = (x - y).abs()
            err[:, :, ::16] = 0  # anchors: int8 codes, bounded by the test above
            assert (err <= step / 2 * 1.01).all()
            assert (err.amax(dim=(0, 2)) > step.view(-1, 1) / 4).any()  # the bound is reached, not loose


@pytest.mark.parametrize("bits,gain", [(8, None), (4, 0.70), (2, 0.57)])
def test_lossless_models_per_channel_round_trip(bits, gain):
    """The per-(head, channel) entropy models (`ansNc`) give back every byte, for packed codes and fp16 high bytes,
    and pay off where channels differ: codes that are constant in half of the channels (8-bit symbols: 256-entry
    tables per channel cost what they save at this size)."""
    from hf_kvcache.codec import lossless

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (2, 3, 400, 16), dtype=torch.uint8, generator=g)
    codes[..., ::2] = 7
    u8 = codes.numpy()
    per_channel = lossless._ans_bytes(u8, bits, by_channel=True)
    assert (lossless._ans_unbytes(per_channel, tuple(codes.shape), bits, by_channel=True) == u8).all()
    if gain is not None:  # measured 0.67 (4-bit symbols) and 0.54 (2-bit) of the per-head size
        assert len(per_channel) < gain * len(lossless._ans_bytes(u8, bits))
    for joint in range(2, 8 // bits + 1) if bits < 8 else ():  # consecutive tokens coded as one symbol
        odd = codes[:, :, :37]  # a token count that leaves the last joint symbol part-filled
        body = lossless._ans_bytes(odd.numpy(), bits, joint=joint)
        assert (lossless._ans_unbytes(body, tuple(odd.shape), bits, joint=joint) == odd.numpy()).all()
    slow = codes.clone()
    slow[:, :, 1::2] = slow[:, :, 0::2]  # every code repeated on the next token
    pairs = lossless._ans_bytes(slow.numpy(), 4, joint=2)
    if bits == 4:  # measured 0.50 of the per-token size: the repeat costs nothing
        assert len(pairs) < 0.53 * len(lossless._ans_bytes(slow.numpy(), 4))
    scales = torch.randn(2, 3, 5, 64, generator=g).half()
    body, meta = lossless.encode_tensor(scales)
    assert torch.equal(lossless.decode_tensor(body, meta).view(torch.int16), scales.view(torch.int16))


def test_lossy_more_bins_less_error_more_bytes(tiny):
    model, cfg, ids = tiny
    cache = _fill(model, DynamicCache(config=cfg), ids)
    k0 = cache.layers[1].keys
    sizes, errs = [], []
    for bins in (8, 32, 128):
        blob = codec.encode(cache, config=cfg, bins=bins)
        k1 = codec.decode(blob, config=cfg).layers[1].keys
        sizes.append(len(blob))
        errs.append((k1 - k0).abs().max().item())
    assert sizes[0] < sizes[1] < sizes[2]
    assert errs[0] > errs[1] > errs[2]


def test_lossy_outliers_are_escaped_not_clipped(tiny):
    _, cfg, _ = tiny
    g = torch.Generator().manual_seed(3)
    cache = DynamicCache(config=cfg)
    for layer in cache.layers:
        k, v = torch.randn(1, 2, 1024, 32, generator=g), torch.randn(1, 2, 1024, 32, generator=g)
        k[0, 1, 5, 7] = 500.0  # a delta-coded position; its channel std becomes ~16, the delta ~64 steps
        set_dynamic_layer(layer, k, v)
    header = codec.inspect(blob := codec.encode(cache, config=cfg, bins=8))
    assert header["layers"][0]["k"]["escapes"] >= 1
    back = codec.decode(blob, config=cfg)
    for a, b in zip(cache.layers, back.layers):
        std = a.keys.permute(1, 3, 0, 2).reshape(64, -1).std(dim=1, correction=0).view(1, 2, 1, 32)
        assert ((a.keys - b.keys).abs() <= 4 * std / 8 / 2 * 1.01 + 1e-6).all()


def test_lossy_bins_follow_depth(tiny):
    model, cfg, ids = tiny
    cache = _fill(model, DynamicCache(config=cfg), ids)
    header = codec.inspect(codec.encode(cache, config=cfg, bins=(48, 24, 12)))
    assert [layer["bins"] for layer in header["layers"]] == [48, 24, 12]
    assert header["tokens"] == TOKENS and header["fingerprint"]["layers"] == 3


def test_evicting_cache_is_refused(tiny):
    model, cfg, ids = tiny
    cache = _fill(model, H2OCache(config=cfg, budget=0.5), ids, attn="hf_kvcache", chunk=50)
    with pytest.raises(ValueError, match="evicted"):
        codec.encode(cache, config=cfg)
    with pytest.raises(ValueError, match="lossless mode supports"):
        codec.encode(cache, config=cfg, mode="lossless")


def test_bad_arguments(tiny):
    model, cfg, ids = tiny
    cache = _fill(model, DynamicCache(config=cfg), ids[:, :40])
    with pytest.raises(ValueError, match="mode"):
        codec.encode(cache, config=cfg, mode="zip")
    with pytest.raises(ValueError, match="config"):
        codec.encode(cache, config=None)
    with pytest.raises(ValueError, match="bins"):
        codec.encode(cache, config=cfg, bins=1)
    with pytest.raises(ValueError, match="empty"):
        codec.encode(DynamicCache(config=cfg), config=cfg)
    with pytest.raises(ValueError, match="no options"):
        codec.encode(cache, config=cfg, mode="lossless", bins=8)


@pytest.fixture(scope="module")
def blob(tiny):
    model, cfg, ids = tiny
    cache = _fill(model, TieredQuantCache(config=cfg, tail_length=16, warm_length=64), ids[:, :120])
    return codec.encode(cache, config=cfg, mode="lossless")


def test_corrupt_blobs_raise_saying_which(tiny, blob):
    _, cfg, _ = tiny
    codec.decode(blob, config=cfg)  # the good one decodes
    with pytest.raises(ValueError, match="bad magic"):
        codec.decode(b"GARBAGE!!" + blob[9:], config=cfg)
    with pytest.raises(ValueError, match="truncated"):
        codec.decode(blob[:-10], config=cfg)
    with pytest.raises(ValueError, match="truncated"):
        codec.decode(blob[:5], config=cfg)
    with pytest.raises(ValueError, match="trailing"):
        codec.decode(blob + b"\0", config=cfg)
    wrong_version = MAGIC + struct.pack("<H", 99) + blob[len(MAGIC) + 2 :]
    with pytest.raises(ValueError, match="version 99"):
        codec.decode(wrong_version, config=cfg)
    flipped = bytearray(blob)
    flipped[-3] ^= 0x40  # a payload byte
    with pytest.raises(ValueError, match="checksum mismatch in section"):
        codec.decode(bytes(flipped), config=cfg)
    head = bytearray(blob)
    head[len(MAGIC) + 12] ^= 0x01  # a header byte
    with pytest.raises(ValueError, match="header checksum"):
        codec.decode(bytes(head), config=cfg)
    with pytest.raises(ValueError, match="must be bytes"):
        codec.decode("text", config=cfg)


def test_wrong_model_is_refused(tiny, blob):
    _, cfg, _ = tiny
    other = copy.deepcopy(cfg)
    other.num_key_value_heads = 4
    with pytest.raises(ValueError, match="wrong model.*kv_heads"):
        codec.decode(blob, config=other)
    rope = copy.deepcopy(cfg)
    rope.rope_parameters = {**cfg.rope_parameters, "rope_theta": 1234.0}
    with pytest.raises(ValueError, match="wrong model.*rope"):
        codec.decode(blob, config=rope)


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_after_lossless_round_trip(smol):
    model, tok = smol
    model.set_attn_implementation("sdpa")
    ids = tok("Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my "
              "purse, and nothing particular to interest me on shore, I thought I would sail about a little and see "
              "the watery part of the world. " * 3, return_tensors="pt").input_ids
    cache = TieredQuantCache(config=model.config, tail_length=16, warm_length=32, group_size=16,
                             archive_group_size=32)
    with torch.inference_mode():
        model(ids[:, :-1], past_key_values=cache)
    blob = codec.encode(cache, config=model.config, mode="lossless")
    assert len(blob) < cache.memory_stats()["bytes"]
    back = codec.decode(blob, config=model.config)
    a = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
    b = model.generate(ids, past_key_values=back, max_new_tokens=12, do_sample=False)
    assert a[0, ids.shape[1]:].tolist() == b[0, ids.shape[1]:].tolist()


def test_compact_symbol_streams_round_trip_and_pick_a_coarse_table_for_sparse_groups():
    """`encode_symbols` (the lossless mode's streams) gives back every symbol; with 256-symbol alphabets and 200
    symbols a group it stores uint8 tables (largest entry <= 255), smaller than the 65535-scaled uint16 tables of
    `encode_groups`; a damaged header or table raises ValueError naming it."""
    import numpy as np

    from hf_kvcache.codec import entropy

    rng = np.random.default_rng(0)
    groups = [np.minimum(rng.geometric(0.05, size=200) - 1, 255) for _ in range(12)] + [np.zeros(0, np.int32)]
    sizes = [g.size for g in groups]
    data = entropy.encode_symbols(groups, 256)
    back = entropy.decode_symbols(data, sizes, 256)
    assert all((a == b).all() for a, b in zip(groups, back))
    assert entropy.PRECISIONS[data[0] & 0x7F] <= 255
    # measured: 2158 bytes (largest table entry 15) vs 2590 with the lossy mode's tables
    assert len(data) < 0.84 * len(entropy.encode_groups(groups, 256))
    with pytest.raises(ValueError, match="table precision"):
        entropy.decode_symbols(bytes([0x7F]) + data[1:], sizes, 256)
    with pytest.raises(ValueError, match="model table"):
        entropy.decode_symbols(data, sizes + [5], 256)
    with pytest.raises(ValueError, match="shorter than its header"):
        entropy.decode_symbols(data[:3], sizes, 256)


def test_blobs_of_the_previous_format_version_are_refused(blob, tiny):
    """Format 2 (compact entropy tables) does not read format-1 blobs: they fail naming both versions."""
    _, cfg, _ = tiny
    old = MAGIC + struct.pack("<H", 1) + blob[len(MAGIC) + 2 :]
    with pytest.raises(ValueError, match="unsupported KV blob format version 1: this hf-kvcache reads version 2"):
        codec.decode(old, config=cfg)


def test_scale_referenced_zero_points_and_sign_split_high_bytes_round_trip():
    """2-byte encodings: zero points coded against their scales' high bytes (`hi-ref-ans`, chosen where zero ~ -1.5
    scale), per-channel majority signs flipped away (`hi-flip-ans`, chosen where channels keep their sign); a zero
    point whose scales are missing or decoded after it raises ValueError."""

    from hf_kvcache.codec import lossless
    from hf_kvcache.codec.layers import LayerState

    g = torch.Generator().manual_seed(0)
    scale = torch.rand(1, 3, 500, 1, generator=g).add(0.05).mul(torch.tensor([1.0, 8.0, 60.0]).view(1, 3, 1, 1))
    zero = (-1.5 * scale * (1 + 0.1 * torch.randn(1, 3, 500, 1, generator=g))).half()
    scale = scale.half()
    signed = torch.randn(1, 3, 64, 64, generator=g).add(torch.linspace(-3, 3, 64)).half()  # sign set by channel
    state = LayerState({}, {"q.scale": scale, "q.zero": zero, "tail": signed})
    body, meta = lossless.encode_state(state)
    encs = {m["name"]: m["enc"] for m in meta["tensors"]}
    assert encs == {"q.scale": "hi-ans", "q.zero": "hi-ref-ans", "tail": "hi-flip-ans"}
    back = lossless.decode_state(body, meta)
    for name, x in state.tensors.items():
        assert torch.equal(back.tensors[name].view(torch.int16), x.view(torch.int16)), name
    # measured: 1838 bytes vs 2305 coded alone
    alone, _ = lossless.encode_tensor(zero)
    assert len(lossless.encode_tensor(zero, scale)[0]) < 0.82 * len(alone)
    bad = {**meta, "tensors": [dict(m, ref="q.missing") if m["name"] == "q.zero" else m for m in meta["tensors"]]}
    with pytest.raises(ValueError, match="refers to 'q.missing'"):
        lossless.decode_state(body, bad)
    with pytest.raises(ValueError, match="without its reference"):
        lossless.decode_tensor(lossless.encode_tensor(zero, scale)[0], {"dtype": "float16", "shape": [1, 3, 500, 1],
                                                                         "enc": "hi-ref-ans"})


@pytest.mark.parametrize("name", ["cpac", "h2o-no-eviction", "paged_quant"])
def test_lossless_refuses_caches_it_cannot_rebuild_naming_lossy(tiny, name):
    model, cfg, ids = tiny
    cache = _fill(model, LOSSY[name](cfg), ids[:, :100], attn="hf_kvcache" if name in FUSED else "sdpa")
    with pytest.raises(ValueError, match="lossless mode supports .*use mode='lossy'"):
        codec.encode(cache, config=cfg, mode="lossless")


@torch.inference_mode()
def test_a_cache_encoded_while_it_calibrates_chooses_as_the_original_does():
    """A tiered layer holds the queries it saw until enough positions arrive to choose its recipe: they are counted
    in its bytes and travel with the lossless blob, so the restored cache chooses the same recipe and codes."""
    from models import tiny_llama

    model = tiny_llama(layers=2)
    cfg = model.config
    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(2))
    cache = TieredQuantCache(config=cfg, tail_length=16, warm_length=32, group_size=16, archive_group_size=16)
    model(ids[:, :40], past_key_values=cache)  # a plain sdpa loop reports the queries (attention.plain)
    layer = cache.layers[0]
    assert layer.calibrating and layer._calib_queries is not None
    assert any(t is layer._calib_queries for t in layer.held_tensors())
    back = codec.decode(codec.encode(cache, config=cfg, mode="lossless"), config=cfg)
    assert torch.equal(back.layers[0]._calib_queries, layer._calib_queries)
    for c in (cache, back):
        for i in range(40, 160, 40):
            model(ids[:, i : i + 40], past_key_values=c)
    assert back.recipes() == cache.recipes() and cache.recipes()[0]["source"] == "queries"
    for a, b in zip(cache.layers, back.layers):
        for x, y in zip(a.materialize(), b.materialize()):
            assert torch.equal(x, y)
