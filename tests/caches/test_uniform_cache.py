import json

import pytest
import torch
from hf_kvcache import UniformQuantCache
from hf_kvcache.caches.uniform import UniformQuantOptions
from models import cache_config as tiny_config
from random_kv import stream_random

B, H, D, LAYERS = 2, 3, 64, 2


def fill(cache, chunks=(17, 1, 22)):
    return stream_random(cache, chunks, B, H, D, LAYERS)


# bounds about 1.3x the measured relative error of keys / values: int8 0.0061 / 0.0058, int4 0.0974 / 0.0956,
# fp8_e4m3 0.0250 / 0.0251, fp8_e5m2 0.0497 / 0.0500
@pytest.mark.parametrize("dtype,max_err", [("int8", 0.008), ("int4", 0.125), ("fp8_e4m3", 0.033), ("fp8_e5m2", 0.065)])
def test_roundtrip_and_positions(dtype, max_err):
    cache = UniformQuantCache(config=tiny_config(), dtype=dtype)
    k, v = fill(cache)
    assert cache.get_seq_length() == 40
    k_out, v_out = cache.layers[0].materialize()
    assert k_out.shape == k.shape and v_out.dtype == torch.float32
    assert ((k_out - k).norm() / k.norm()) < max_err and ((v_out - v).norm() / v.norm()) < max_err
    assert cache.get_mask_sizes(1, 0) == (41, 0)


def test_update_returns_new_tokens_unquantized():
    cache = UniformQuantCache(config=tiny_config(), dtype="int4")
    fill(cache)
    k_new, v_new = torch.randn(B, H, 2, D), torch.randn(B, H, 2, D)
    keys, values = cache.update(k_new, v_new, 0)
    assert keys.shape[2] == 42 and torch.equal(keys[:, :, -2:], k_new) and torch.equal(values[:, :, -2:], v_new)


# measured ratios: int8 1.77, int4 3.02 (40 tokens carry 1.5 KB of key statistics per row and layer), fp8 1.94
@pytest.mark.parametrize("dtype,min_ratio,max_bytes_per_elem", [("int8", 1.75, 1.1), ("int4", 3.0, 0.6), ("fp8", 1.9, 1.1)])
def test_storage_really_shrinks(dtype, min_ratio, max_bytes_per_elem):
    cache = UniformQuantCache(config=tiny_config(), dtype=dtype)
    fill(cache)
    stats = cache.memory_stats()
    elements = 2 * LAYERS * B * H * 40 * D
    held = sum(t.nbytes for layer in cache.layers for q in (layer.key_codes, layer.value_codes) for t in q.tensors())
    stats_bytes = 2 * B * H * D * 4 if cache.key_quant == "prerope" else 0  # float32 key shift, scale per row
    assert cache.key_quant == ("token" if dtype == "fp8" else "prerope")
    assert stats["bytes"] == held + LAYERS * stats_bytes
    assert stats["fp16_bytes"] == 2 * elements
    assert stats["ratio"] >= min_ratio
    assert held / elements <= max_bytes_per_elem


def test_crop_too_far_raises():
    cache = UniformQuantCache(config=tiny_config(), dtype="int8")
    fill(cache)
    with pytest.raises(ValueError, match="cannot crop 50 tokens"):
        cache.crop(-50)


def test_without_config_layers_are_created_lazily():
    cache = UniformQuantCache(dtype="int4")
    fill(cache)
    assert len(cache.layers) == LAYERS and cache.get_seq_length() == 40


