"""The native KIVI encoder (`kernels/native_kivi.c`) gives the bits of the torch code it stands in for: the codes,
fp16 scales and zeros of `quant.kivi.quantize_kivi` (with its clip search) and the bytes of
`quant.packing.pack_bits`."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache.kernels import native_kivi
from hf_kvcache.quant.kivi import quantize_kivi
from hf_kvcache.quant.packing import pack_bits, unpack_bits


@pytest.fixture(autouse=True)
def encoder_or_skip():
    if native_kivi.library() is None:
        pytest.skip("the native KIVI encoder is unavailable here (no C compiler, or HF_KVCACHE_NATIVE=0)")


@pytest.mark.parametrize("axis,group", [("channel", 32), ("channel", 16), ("token", 32), ("token", 64)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("clip_search,clip_ratio", [(False, 1.0), (False, 0.9), (True, 1.0), (True, 0.95)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kivi_codes_are_torch_bits(axis, group, bits, clip_search, clip_ratio, dtype, monkeypatch):
    """`quantize_kivi` with its errors and codes computed in C (the clip search's sums stay torch's) against the
    torch code alone (`HF_KVCACHE_NATIVE=0`): the same codes, fp16 scales and zeros."""
    torch.manual_seed(bits * 11 + group)
    x = torch.randn(2, 3, 96, 64) * torch.rand(1, 3, 1, 64) * 4 + torch.randn(1, 3, 1, 64)
    x[0, 0, 32:48] = 1.5  # constant groups: a zero range
    x[1, 1, 40:44] = torch.round(x[1, 1, 40:44] * 2) / 2  # halves: rounding ties
    x = x.to(dtype)[:, :, 32:]  # a view of a slice, as a calibration round trip takes it
    got = quantize_kivi(x, bits, group, axis, clip_ratio, clip_search)
    monkeypatch.setenv("HF_KVCACHE_NATIVE", "0")
    ref = quantize_kivi(x, bits, group, axis, clip_ratio, clip_search)
    assert torch.equal(got.codes, ref.codes)
    assert torch.equal(got.scale.view(torch.int16), ref.scale.view(torch.int16))
    assert torch.equal(got.zero.view(torch.int16), ref.zero.view(torch.int16))


def test_kivi_candidate_is_computed_in_c_where_it_can_be():
    """Keys per channel (`[.., groups, group, dim]`): the codes of the extent as it is, their squared errors, and a
    shrunk range; declined for a layout or dtype it does not take."""
    g = torch.randn(2, 4, 32, 64)
    extent = g.amin(-2), g.amax(-2)
    full = native_kivi.kivi_candidate(g, -2, *extent, 1.0, 2, errors=False)
    assert torch.equal(full.lo, extent[0]) and torch.equal(full.hi, extent[1])
    s, z = full.scale.float().unsqueeze(-2), full.zero.float().unsqueeze(-2)
    assert torch.equal(full.zero, extent[0].half()) and bool((full.scale.float() * 3 >= extent[1] - extent[0]).all())
    assert torch.equal(full.codes, torch.round((g - z) / s).clamp(0, 3).to(torch.uint8))
    err = native_kivi.kivi_candidate(g, -2, *extent, 1.0, 2, errors=True).errors
    assert torch.equal(err, (full.codes.float() * s + z - g).square())
    shrunk = native_kivi.kivi_candidate(g, -2, *extent, 0.8, 2, errors=True)
    mid, half = (extent[1] + extent[0]) * 0.5, (extent[1] - extent[0]) * 0.4
    assert torch.equal(shrunk.lo, mid - half) and torch.equal(shrunk.hi, mid + half)
    assert native_kivi.kivi_candidate(g.transpose(-1, -2), -2, *extent, 1.0, 2, errors=True) is None
    assert native_kivi.kivi_candidate(g.double(), -2, *extent, 1.0, 2, errors=True) is None


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 3, 8, 63, 64])
def test_packing_is_torch_bytes(bits, n, monkeypatch):
    """Every byte value, valid codes or not, packs as the torch code packs it (rows padded with zero codes)."""
    codes = torch.randint(0, 256, (3, 5, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    valid = codes & (2**bits - 1)
    got, got_valid = native_kivi.pack_codes(codes, bits), native_kivi.pack_codes(valid, bits)
    assert torch.equal(unpack_bits(got_valid, bits, n), valid)
    monkeypatch.setenv("HF_KVCACHE_NATIVE", "0")
    assert torch.equal(got, pack_bits(codes, bits)) and torch.equal(got_valid, pack_bits(valid, bits))
