"""The one-launch merge of a decode step on CUDA (`kernels.triton_step`) under the interpreter: quantized segments'
unmerged split partials, value rotations, full-precision pieces and overlays against the dequantize-then-softmax
reference, in the queries' dtype; the general path still serves what the step does not take."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache.eval.gpu_sections import kivi_case
from hf_kvcache.kernels import triton_step
from hf_kvcache.kernels.decode_attention import decode_attention, reference_attention
from hf_kvcache.kernels.segments import FullSegment, QuantSegment
from hf_kvcache.quant.kivi import kivi_key_codes, kivi_value_codes
from hf_kvcache.quant.rotation import hadamard_rotation, rotate
from random_kv import token_segment


@pytest.fixture
def step_calls(monkeypatch):
    """How many times decode_attention took the one-launch step."""
    calls = []
    real = triton_step.step_attention
    monkeypatch.setattr(triton_step, "step_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def rotated_segment(b, h, t, d, k_bits, v_bits, k_group, v_group, rotation, seed):
    """A KIVI-layout segment of keys and values stored in the basis of `rotation` (as the tiered tiers store them)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, h, t, d, generator=g) * 2, torch.randn(b, h, t, d, generator=g)
    kc, ks, kz = kivi_key_codes(rotate(k, rotation), k_bits, k_group, use_triton=False)
    vc, vs, vz = kivi_value_codes(rotate(v, rotation), v_bits, v_group, use_triton=False)
    return QuantSegment(kc, ks, kz, vc, vs, vz, k_bits, v_bits, k_group, v_group, d, k_rotation=rotation,
                        v_rotation=rotation)


def full(b, h, t, d, seed, overlay_at=None):
    g = torch.Generator().manual_seed(seed)
    return FullSegment(torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g), overlay_at)


@pytest.mark.parametrize("gqa", [1, 4])
def test_tiered_like_step_matches_the_reference(step_calls, gqa):
    """An archive (2-bit, groups of 64) and a warm tier (4-bit, 32) sharing a rotation, a full-precision tail, sinks
    overlaid on the archive's first positions, the new token: one step launch, the reference's output."""
    b, h, d = 2, 2, 64
    rot = hadamard_rotation(d, seed=3)
    archive = rotated_segment(b, h, 128, d, 2, 2, 64, 64, rot, seed=1)
    warm = rotated_segment(b, h, 96, d, 4, 4, 32, 32, rot, seed=2)
    segments = [archive, warm, full(b, h, 40, d, 4), full(b, h, 4, d, 5, overlay_at=0), full(b, h, 1, d, 6)]
    q = torch.randn(b, h * gqa, 1, d, generator=torch.Generator().manual_seed(9))
    out, _ = decode_attention(q, segments, use_triton=True)
    ref, _ = reference_attention(q, segments)
    assert step_calls == [1]
    # measured 4.8e-7: fp32 dots under the interpreter
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_uniform_step_matches_the_reference(step_calls, qdtype):
    """Per-token int4 codes with pre-RoPE keys (left-padded second row: its own positions), then the new token; the
    output comes back in the queries' dtype."""
    seg = token_segment(2, 2, 70, 128, "int4", prerope=True, pad=(0, 5), seed=3, start=900)
    new = full(2, 2, 1, 128, 7)
    q = torch.randn(2, 8, 1, 128, generator=torch.Generator().manual_seed(2)).to(qdtype)
    out, _ = decode_attention(q, [seg, new], use_triton=True)
    ref, _ = reference_attention(q.float(), [seg, new])
    assert step_calls == [1] and out.dtype == qdtype
    if qdtype == torch.float32:  # measured 3.6e-7
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    else:  # the interpreter truncates on the bf16 store (the GPU rounds to nearest): within one ulp, 2^-7 (measured
        # 0.0076 relative)
        torch.testing.assert_close(out.float(), ref, atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_full_precision_pieces(step_calls, dtype):
    """A cache still all full precision (a short context in the tiered cache): SDPA over its pieces joined, no step
    launch; the reference's output in the queries' dtype."""
    segments = [full(1, 2, 77, 64, 1), full(1, 2, 1, 64, 2)]
    segments = [FullSegment(s.keys.to(dtype), s.values.to(dtype)) for s in segments]
    q = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    out, _ = decode_attention(q, segments, use_triton=True)
    ref, _ = reference_attention(q.float(), [FullSegment(s.keys.float(), s.values.float()) for s in segments])
    assert step_calls == [] and out.dtype == dtype
    if dtype == torch.float32:  # measured 2.4e-7
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    else:  # within one bf16 ulp of the largest output (measured 2.0e-3 against 3.0e-3; the fp32 path rounding its
        # output to bf16: 1.9e-3)
        torch.testing.assert_close(out.float(), ref, atol=ref.abs().max().item() * 2**-8, rtol=0)
    one, _ = decode_attention(q, segments[:1], use_triton=True)  # one piece: no join
    ref_one, _ = reference_attention(q.float(), [FullSegment(segments[0].keys.float(), segments[0].values.float())])
    bf16 = dtype == torch.bfloat16  # measured 2.1e-3
    torch.testing.assert_close(one.float(), ref_one, atol=ref_one.abs().max().item() * 2**-8 if bf16 else 2e-6,
                               rtol=0 if bf16 else 1e-5)


def test_what_the_step_does_not_take_goes_the_general_way(step_calls):
    """Three quantized segments, differing value rotations, a mask or two query positions: the general path, still
    the reference's output."""
    b, h, d = 1, 2, 64
    segs = [kivi_case(b, h, 64, d, 2, 32, seed=s)[0] for s in range(3)] + [full(b, h, 1, d, 4)]
    q = torch.randn(b, h, 1, d, generator=torch.Generator().manual_seed(5))
    out, _ = decode_attention(q, segs, use_triton=True)
    torch.testing.assert_close(out, reference_attention(q, segs)[0], atol=2e-6, rtol=1e-5)
    rotated = [rotated_segment(b, h, 64, d, 4, 4, 32, 32, hadamard_rotation(d, seed=s), seed=s) for s in (1, 2)]
    out, _ = decode_attention(q, [*rotated, full(b, h, 1, d, 4)], use_triton=True)
    torch.testing.assert_close(out, reference_attention(q, [*rotated, full(b, h, 1, d, 4)])[0], atol=2e-6, rtol=1e-5)
    mask = torch.ones(b, 1, 1, 65, dtype=torch.bool)
    mask[..., :3] = False
    two = [segs[0], full(b, h, 1, d, 4)]
    out, _ = decode_attention(q, two, attention_mask=mask, use_triton=True)
    torch.testing.assert_close(out, reference_attention(q, two, attention_mask=mask)[0], atol=2e-6, rtol=1e-5)
    assert step_calls == []


def test_step_attention_rejects_too_many_inputs():
    q = torch.zeros(1, 1, 1, 64)
    piece = (torch.zeros(1, 1, 2, 64), torch.zeros(1, 1, 2, 64))
    with pytest.raises(ValueError, match="at most"):
        triton_step.step_attention(q, [], [piece] * (triton_step.MAX_PIECES + 1), None, torch.float32)
