"""The native encoder (`kernels/native_encode.c`) gives the bits of the torch code it stands in for: codes, fp16
scales and zeros of `quant.uniform.quantize`, and of `derotate` + `quantize_pre` for pre-RoPE keys."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache.caches.uniform import UniformPreRopeKeys, UniformQuantOptions
from hf_kvcache.kernels import native_encode
from hf_kvcache.quant.uniform import QuantizedTensor, quantize
from hf_kvcache.rope import KeyRotation


@pytest.fixture(autouse=True)
def encoder_or_skip():
    if native_encode.library() is None:
        pytest.skip("the native encoder is unavailable here (no C compiler, or HF_KVCACHE_NATIVE=0)")


def assert_same_bits(got: QuantizedTensor, ref: QuantizedTensor) -> None:
    assert got is not None
    assert (got.bits, got.group_size, got.n, got.fmt) == (ref.bits, ref.group_size, ref.n, ref.fmt)
    assert torch.equal(got.codes, ref.codes)
    assert torch.equal(got.scale.view(torch.int16), ref.scale.view(torch.int16))
    if ref.zero is None:
        assert got.zero is None
    else:
        assert torch.equal(got.zero.view(torch.int16), ref.zero.view(torch.int16))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,group", [(64, 32), (128, 128), (256, 64)])
def test_codes_are_torch_bits(bits, symmetric, dtype, d, group):
    torch.manual_seed(bits * 7 + d + symmetric)
    x = torch.randn(2, 3, 17, d) * 3
    x[0, 0, 0] = 0.0  # a group of zeros: the smallest scale
    x[0, 1, :4] = torch.round(x[0, 1, :4] * 2) / 2  # halves: rounding ties
    x[1, 2, 5] *= 1e-7  # scales in fp16's subnormal range
    x = x.to(dtype)
    assert_same_bits(native_encode.encode(x, bits, group, symmetric), quantize(x, "int", bits, group, symmetric))


def test_signed_zeros_keep_one_zero_pattern():
    x = torch.zeros(1, 1, 2, 64)
    x[0, 0, 0, ::2] = -0.0
    ref = quantize(x, "int", 4, 32, False)
    assert not torch.signbit(ref.zero.float()).any()
    assert_same_bits(native_encode.encode(x, 4, 32, False), ref)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_prerope_keys_are_torch_bits(per_row, padded, scaling):
    """Undoing RoPE at per-row positions, a shared or per-row frame, then codes: `encode_keys` as the two steps."""
    torch.manual_seed(int(per_row) + 2 * int(padded))
    b, h, n, d = 2, 3, 5, 64
    rope = KeyRotation(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), attention_scaling=scaling)
    codec = UniformPreRopeKeys(rope, bits=4, options=UniformQuantOptions(dtype="int4"))
    codec.fit(torch.randn(b, h, 40, d) * 2 + 1)
    if per_row:
        codec.shift = torch.randn(b, h, 1, d)
        codec.scale = torch.rand(b, h, 1, d) + 0.2
    keys = torch.randn(b, h, n, d) * 4
    positions = torch.arange(900, 900 + n)
    if padded:
        positions = (positions[None] - torch.tensor([0, 3])[:, None]).unsqueeze(1)
    ref = codec.quantize_pre(codec.derotate(keys, positions))
    assert_same_bits(codec.encode_keys(keys, positions), ref)


def test_options_quantize_takes_the_encoder_for_integer_formats(monkeypatch):
    """`UniformQuantOptions.quantize` asks the encoder for integer `[b, h, n, d]` tensors and falls back to torch
    where it declines (fp8, other ranks)."""
    calls = []
    real = native_encode.encode

    def spy(*args, **kwargs):
        calls.append(args[1:4])
        return real(*args, **kwargs)

    monkeypatch.setattr(native_encode, "encode", spy)
    x = torch.randn(1, 2, 3, 64)
    opts = UniformQuantOptions(dtype="int4")
    assert_same_bits(opts.quantize(x), quantize(x, "int", 4, 32, True))
    assert calls == [(4, 32, True)]
    UniformQuantOptions(dtype="fp8").quantize(x)
    UniformQuantOptions(dtype="int8").quantize(x[0])
    assert len(calls) == 1


def test_declines_what_it_does_not_take():
    x = torch.randn(1, 1, 2, 64)
    assert native_encode.encode(x, 3, 64, True) is None  # 3-bit codes: the torch packer
    assert native_encode.encode(x, 4, 48, True) is None  # groups that do not divide the head
