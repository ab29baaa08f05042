"""Triton kernel for decode attention over a `QuantSegment` (KIVI layout), built for the GPU's memory system: the
softmax partial (m, l, acc), one program per (batch * kv_head, token split).

How it differs from `triton_decode._quant_attn_kernel` (kept as the general fallback and the mass kernel):
- codes are read a token row at a time (`D * bits / 8` contiguous bytes, vector loads) and unpacked with shifts into
  `[BLOCK, D]` in registers, instead of one byte gather per code;
- one tile is one key group (`BLOCK = K_GROUP` tokens), so the group's per-channel key scale and zero fold into the
  query: `q . k_t = (q * s) . c_t + q . z`, and the key codes enter the dot as exact small integers (no per-element
  scale or zero is loaded or multiplied);
- `DOT_F32=False` (models in fp16 / bf16) runs both dots on fp16 tensor-core operands with fp32 accumulation: codes
  are exact in fp16, `q * s`, the probabilities and the dequantized values keep 11 mantissa bits (bf16 keeps 8);
  `DOT_F32=True` (fp32 models, and the interpreter, whose low-precision dots are wrong) keeps the IEEE fp32 dots;
- the queries are read unpadded (rows past `n_rows` masked), so no padded copy is made per call.

Widths 2, 4 and 8 bits (a byte holds whole codes), `D * bits / 8 >= 16`, `K_GROUP` in 16..128; `supports` says so.
Reference: `decode_attention.reference_attention` (and the tests' comparison under the interpreter).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .segments import QuantSegment
from .triton_decode import _segment_bases, interpreting, merge_splits, sm_count


# the launch defaults, read off the H200 sweeps (docs/gpu/README.md): splits of at most ~2K tokens (a program that
# walks more tiles leaves the memory system idle between them); fp16 / bf16 dots at head dims up to 128 take 2 warps
# and at least 4 programs per SM (fastest of the 2026-11-28 sweep in every case it timed), the rest 4 warps and 2
SPLIT_TOKENS = 2048
ROWS_WARPS, ROWS_WAVES = 2, 4
WIDE_WARPS, WIDE_WAVES = 4, 2


def rows_launch(head_dim: int, dot_f32: bool) -> tuple[int, int]:
    """(warps, programs per SM) of the row-wise kernel's default launch for `head_dim` and the dots' precision."""
    if head_dim <= 128 and not dot_f32:
        return ROWS_WARPS, ROWS_WAVES
    return WIDE_WARPS, WIDE_WAVES


@triton.jit
def _code_rows(base, t, tmask, row_stride, BLOCK: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Codes `[BLOCK, D]` (int32) of tokens `t`: each token's packed row read as bytes, unpacked by shifts (code d at
    bit BITS * d of the little-endian row)."""
    PER: tl.constexpr = 8 // BITS  # codes per byte
    NB: tl.constexpr = D // PER  # bytes per token
    nb = tl.arange(0, NB)
    raw = tl.load(base + t[:, None] * row_stride + nb[None, :], mask=tmask[:, None], other=0).to(tl.int32)
    if BITS == 8:
        return raw
    shifts = tl.arange(0, PER) * BITS
    codes = (raw[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [BLOCK, D])


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(tl.float16), b.to(tl.float16))


