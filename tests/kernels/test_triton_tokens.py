"""The per-token Triton decode kernel (`kernels.triton_tokens`, the uniform caches' codes) against the
dequantize-then-softmax reference under the interpreter: every head dim it serves, int4 / int8 / 2-bit codes with and
without zeros, keys pre-RoPE (read in two halves, RoPE angles reduced in the kernel) or as they come, positions far
from zero, key masks, GQA, and queries of an fp16 / bf16 model."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache.kernels.decode_attention import decode_attention, reference_attention
from hf_kvcache.kernels.triton_tokens import (SMALL_BLOCK, SMALL_WARPS, TOKEN_BLOCK, TOKEN_WARPS, supports_tokens,
                                             token_partial_triton)
from random_kv import token_segment


def _out(part):
    m, l, acc = part
    return acc / l.unsqueeze(-1)


@pytest.mark.parametrize(
    "d,dtype,group_size,symmetric,prerope,start",
    [(32, "int4", None, None, True, 0), (64, "int4", None, None, True, 0), (64, "int8", None, None, False, 0),
     (128, "int4", 16, False, True, 120_000), (128, "int8", None, None, True, 40_000),
     (128, "int4", 32, False, False, 0), (256, "int4", None, None, True, 7_000), (256, "int8", 64, False, False, 0)],
)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("launch", [(SMALL_BLOCK, SMALL_WARPS), (TOKEN_BLOCK, TOKEN_WARPS)])
def test_token_kernel_matches_the_reference(d, dtype, group_size, symmetric, prerope, start, masked, launch):
    """Tokens not a multiple of the tile, a left-padded second row (its own positions), 4 query heads per KV head;
    both default launches (`token_launch`: the large tile for fp16 dots at head dims up to 128, the small one
    elsewhere; the interpreter runs fp32 dots, so each launch is named here)."""
    t = 3 * TOKEN_BLOCK + 5
    pad = (0, 9) if masked else (0,)
    seg = token_segment(2, 2, t, d, dtype, group_size, symmetric, prerope=prerope, pad=pad, seed=d, start=start)
    q = torch.randn(2, 2, 4, d, generator=torch.Generator().manual_seed(1)) / d**0.5
    valid = None
    if masked:
        valid = torch.ones(2, t, dtype=torch.bool)
        valid[1, :9] = False
    assert supports_tokens(q, seg)
    keys, values = seg.dequantize(torch.float32)
    logits = q @ keys.transpose(-1, -2)
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None], float("-inf"))
    ref = torch.softmax(logits, -1) @ values
    got = _out(token_partial_triton(q, seg, valid, block=launch[0], num_warps=launch[1]))
    # measured up to 1.3e-6 (1.1e-6 with keys pre-RoPE at positions near 120K: the angles are float32 either way)
    torch.testing.assert_close(got, ref, atol=2.5e-6, rtol=1e-5)


@pytest.mark.parametrize("qdtype", [torch.float16, torch.bfloat16])
def test_decode_attention_takes_half_precision_queries_on_the_token_kernel(qdtype):
    """A model in fp16 / bf16 hands its queries in that dtype: the Triton path (8 query heads per KV head) returns
    the reference's output in the queries' dtype."""
    seg = token_segment(1, 2, 70, 128, "int4", prerope=True, seed=3, start=500)
    q = torch.randn(1, 16, 1, 128, generator=torch.Generator().manual_seed(2)).to(qdtype)
    out, _ = decode_attention(q, [seg], use_triton=True)
    ref, _ = reference_attention(q.float(), [seg])
    assert out.dtype == qdtype
    # measured: 2.4e-4 (fp16) and 1.8e-3 (bf16), the rounding of an output of scale 0.8 to the queries' dtype
    torch.testing.assert_close(out.float(), ref, atol=4e-3 if qdtype == torch.bfloat16 else 5e-4, rtol=0)


def test_the_token_kernel_leaves_what_it_cannot_read_to_the_fallback():
    """Head dims below 32 (a half of pre-RoPE keys would be a dot under 16 channels) and fp8 codes are not served."""
    assert not supports_tokens(torch.randn(1, 1, 1, 16), token_segment(1, 1, 8, 16, "int4", group_size=16))
    assert not supports_tokens(torch.randn(1, 1, 1, 64), token_segment(1, 1, 8, 64, "fp8_e4m3"))
    assert supports_tokens(torch.randn(1, 1, 1, 32), token_segment(1, 1, 8, 32, "int4"))
