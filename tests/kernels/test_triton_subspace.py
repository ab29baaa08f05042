"""The subspace archive's Triton kernel (`kernels.triton_subspace`, a tiered archive coded in fitted bases on CUDA)
against the torch path's blocks under the interpreter: every head dim it serves, keys pre-RoPE (positions near zero
and far from it) or as they come, codes of every width 1-8, ranks below the head dim, a masked row, both tiles of
the default launches; and `decode_attention` taking it for a subspace segment when it runs the Triton kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvcache.kernels import from_subspace, triton_subspace
from hf_kvcache.kernels.decode_attention import decode_attention
from hf_kvcache.kernels.segments import FullSegment
from random_kv import subspace_case


def _torch_partial(q, seg, valid):
    b, t = valid.shape
    return from_subspace.blockwise_partial(q, seg, valid.view(b, 1, 1, t), 128, from_subspace.subspace_scores,
                                           lambda p, part: from_subspace.subspace_coefficients(p, part.values))


@pytest.mark.parametrize("prerope,start", [(True, 37), (True, 120_000), (False, 0)],
                         ids=["pre-rope", "pre-rope-far", "post-rope"])
@pytest.mark.parametrize("rows,d", [(3, 64), (7, 128), (1, 256)])
@pytest.mark.parametrize("dot_f32", [False, True], ids=["fp16-model-launch", "fp32-model-launch"])
def test_subspace_kernel_matches_the_torch_path(prerope, start, rows, d, dot_f32):
    """320 tokens in several token splits (merged by log-sum-exp), the second row masked over its first 150; each
    default launch's tile and channel step (`subspace_launch`; the interpreter runs fp32 dots either way)."""
    q, seg, valid = subspace_case(2, 320, rows, d, prerope)
    seg = dataclasses.replace(seg, start=start)
    block, channels, warps = triton_subspace.subspace_launch(d, dot_f32)
    got = triton_subspace.coefficient_partial(q, seg, valid, block=block, num_warps=warps)
    assert got is not None
    for name, x, y in zip(("max", "sum", "coefficients"), got, _torch_partial(q, seg, valid)):
        # float32 sums in another order: measured within 3.5e-6 of the largest entry
        torch.testing.assert_close(x, y, atol=8e-6 * float(y.abs().max()), rtol=2e-5, msg=lambda m: f"{name}: {m}")


def test_subspace_kernel_declines_shapes_it_does_not_take():
    """A head dim that is not a power of two in 32..256 gives None (the caller keeps the torch path)."""
    q, seg, valid = subspace_case(2, 192, 2, 64, True)
    assert triton_subspace.serves(q, seg)
    assert triton_subspace.coefficient_partial(q[..., :48], seg, valid) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_a_subspace_archive_with_the_triton_kernel(dtype, monkeypatch):
    """A step over a subspace archive and a full-precision tail, three query heads per KV head: the Triton path
    (`use_triton=True`, as on CUDA) calls the kernel and gives the torch path's output."""
    q, seg, valid = subspace_case(2, 256, 1, 64, True)
    g = torch.Generator().manual_seed(3)
    tail = FullSegment(torch.randn(2, 2, 9, 64, generator=g), torch.randn(2, 2, 9, 64, generator=g))
    query = torch.randn(2, 6, 1, 64, generator=g).to(dtype)
    calls = []
    real = triton_subspace.coefficient_partial
    monkeypatch.setattr(triton_subspace, "coefficient_partial", lambda *a, **k: calls.append(1) or real(*a, **k))
    got, _ = decode_attention(query, [seg, tail], use_triton=True)
    want, _ = decode_attention(query, [seg, tail], use_triton=False, use_native=False)
    assert calls == [1] and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rotated", [False, True], ids=["no-rotation", "hadamard-values"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiered_step_over_a_subspace_archive_is_one_step_launch(rotated, dtype, monkeypatch):
    """The tiered layer's step on CUDA (`use_triton=True`, one position, no mask): a subspace archive, a KIVI warm tier
    whose values may sit in a Hadamard basis, the sinks written over the archive's first columns and a full tail go
    through `triton_step`'s one launch (the archive's split partials taken to the warm tier's basis) and give the
    dequantize-then-softmax reference's output."""
    from hf_kvcache.eval.gpu_sections import kivi_case
    from hf_kvcache.kernels import triton_step
    from hf_kvcache.kernels.decode_attention import reference_attention
    from hf_kvcache.quant.rotation import hadamard_rotation
    from test_triton_step import rotated_segment

    _, archive, _ = subspace_case(2, 256, 1, 64, True)
    if rotated:
        warm = rotated_segment(2, 2, 64, 64, 4, 4, 32, 32, hadamard_rotation(64, 1, torch.device("cpu")), 5)
    else:
        warm, _ = kivi_case(2, 2, 64, 64, 4, 32, 5)
    g = torch.Generator().manual_seed(7)
    sinks = FullSegment(torch.randn(2, 2, 4, 64, generator=g), torch.randn(2, 2, 4, 64, generator=g), 0)
    tail = FullSegment(torch.randn(2, 2, 9, 64, generator=g), torch.randn(2, 2, 9, 64, generator=g))
    segments = [archive, warm, sinks, tail]
    query = torch.randn(2, 6, 1, 64, generator=g).to(dtype)
    calls = []
    real = triton_step.step_attention
    monkeypatch.setattr(triton_step, "step_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    got, _ = decode_attention(query, segments, use_triton=True)
    want, _ = reference_attention(query.float(), segments)
    assert calls == [1] and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
