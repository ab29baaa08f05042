"""The row-wise Triton decode kernel (`kernels.triton_quant`) against the general kernel and the dequantize-then-softmax
reference, under the interpreter: every width it serves, value groups narrower than the head, key masks, GQA."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache.eval.gpu_sections import kivi_case
from hf_kvcache.kernels.decode_attention import decode_attention, group_queries, reference_attention
from hf_kvcache.kernels.triton_decode import quant_partial_triton
from hf_kvcache.kernels.triton_quant import quant_partial_rows, supports


def _out(part):
    m, l, acc = part
    return acc / l.unsqueeze(-1)


@pytest.mark.parametrize("d,bits,group", [(64, 2, 64), (64, 4, 32), (128, 2, 32), (64, 8, 32), (128, 4, 64)])
@pytest.mark.parametrize("masked", [False, True])
def test_row_kernel_matches_the_general_kernel(d, bits, group, masked):
    seg, _ = kivi_case(2, 2, 192, d, bits, group, seed=d + bits)
    q = torch.randn(2, 2, 4, d, generator=torch.Generator().manual_seed(1)) / d**0.5
    valid = None
    if masked:
        valid = torch.ones(2, 192, dtype=torch.bool)
        valid[1, :70] = False
    assert supports(q, seg)
    rows, general = quant_partial_rows(q, seg, valid), quant_partial_triton(q, seg, valid)
    torch.testing.assert_close(_out(rows), _out(general), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(rows[0], general[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("gqa", [1, 8])
def test_decode_attention_on_the_triton_path_matches_the_reference(gqa):
    seg, tail = kivi_case(1, 2, 256, 64, 2, 64, seed=gqa)
    q = torch.randn(1, 2 * gqa, 1, 64, generator=torch.Generator().manual_seed(2))
    out, _ = decode_attention(q, [seg, tail], use_triton=True)
    ref, _ = reference_attention(q, [seg, tail])
    torch.testing.assert_close(out, ref, atol=3e-6, rtol=1e-5)


def test_widths_and_shapes_outside_the_row_kernel_go_to_the_general_kernel():
    seg3, _ = kivi_case(1, 1, 64, 64, 3, 32, seed=0)  # 3-bit codes straddle bytes
    q = group_queries(torch.randn(1, 1, 1, 64), 1)
    assert not supports(q, seg3)
    seg_small, _ = kivi_case(1, 1, 64, 32, 2, 32, seed=0)  # 8 bytes a token row: below a 16-byte vector
    assert not supports(group_queries(torch.randn(1, 1, 1, 32), 1), seg_small)
    query = torch.randn(1, 1, 1, 64, generator=torch.Generator().manual_seed(3))
    out, _ = decode_attention(query, [seg3], use_triton=True)
    ref, _ = reference_attention(query, [seg3])
    torch.testing.assert_close(out, ref, atol=3e-6, rtol=1e-5)