@triton.jit
def _quant_attn_rows_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, valid_ptr, out_ptr,
    n_tok, kv_heads, n_rows, tokens_per_split, kc_row, vc_row,
    HAS_VALID: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    K_GROUP: tl.constexpr, V_GROUP: tl.constexpr, DOT_F32: tl.constexpr,
):
    BLOCK: tl.constexpr = K_GROUP
    NVG: tl.constexpr = D // V_GROUP
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    b = bh // kv_heads
    rows = tl.arange(0, M_PAD)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + bh * n_rows * D + rows[:, None] * D + cols[None, :], mask=(rows < n_rows)[:, None], other=0.0)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    kc, ks, kz, vc, vs, vz = _segment_bases(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bh, n_tok, kc_row,
                                            vc_row, D, K_GROUP, NVG)
    vg = tl.arange(0, NVG)
    t_start = split * tokens_per_split
    t_end = tl.minimum(t_start + tokens_per_split, n_tok)
    for t0 in range(t_start, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tmask = t < t_end
        # keys: the group's scale and zero folded into the query
        scale = tl.load(ks + (t0 // K_GROUP) * D + cols).to(tl.float32)
        zero = tl.load(kz + (t0 // K_GROUP) * D + cols).to(tl.float32)
        kcodes = _code_rows(kc, t, tmask, kc_row, BLOCK, D, K_BITS).to(tl.float32)
        s = _dot(q * scale[None, :], tl.trans(kcodes), DOT_F32) + tl.sum(q * zero[None, :], 1)[:, None]
        valid = tmask
        if HAS_VALID:
            valid = valid & (tl.load(valid_ptr + b * n_tok + t, mask=tmask, other=0) != 0)
        s = tl.where(valid[None, :], s, float("-inf"))
        # values: per token and group of channels, expanded along the group in registers
        v_off = t[:, None] * NVG + vg[None, :]
        v_scale = tl.load(vs + v_off, mask=tmask[:, None], other=0.0).to(tl.float32)
        v_zero = tl.load(vz + v_off, mask=tmask[:, None], other=0.0).to(tl.float32)
        if NVG > 1:
            v_scale = tl.reshape(tl.broadcast_to(v_scale[:, :, None], [BLOCK, NVG, V_GROUP]), [BLOCK, D])
            v_zero = tl.reshape(tl.broadcast_to(v_zero[:, :, None], [BLOCK, NVG, V_GROUP]), [BLOCK, D])
        vcodes = _code_rows(vc, t, tmask, vc_row, BLOCK, D, V_BITS).to(tl.float32)
        v = tl.where(tmask[:, None], vcodes * v_scale + v_zero, 0.0)
        # online softmax
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
        m_i = m_new
    # one row per (program, query row): m, l, then the D outputs
    row = ((bh * n_split + split) * M_PAD + rows) * (D + 2)
    tl.store(out_ptr + row, m_i)
    tl.store(out_ptr + row + 1, l_i)
    tl.store(out_ptr + row[:, None] + 2 + cols[None, :], acc)


def supports(q: torch.Tensor, seg: QuantSegment) -> bool:
    """Whether this kernel serves `seg` for queries `q` [B, Hkv, M, D] (else `triton_decode` does)."""
    d = q.shape[-1]
    return (seg.k_bits in (2, 4, 8) and seg.v_bits in (2, 4, 8) and d in (32, 64, 128, 256) and seg.head_dim == d
            and d * min(seg.k_bits, seg.v_bits) // 8 >= 16 and seg.k_group in (16, 32, 64, 128)
            and d % seg.v_group == 0 and q.shape[2] <= 128)


def quant_partial_rows(q: torch.Tensor, seg: QuantSegment, key_valid: torch.Tensor | None,
                       dot_f32: bool | None = None, num_warps: int | None = None, waves: int | None = None,
                       split_tokens: int = SPLIT_TOKENS, merged: bool = True, num_stages: int | None = None):
    """(m, l, acc) of `q` [B, Hkv, M, D] (float32, already scaled) over `seg`, split along tokens then merged.

    Args:
        key_valid: `[B, T]` bool (True = attend) or None.
        dot_f32: IEEE fp32 dots (None: under the interpreter only); False runs fp16 operands, fp32 accumulation.
        num_warps: warps per program. waves: programs per SM the token splits aim at at least (None: `rows_launch`).
        split_tokens: tokens per split at most (more splits where batch x heads already fill the waves).
        merged: False returns the per-split partials unmerged (for `triton_step.step_attention`).
        num_stages: software-pipeline stages (None: Triton's default).
    Returns:
        m, l `[B, Hkv, M]` and acc `[B, Hkv, M, D]` (float32); unmerged: m, l `[B*Hkv, S, M_PAD]`, acc
        `[B*Hkv, S, M_PAD, D]` (views of one buffer).
    """
    b, h, m, d = q.shape
    n_tok = seg.tokens
    q = q.float().contiguous()
    m_pad = max(16, triton.next_power_of_2(m))
    block = seg.k_group
    if dot_f32 is None:
        dot_f32 = interpreting()
    default_warps, default_waves = rows_launch(d, dot_f32)
    num_warps = default_warps if num_warps is None else num_warps
    waves = default_waves if waves is None else waves
    sms = sm_count(q.device.index or 0) if q.is_cuda else 4
    wanted = max(triton.cdiv(waves * sms, b * h), triton.cdiv(n_tok, split_tokens))
    n_split = max(1, min(triton.cdiv(n_tok, block), wanted))
    per_split = triton.cdiv(triton.cdiv(n_tok, n_split), block) * block
    n_split = triton.cdiv(n_tok, per_split)
    out = torch.empty(b * h, n_split, m_pad, d + 2, device=q.device, dtype=torch.float32)
    m_out, l_out, acc_out = out[..., 0], out[..., 1], out[..., 2:]
    parts = [seg.k_codes, seg.k_scale, seg.k_zero, seg.v_codes, seg.v_scale, seg.v_zero]
    valid = key_valid.to(torch.int8).contiguous() if key_valid is not None else parts[0]
    _quant_attn_rows_kernel[(b * h, n_split)](
        q, *parts, valid, out, n_tok, h, m, per_split, parts[0].shape[-1], parts[3].shape[-1],
        HAS_VALID=key_valid is not None, M_PAD=m_pad, D=d, K_BITS=seg.k_bits, V_BITS=seg.v_bits,
        K_GROUP=seg.k_group, V_GROUP=seg.v_group, DOT_F32=dot_f32 or interpreting(), num_warps=num_warps,
        **({} if num_stages is None else dict(num_stages=num_stages)),
    )
    return merge_splits(m_out, l_out, acc_out, q.shape) if merged else (m_out, l_out, acc_out)
