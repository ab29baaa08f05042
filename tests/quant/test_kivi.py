import pytest
import torch

from hf_kvcache.quant import pack_bits, packed_length, unpack_bits
from hf_kvcache.quant.kivi import (
    KIVIQuantized,
    dequantize_kivi,
    quantize_kivi,
)
from hf_kvcache.quant.packing import lane_factors, unpack_lanes
from hf_kvcache.quant.rotation import (HadamardRotation, hadamard_matrix, hadamard_rotation, rotate, rotation_matrix,
                                       unrotate)


def reference_kivi(x: torch.Tensor, bits: int, group: int, axis: str):
    """Group by group with plain loops: (codes [T, D] uint8, scale, zero) for a [T, D] tensor."""
    T, D = x.shape
    qmax = 2**bits - 1
    codes = torch.zeros(T, D, dtype=torch.uint8)
    if axis == "channel":
        scale = torch.zeros(T // group, D, dtype=torch.float16)
        zero = torch.zeros(T // group, D, dtype=torch.float16)
        groups = [(gi, d, slice(gi * group, (gi + 1) * group), d) for gi in range(T // group) for d in range(D)]
    else:
        scale = torch.zeros(T, D // group, dtype=torch.float16)
        zero = torch.zeros(T, D // group, dtype=torch.float16)
        groups = [(t, gi, t, slice(gi * group, (gi + 1) * group)) for t in range(T) for gi in range(D // group)]
    for i, j, rows, cols in groups:
        g = x[rows, cols].float()
        lo, hi = g.min(), g.max()
        s = ((hi - lo) / qmax).clamp_min(1e-6)
        s16 = s.to(torch.float16)
        if s16.float() < s:  # rounded up, never down
            s16 = torch.nextafter(s16, torch.tensor(float("inf"), dtype=torch.float16))
        z16 = lo.to(torch.float16)
        scale[i, j], zero[i, j] = s16, z16
        codes[rows, cols] = torch.round((g - z16.float()) / s16.float()).clamp(0, qmax).to(torch.uint8)
    return codes, scale, zero


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_matches_loop_reference(axis, bits):
    torch.manual_seed(0)
    x = torch.randn(64, 32) * torch.linspace(0.1, 4, 32)
    q = quantize_kivi(x, bits, 16, axis)
    codes, scale, zero = reference_kivi(x, bits, 16, axis)
    assert torch.equal(q.scale, scale) and torch.equal(q.zero, zero)
    assert torch.equal(unpack_bits(q.codes, bits, 32), codes)
    expected = codes.float().reshape(q.codes.shape[0], -1)
    if axis == "channel":
        expected = (expected.view(4, 16, 32) * scale.float()[:, None] + zero.float()[:, None]).view(64, 32)
    else:
        expected = (expected.view(64, 2, 16) * scale.float()[..., None] + zero.float()[..., None]).view(64, 32)
    assert torch.allclose(dequantize_kivi(q), expected, atol=1e-6)


@pytest.mark.parametrize("bits,per_byte", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_codes_are_really_packed(bits, per_byte):
    x = torch.randn(2, 3, 32, 64)
    q = quantize_kivi(x, bits, 32, "channel")
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (2, 3, 32, 64 // per_byte)
    assert q.scale.dtype == torch.float16 and q.zero.dtype == torch.float16
    assert q.scale.shape == (2, 3, 1, 64)  # one scale per channel per 32-token group


def test_three_bit_packs_eight_codes_in_three_bytes():
    torch.manual_seed(1)
    x = torch.randn(4, 64)
    q = quantize_kivi(x, 3, 32, "token")
    assert q.codes.shape == (4, packed_length(64, 3)) == (4, 24)
    step = q.scale.float().repeat_interleave(32, -1)
    assert ((dequantize_kivi(q) - x).abs() <= step / 2 + 1e-5).all()


@pytest.mark.parametrize("n", [64, 61])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_lane_unpack_equals_bit_unpack(bits, n):
    """The float unpacker (lanes of a wider int, factors left to the caller) gives the integer codes exactly, also
    into a token slice of a bigger buffer and for a dim that leaves the last byte part-filled."""
    codes = torch.randint(0, 2**bits, (3, 5, n), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    vals, shifted = unpack_lanes(packed, bits, n)
    factors = lane_factors(bits, n, vals.device) if shifted else 1.0
    assert torch.equal(vals * factors, codes.float()) and torch.equal(unpack_bits(packed, bits, n), codes)
    buf = torch.full((3, 9, n), -1.0)
    out, _ = unpack_lanes(packed, bits, n, out=buf[:, 2:7])
    assert out.data_ptr() == buf[:, 2:7].data_ptr() and torch.equal(out * factors, codes.float())
    assert (buf[:, :2] == -1).all() and (buf[:, 7:] == -1).all()
    work = torch.full((packed.numel() * 8 + 8,), 0xAB, dtype=torch.uint8)  # stale bytes in a reused scratch
    with_work, _ = unpack_lanes(packed, bits, n, work=work)
    assert torch.equal(with_work * factors, codes.float())
    if 8 % bits == 0 and bits < 8:
        with pytest.raises(ValueError, match="1-D uint8 tensor of at least"):
            unpack_lanes(packed, bits, n, work=work[: packed.numel()])
    with pytest.raises(ValueError, match="float32 tensor of shape"):
        unpack_lanes(packed, bits, n, out=torch.empty(3, 5, n, dtype=torch.float16))


def test_error_within_half_step_and_range_kept():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 64, 64) * 3 + 1
    for axis in ("channel", "token"):
        q = quantize_kivi(x, 2, 32, axis)
        y = dequantize_kivi(q)
        s = q.scale.float()
        step = s.repeat_interleave(32, -2) if axis == "channel" else s.repeat_interleave(32, -1)
        assert ((y - x).abs() <= step / 2 + 1e-4).all()


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    """KIVI's reason to quantize keys per channel: a few channels carry large magnitudes."""
    torch.manual_seed(3)
    x = torch.randn(1, 2, 128, 64)
    x[..., 5] = x[..., 5] * 20 + 30
    x[..., 40] *= 15
    normal = [c for c in range(64) if c not in (5, 40)]
    err = {}
    for axis in ("channel", "token"):
        y = dequantize_kivi(quantize_kivi(x, 2, 32, axis))
        err[axis] = ((y - x)[..., normal].norm() / x[..., normal].norm()).item()
    assert err["channel"] < 0.5 * err["token"], err  # per token, the outliers' groups lose the ordinary channels


def test_per_token_beats_per_channel_on_outlier_tokens():
    torch.manual_seed(4)
    x = torch.randn(1, 2, 128, 64)
    x[:, :, ::16] *= 25
    err = {a: ((dequantize_kivi(quantize_kivi(x, 2, 32, a)) - x).norm() / x.norm()).item() for a in ("channel", "token")}
    assert err["token"] < err["channel"], err


def test_clip_search_never_worse_than_min_max():
    torch.manual_seed(5)
    x = torch.randn(2, 3, 64, 64) ** 3  # heavy tails: clipping pays
    plain = (dequantize_kivi(quantize_kivi(x, 2, 32, "token")) - x).square().sum()
    clipped = (dequantize_kivi(quantize_kivi(x, 2, 32, "token", clip_search=True)) - x).square().sum()
    assert clipped < plain


def test_dequantize_into_a_slice_of_a_bigger_buffer():
    torch.manual_seed(6)
    x = torch.randn(2, 3, 64, 64)
    for axis in ("channel", "token"):
        q = quantize_kivi(x, 4, 32, axis)
        buf = torch.full((2, 3, 100, 64), 7.0)
        out = dequantize_kivi(q, out=buf[:, :, 10:74])
        assert torch.equal(out, dequantize_kivi(q)) and torch.equal(buf[:, :, 10:74], dequantize_kivi(q))
        assert (buf[:, :, :10] == 7).all() and (buf[:, :, 74:] == 7).all()


def test_slice_tokens_keeps_whole_groups():
    x = torch.randn(1, 1, 96, 64)
    q = quantize_kivi(x, 2, 32, "channel")
    tail = q.slice(32)
    assert isinstance(tail, KIVIQuantized) and tail.tokens == 64 and tail.scale.shape[-2] == 2
    assert torch.equal(dequantize_kivi(tail), dequantize_kivi(q)[:, :, 32:])
    with pytest.raises(ValueError, match="per-channel groups are 32 tokens"):
        q.slice(16)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=9, group_size=32, axis="token"), "bits must be an integer in 1..8"),
        (dict(bits=2, group_size=0, axis="token"), "group_size must be a positive integer"),
        (dict(bits=2, group_size=32, axis="tokens"), r"axis='tokens' is not valid; choose one of \['channel', 'token'\]"),
        (dict(bits=2, group_size=48, axis="token"), "must divide the last dim 64"),
        (dict(bits=2, group_size=32, axis="channel"), "needs whole groups of tokens: got 40 tokens"),
        (dict(bits=2, group_size=32, axis="token", clip_ratio=1.5), r"clip_ratio must be in \(0, 1\]"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_kivi(torch.randn(40, 64), **kwargs)


def test_rotation_is_orthogonal_and_inverts():
    r = rotation_matrix(64)
    assert torch.allclose(r @ r.t(), torch.eye(64), atol=1e-6)
    x = torch.randn(2, 3, 5, 64)
    assert torch.allclose(unrotate(rotate(x, r), r), x, atol=1e-5)
    h = hadamard_matrix(8)
    assert torch.equal(h @ h.t(), 8 * torch.eye(8))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(48)


@pytest.mark.parametrize("n", [1, 2, 8, 32, 64, 128, 256, 512])
def test_hadamard_transform_is_the_rotation_matrix(n):
    """The Walsh-Hadamard transform from signs and Sylvester factors is x @ R (and x @ R.T) for the dense
    randomized Hadamard matrix of the same size and seed, orthogonal, and holds no n x n tensor."""
    r = HadamardRotation(n, seed=1)
    dense = rotation_matrix(n, 1)
    x = torch.randn(2, 3, 5, n, dtype=torch.float64).float()
    torch.testing.assert_close(r.rotate(x), x @ dense, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(r.unrotate(x), x @ dense.t(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(r.unrotate(r.rotate(x)), x, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(rotate(x, r), x @ dense, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(unrotate(x, r), x @ dense.t(), atol=2e-6, rtol=1e-5)
    m = r.matrix()
    torch.testing.assert_close(m @ m.t(), torch.eye(n), atol=1e-6, rtol=0)
    assert all(t.numel() < n * n or n <= 2 for t in r.tensors())
    assert r.signs.dtype == torch.int8 and r.signs.numel() == n
    assert hadamard_rotation(n, 1) is hadamard_rotation(n, 1)  # one object per size and seed: counted once


@pytest.mark.parametrize("n", [16, 64, 128, 256])
@pytest.mark.parametrize("threads", [1, 2])
def test_hadamard_transform_in_one_product_gives_the_per_row_bits(n, threads, monkeypatch):
    """From `_ONE_PRODUCT_ROWS` vectors on, the outer Sylvester factor is one matrix product over every row instead
    of torch's one small product a row: the same bits (calibration's round trips and the stored codes must not move)."""
    from hf_kvcache.quant import rotation as rotation_module

    r = HadamardRotation(n, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape in [(1, 3, 1984, n), (2, 2, 333, n), (3, 70, n)]:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(*shape) * 3).to(dtype)
                one = [r.rotate(x), r.unrotate(x)]
                monkeypatch.setattr(rotation_module, "_ONE_PRODUCT_ROWS", 1 << 62)
                per_row = [r.rotate(x), r.unrotate(x)]
                monkeypatch.undo()
                assert all(torch.equal(a, b) for a, b in zip(one, per_row))
    finally:
        torch.set_num_threads(before)


def test_hadamard_transform_bad_sizes():
    with pytest.raises(ValueError, match="power-of-two size"):
        HadamardRotation(96)
    with pytest.raises(ValueError, match="cannot rotate a last dim of 32"):
        HadamardRotation(64).rotate(torch.randn(3, 32))


def test_rotation_spreads_an_outlier_channel():
    torch.manual_seed(7)
    x = torch.randn(1, 1, 64, 64)
    x[..., 3] *= 30
    r = rotation_matrix(64)
    plain = (dequantize_kivi(quantize_kivi(x, 2, 64, "token")) - x).norm()
    rotated = (unrotate(dequantize_kivi(quantize_kivi(rotate(x, r), 2, 64, "token")), r) - x).norm()
    assert rotated < plain