def test_sliding_layers_hold_their_window_quantized():
    """A sliding layer keeps the newest sliding_window - 1 tokens as codes (transformers' mask sizes); crop works
    until the window drops tokens."""
    from hf_kvcache.caches.uniform import UniformQuantLayer

    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    cache = UniformQuantCache(config=config, dtype="int8")
    fill(cache, chunks=(5,))
    cache.crop(-2)  # nothing dropped yet
    assert cache.layers[0].tokens_held() == 3 and cache.get_seq_length() == 3
    k, _ = fill(cache, chunks=(17, 1, 22))
    sliding, full = cache.layers
    assert isinstance(sliding, UniformQuantLayer) and sliding.is_sliding and not full.is_sliding
    assert sliding.tokens_held() == 7 and full.tokens_held() == 43
    assert sliding.get_mask_sizes(1) == (8, 43 - 7)
    k_out, _ = sliding.materialize()
    assert ((k_out - k[:, :, -7:]).norm() / k[:, :, -7:].norm()) < 0.008  # int8 bound of the roundtrip test
    # codes (64 B) + one fp16 scale per token and tensor, + the float32 key shift and scale of each row
    assert sliding.nbytes() == 2 * B * H * 7 * (64 + 2) + 2 * B * H * D * 4
    assert sliding.fp16_bytes() == 2 * B * H * 7 * 2 * D
    with pytest.raises(ValueError, match="has dropped the tokens before its window"):
        cache.crop(-1)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(dtype="int3"), "dtype='int3' is not valid; choose one of"),
        (dict(dtype="int8", groups=2), r"unknown option\(s\) \['groups'\].*valid options"),
        (dict(dtype="int4", group_size=0), "group_size must be a positive integer"),
        (dict(dtype="fp8", symmetric=False), "fp8 formats are symmetric"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        UniformQuantCache(config=tiny_config(), **options)


def test_group_size_must_divide_head_dim():
    cache = UniformQuantCache(config=tiny_config(), dtype="int4", group_size=48)
    with pytest.raises(ValueError, match="must divide head_dim=64"):
        fill(cache)


def test_bad_states():
    cache = UniformQuantCache(config=tiny_config(), dtype="int8")
    with pytest.raises(ValueError, match="floating-point"):
        cache.update(torch.ones(B, H, 2, D, dtype=torch.int64), torch.ones(B, H, 2, D), 0)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        cache.update(torch.randn(H, 2, D), torch.randn(H, 2, D), 0)
    cache.update(torch.randn(B, H, 2, D), torch.randn(B, H, 2, D), 0)
    with pytest.raises(ValueError, match="head_dim changed from 64 to 32"):
        cache.update(torch.randn(B, H, 2, 32), torch.randn(B, H, 2, 32), 0)


def test_options_json_roundtrip():
    opts = UniformQuantOptions(dtype="int4", group_size=16, symmetric=False)
    again = UniformQuantOptions.from_json(opts.to_json())
    assert again == opts and json.loads(opts.to_json())["group_size"] == 16
    assert UniformQuantOptions(dtype="fp8").dtype == "fp8_e4m3"


# ---- key_quant="prerope" ------------------------------------------------------------------------------------------
def _biased_keys(tokens: int, seed: int = 0) -> torch.Tensor:
    """Post-RoPE keys `[B, H, tokens, D]` whose pre-RoPE channels 3 and 11 carry an offset of 12 and the others
    spreads from 0.1 to 2.1 (Qwen2.5's k bias in miniature)."""
    from hf_kvcache.rope import KeyRotation

    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(D)
    bias[[3, 11]] = 12.0
    pre = bias + (torch.rand(D, generator=g) * 2 + 0.1) * torch.randn(B, H, tokens, D, generator=g)
    return KeyRotation.from_config(tiny_config()).rotate(pre, 0)


def test_prerope_keys_quantize_biased_channels_better_than_token_keys():
    """int4: RoPE undone, channels shifted and scaled, then the symmetric groups of 32; against the post-RoPE keys
    in the same groups."""
    keys = _biased_keys(64)
    err = {}
    for mode in ("prerope", "token"):
        cache = UniformQuantCache(config=tiny_config(), dtype="int4", key_quant=mode)
        for part in (keys[:, :, :40], keys[:, :, 40:]):
            for layer in range(LAYERS):
                cache.update(part, part, layer)
        held, _ = cache.layers[0].materialize()
        err[mode] = float((held - keys).norm() / keys.norm())
    assert err["prerope"] < 0.06 and 3 * err["prerope"] < err["token"], err  # measured 4.6 % vs 16.2 %


def _rotated(pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    from hf_kvcache.rope import KeyRotation

    return KeyRotation.from_config(tiny_config()).rotate_at(pre, positions)


def test_prerope_stats_per_row_fit_after_32_tokens_skip_padding_and_count_in_bytes():
    """Row 1 is left-padded by 6 positions (garbage keys): its real keys were rotated at their true positions 0..41.
    Each row's statistics are its own real keys', so the padded row holds the codes it holds alone."""
    g = torch.Generator().manual_seed(1)
    bias = torch.zeros(D)
    bias[[3, 11]] = 12.0
    pre = bias + (torch.rand(D, generator=g) * 2 + 0.1) * torch.randn(B, H, 48, D, generator=g)
    keys = torch.stack([_rotated(pre[0], torch.arange(48)),
                        torch.cat([torch.full((H, 6, D), 1000.0), _rotated(pre[1, :, 6:], torch.arange(42))], 1)])
    cache = UniformQuantCache(config=tiny_config(), dtype="int8", key_quant="prerope")
    mask = torch.ones(B, 48, dtype=torch.long)
    mask[1, :6] = 0
    cache.set_padding(mask)
    layer = cache.layers[0]
    cache.update(keys[:, :, :10], keys[:, :, :10], 0)
    # before the fit the keys are held as they come (float32 here), the values as codes
    assert not layer.key_codec.fitted and layer.nbytes() == B * H * 10 * (4 * D + D + 2)
    torch.testing.assert_close(layer.materialize()[0], keys[:, :, :10], atol=0, rtol=0)
    cache.update(keys[:, :, 10:], keys[:, :, 10:], 0)  # 48 seen >= 32: fitted, every key quantized once
    codec = layer.key_codec
    assert codec.fitted and codec.shift.shape == (B, H, 1, D)
    # each row's mean of its real pre-RoPE keys (with the padding in, row 1's would move by about 125)
    torch.testing.assert_close(codec.shift[0, :, 0], pre[0].mean(1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(codec.shift[1, :, 0], pre[1, :, 6:].mean(1), atol=1e-4, rtol=1e-5)
    held, _ = layer.materialize()
    err = (held - keys)[:, :, 6:].norm() / keys[:, :, 6:].norm()
    assert err < 0.008, err  # int8 after the fit (measured 0.61 %)
    assert layer.nbytes() == 2 * B * H * 48 * (D + 2) + 2 * B * H * D * 4  # + float32 shift and scale per row
    alone = UniformQuantCache(config=tiny_config(), dtype="int8", key_quant="prerope")
    alone.update(keys[1:, :, 6:16], keys[1:, :, 6:16], 0)
    alone.update(keys[1:, :, 16:], keys[1:, :, 16:], 0)
    assert torch.equal(alone.layers[0].key_codes.codes[0], layer.key_codes.codes[1, :, 6:])
    layer.batch_select_indices(torch.tensor([1]))  # the statistics follow their rows
    torch.testing.assert_close(codec.shift, alone.layers[0].key_codec.shift, atol=1e-6, rtol=1e-6)
    cache.reset()
    assert not codec.fitted


def test_key_quant_default_is_prerope_for_integer_codes_where_rope_can_be_undone():
    assert UniformQuantCache(config=tiny_config(), dtype="int4").key_quant == "prerope"
    assert UniformQuantCache(config=tiny_config(), dtype="fp8").key_quant == "token"
    assert UniformQuantCache(dtype="int4").key_quant == "token"  # no config: no RoPE to undo
    partial = tiny_config()
    partial.rope_parameters = {**partial.rope_parameters, "partial_rotary_factor": 0.5}
    cache = UniformQuantCache(config=partial, dtype="int8")  # a RoPE it cannot undo: keys as they come
    assert cache.key_quant == "token" and cache.layers[0].key_codec is None
    with pytest.raises(ValueError, match="needs RoPE over the whole head"):
        UniformQuantCache(config=partial, dtype="int8", key_quant="prerope")


def test_prerope_needs_the_config():
    with pytest.raises(ValueError, match=r"undoes RoPE on the keys, which needs the config.*key_quant='token'"):
        UniformQuantCache(dtype="int4", key_quant="prerope")
    with pytest.raises(ValueError, match="key_quant='rotated' is not valid"):
        UniformQuantCache(config=tiny_config(), key_quant="rotated")


def test_a_row_with_fewer_than_32_real_tokens_stays_exact_until_it_has_them():
    """Left padding: each row fits its statistics once it has seen 32 real tokens; until every row has, the keys are
    held as they come and a fitted row reads them through its codes, as it would alone."""
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(B, H, 52, D, generator=g)
    mask = torch.ones(B, 52, dtype=torch.long)
    mask[1, :20] = 0  # row 1: 20 padding positions
    cache = UniformQuantCache(config=tiny_config(), dtype="int4")
    cache.set_padding(mask[:, :40])
    layer = cache.layers[0]
    cache.update(keys[:, :, :40], keys[:, :, :40], 0)  # row 0: 40 real tokens, row 1: 20
    assert layer.rows_fitted.tolist() == [True, False] and layer.pending_keys is not None
    held, _ = layer.materialize()
    assert torch.equal(held[1], keys[1, :, :40])  # not fitted: exact
    alone = UniformQuantCache(config=tiny_config(), dtype="int4")
    alone.update(keys[:1, :, :40], keys[:1, :, :40], 0)
    torch.testing.assert_close(held[0], alone.layers[0].materialize()[0][0], atol=1e-5, rtol=0)
    cache.update(keys[:, :, 40:], keys[:, :, 40:], 0)  # row 1 reaches 32 real tokens: every key to codes
    assert layer.rows_fitted is None and layer.pending_keys is None and layer.key_codec.shift.shape[0] == B
    held, _ = layer.materialize()
    err = (held - keys)[:, :, 20:].norm() / keys[:, :, 20:].norm()
    assert err < 0.12  # measured 9.5 %


def test_attention_segments_hold_what_materialize_reads():
    """The fused attention reads one `TokenSegment` of the stored codes (every format): none while keys wait raw for
    the statistics; then, decoded, exactly what `materialize` returns."""
    g = torch.Generator().manual_seed(7)
    keys, values = torch.randn(B, H, 48, D, generator=g), torch.randn(B, H, 48, D, generator=g)
    for key_quant in ("prerope", "token"):
        cache = UniformQuantCache(config=tiny_config(), dtype="int4", key_quant=key_quant)
        assert cache.reads_fused
        layer = cache.layers[0]
        cache.update(keys[:, :, :10], values[:, :, :10], 0)
        assert (layer.attention_segments() is None) == (key_quant == "prerope")  # raw keys until 32 are seen
        cache.update(keys[:, :, 10:], values[:, :, 10:], 0)
        (segment,) = layer.attention_segments()
        assert segment.tokens == 48 and (segment.key_codec is not None) == (key_quant == "prerope")
        for got, want in zip(segment.dequantize(layer.dtype), layer.materialize()):
            assert torch.equal(got, want)
    fp8 = UniformQuantCache(config=tiny_config(), dtype="fp8")
    fp8.update(keys, values, 0)
    (segment,) = fp8.layers[0].attention_segments()
    assert fp8.reads_fused and segment.key_codec is None
    for got, want in zip(segment.dequantize(fp8.layers[0].dtype), fp8.layers[0].materialize()):
        assert torch.equal(got, want)


# ---- rotation="hadamard" --------------------------------------------------------------------------------------------
def _outlier_kv(tokens: int = 48, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[B, H, tokens, D]` whose channel 5 is 20x the others in every token (an outlier channel: one
    per-token group's range is set by it)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, tokens, D, generator=g), torch.randn(B, H, tokens, D, generator=g)
    k[..., 5] *= 20
    v[..., 5] *= 20
    return k, v


def _errors(cache, k, v) -> tuple[float, float]:
    for layer in range(LAYERS):
        cache.update(k, v, layer)
    k_out, v_out = cache.layers[0].materialize()
    return float((k_out - k).norm() / k.norm()), float((v_out - v).norm() / v.norm())


def test_hadamard_rotation_spreads_an_outlier_channel():
    """int4 with an outlier channel in keys and values: the rotated codes (same bytes) lose less of the other
    channels' values, with keys as they come and with pre-RoPE keys."""
    k, v = _outlier_kv()
    err = {(kq, rot): _errors(UniformQuantCache(config=tiny_config(), dtype="int4", key_quant=kq, rotation=rot), k, v)
           for kq in ("token", "prerope") for rot in ("none", "hadamard")}
    # measured relative errors (keys, values): token none 0.164 / 0.162, hadamard 0.066 / 0.064;
    # prerope none 0.063 / 0.162, hadamard 0.047 / 0.064
    assert err["token", "hadamard"][0] < 0.5 * err["token", "none"][0], err
    assert err["token", "hadamard"][1] < 0.5 * err["token", "none"][1], err
    assert err["prerope", "hadamard"][0] < 0.85 * err["prerope", "none"][0], err
    assert err["prerope", "hadamard"][1] == pytest.approx(err["token", "hadamard"][1]), err  # the same value codes


def test_rotated_codes_are_read_dequantized_restored_and_counted():
    """The fused attention does not read rotated codes: the layer hands over `materialize`'s tensors. The layer's
    state restores the same tensors. The rotation's signs and Sylvester factor are counted once per cache."""
    from hf_kvcache.quant.rotation import hadamard_rotation

    k, v = _outlier_kv()
    plain = UniformQuantCache(config=tiny_config(), dtype="int4")
    rotated = UniformQuantCache(config=tiny_config(), dtype="int4", rotation="hadamard")
    for cache in (plain, rotated):
        for layer in range(LAYERS):
            cache.update(k, v, layer)
    layer = rotated.layers[0]
    assert layer.attention_segments() is None and plain.layers[0].attention_segments() is not None
    restored = UniformQuantCache(config=tiny_config(), dtype="int4", rotation="hadamard")
    restored.update(k[:, :, :1], v[:, :, :1], 0)
    restored.layers[0].reset()
    restored.layers[0].load_state_tensors(layer.state_tensors())
    restored.layers[0].cumulative_length = layer.cumulative_length
    for got, want in zip(restored.layers[0].materialize(), layer.materialize()):
        assert torch.equal(got, want)
    rotation_bytes = sum(t.nbytes for t in hadamard_rotation(D).tensors())
    assert rotation_bytes == D + 8 * 8 * 4  # int8 signs, one float32 8 x 8 factor
    assert rotated.memory_stats()["bytes"] == plain.memory_stats()["bytes"] + rotation_bytes


def test_rotation_option_errors():
    with pytest.raises(ValueError, match="rotation='qr' is not valid; choose one of"):
        UniformQuantCache(config=tiny_config(), dtype="int4", rotation="qr")
    cache = UniformQuantCache(dtype="int8", rotation="hadamard")  # no config: layers made as keys come
    with pytest.raises(ValueError, match="power-of-two head_dim, got 48; use rotation='none'"):
        cache.update(torch.randn(B, H, 2, 48), torch.randn(B, H, 2, 48), 0)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_codes_appended_into_spare_rows_hold_what_cat_holds(dtype):
    """A decode step writes its token's codes into spare rows behind the held ones (`quant.rows.RowBuffer`): the
    layer holds the same codes as one that concatenates every step, through crops, a reorder of the batch and a
    switch out of inference mode; the spare rows count in the bytes held (at most 1/64 more)."""
    from hf_kvcache.quant.rows import RowBuffer

    class CatRows(RowBuffer):
        def append(self, held, new):
            return new if held is None else held.cat(new)

    spare, plain = (UniformQuantCache(config=tiny_config(), dtype=dtype) for _ in range(2))
    fill(spare, chunks=(17, 1, 150))
    fill(plain, chunks=(17, 1, 150))
    for layer in plain.layers:
        layer.key_buffer, layer.value_buffer = CatRows(), CatRows()

    def step(n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        for cache in (spare, plain):
            for i in range(LAYERS):
                cache.update(k, v, i)

    def same() -> None:
        for a, b in zip(spare.layers, plain.layers):
            for x, y in ((a.key_codes, b.key_codes), (a.value_codes, b.value_codes)):
                assert x.tokens == y.tokens and all(torch.equal(s, t) for s, t in zip(x.tensors(), y.tensors()))

    with torch.inference_mode():
        for s in range(13):
            step(1, s)
    same()
    layer = spare.layers[0]
    for codes, buffer in ((layer.key_codes, layer.key_buffer), (layer.value_codes, layer.value_buffer)):
        assert codes.codes.data_ptr() == buffer.backing.codes.data_ptr()  # views of the spare storage's first rows
    held, exact = spare.memory_stats()["bytes"], plain.memory_stats()["bytes"]
    room = sum((buffer.backing.tokens - codes.tokens) * sum(t[:, :, :1].nbytes for t in buffer.backing.tensors())
               for layer in spare.layers
               for codes, buffer in ((layer.key_codes, layer.key_buffer), (layer.value_codes, layer.value_buffer)))
    assert room > 0 and held == exact + room and held <= exact * (1 + 1 / 64)
    for cache in (spare, plain):
        cache.crop(-3)
    for s in range(5):  # outside inference mode: the inference-mode storage is not written, new storage is taken
        step(1, 100 + s)
    same()
    for cache in (spare, plain):
        cache.reorder_cache(torch.tensor([1, 0]))
    step(2, 200)
    step(1, 201)
    same()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_encoder_writes_a_decode_step_into_the_spare_rows(dtype):
    """`RowBuffer.spare` hands the native encoder the spare rows behind the held codes: it writes the new token's codes
    there (the same codes it makes alone) and the append copies nothing; rows that are not the ones it returned last
    get none."""
    from hf_kvcache.kernels import native_encode

    if native_encode.library() is None:
        pytest.skip("no native encoder here")
    cache = UniformQuantCache(config=tiny_config(), dtype=dtype)
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        fill(cache, chunks=(17, 1, 150))
        for i in range(LAYERS):  # a decode step: room behind the rows (a prompt's chunks are held exactly)
            cache.update(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g), i)
        layer = cache.layers[1]
        n = layer.value_codes.tokens
        spare = layer.value_buffer.spare(layer.value_codes, 1)
        backing = layer.value_buffer.backing
        assert spare is not None and spare.codes.data_ptr() == backing.codes[:, :, n:].data_ptr()
        x = torch.randn(B, H, 1, D, generator=g)
        coded = layer.format.quantize_into(x, spare)
        alone = layer.format.quantize(x)
        assert coded is spare and all(torch.equal(a, b) for a, b in zip(coded.tensors(), alone.tensors()))
        held = layer.value_buffer.append(layer.value_codes, coded)
        assert held.tokens == n + 1 and held.codes.data_ptr() == backing.codes.data_ptr()
        assert all(torch.equal(a[:, :, n:], b) for a, b in zip(held.tensors(), alone.tensors()))
        assert layer.value_buffer.spare(held.clone(), 1) is None  # a copy: not the rows it returned
        assert layer.value_buffer.spare(held, backing.tokens) is None  # no room for them
