"""Triton kernel for attention over a `TokenSegment` (the uniform cache's per-token codes): the softmax partial.

One program per (batch * kv_head, token split), as `triton_decode`: codes are unpacked and dequantized in registers
tile by tile, each key with its own scale (and zero) per group of channels. Pre-RoPE keys (`key_codec`) are brought
back in registers: each channel's shift and scale, then RoPE at the slot's position (angles computed in the kernel
from the positions and the RoPE's frequencies, as `rope.KeyRotation.rotate_at` computes them), the partner channel
of `rotate_half` unpacked from the same codes. The reference is `TokenSegment.dequantize` + softmax attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segments import TokenSegment
from .triton_decode import (BLOCK_T, _online_step, _program, _scores, _store_partial, _unpack, interpreting, merge_splits,
                            padded_rows, split_plan)


@triton.jit
def _token_values(c_ptr, s_ptr, z_ptr, t, cols, tmask, c_row, BITS: tl.constexpr, GROUP: tl.constexpr,
                  NG: tl.constexpr, HAS_ZERO: tl.constexpr, OFFSET: tl.constexpr):
    """Per-token codes of channels `cols` for tokens `t` -> float32 `[BLOCK, len(cols)]` (x = code * s + z, or
    (code - OFFSET) * s for a symmetric format)."""
    codes = _unpack(c_ptr, t[:, None] * c_row, cols[None, :], tmask[:, None], BITS).to(tl.float32)
    off = t[:, None] * NG + (cols // GROUP)[None, :]
    scale = tl.load(s_ptr + off, mask=tmask[:, None], other=0.0).to(tl.float32)
    if HAS_ZERO:
        return codes * scale + tl.load(z_ptr + off, mask=tmask[:, None], other=0.0).to(tl.float32)
    return (codes - OFFSET) * scale


@triton.jit
def _token_attn_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, shift_ptr, cscale_ptr, pos_ptr, freq_ptr, valid_ptr,
    m_ptr, l_ptr, acc_ptr,
    n_tok, kv_heads, tokens_per_split, kc_row, vc_row, stats_batched, pos_batched, rope_scaling,
    HAS_VALID: tl.constexpr, PREROPE: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    K_ZERO: tl.constexpr, V_ZERO: tl.constexpr, DOT_F32: tl.constexpr,
):
    bh, split, n_split, b, rows, cols, q = _program(q_ptr, kv_heads, M_PAD, D)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    KG: tl.constexpr = D // K_GROUP
    VG: tl.constexpr = D // V_GROUP
    kc = kc_ptr + bh * n_tok * kc_row
    ks = ks_ptr + bh * n_tok * KG
    kz = kz_ptr + bh * n_tok * KG
    vc = vc_ptr + bh * n_tok * vc_row
    vs = vs_ptr + bh * n_tok * VG
    vz = vz_ptr + bh * n_tok * VG
    HALF: tl.constexpr = D // 2
    partner = (cols + HALF) % D  # rotate_half pairs channel d with d +- D/2
    if PREROPE:
        stats = (b * stats_batched * kv_heads + bh % kv_heads) * D
        shift = tl.load(shift_ptr + stats + cols)
        cscale = tl.load(cscale_ptr + stats + cols)
        p_shift = tl.load(shift_ptr + stats + partner)
        p_cscale = tl.load(cscale_ptr + stats + partner)
        freq = tl.load(freq_ptr + cols % HALF)
        sign = tl.where(cols < HALF, -1.0, 1.0)
    t_start = split * tokens_per_split
    t_end = tl.minimum(t_start + tokens_per_split, n_tok)
    for t0 in range(t_start, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tmask = t < t_end
        k = _token_values(kc, ks, kz, t, cols, tmask, kc_row, K_BITS, K_GROUP, KG, K_ZERO, (1 << (K_BITS - 1)) - 1)
        if PREROPE:
            kp = _token_values(kc, ks, kz, t, partner, tmask, kc_row, K_BITS, K_GROUP, KG, K_ZERO,
                               (1 << (K_BITS - 1)) - 1)
            k = k * cscale[None, :] + shift[None, :]
            kp = kp * p_cscale[None, :] + p_shift[None, :]
            pos = tl.load(pos_ptr + b * pos_batched * n_tok + t, mask=tmask, other=0).to(tl.float32)
            angle = pos[:, None] * freq[None, :]
            k = (k * tl.cos(angle) + sign[None, :] * kp * tl.sin(angle)) * rope_scaling
        s = _scores(q, k, DOT_F32)
        valid = tmask
        if HAS_VALID:
            valid = valid & (tl.load(valid_ptr + b * n_tok + t, mask=tmask, other=0) != 0)
        v = _token_values(vc, vs, vz, t, cols, tmask, vc_row, V_BITS, V_GROUP, VG, V_ZERO, (1 << (V_BITS - 1)) - 1)
        v = tl.where(tmask[:, None], v, 0.0)
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, v, valid, DOT_F32)
    _store_partial(m_ptr, l_ptr, acc_ptr, m_i, l_i, acc, bh, split, n_split, rows, cols, M_PAD, D)


def supports_tokens(q: torch.Tensor, seg: TokenSegment) -> bool:
    """Integer codes of 2, 4 or 8 bits, keys and values of head_dim a power of two in 16..256."""
    k, v = seg.keys, seg.values
    d = q.shape[-1]
    return (k.fmt == "int" and v.fmt == "int" and k.bits in (2, 4, 8) and v.bits in (2, 4, 8) and k.n == v.n == d
            and d in (16, 32, 64, 128, 256))


def token_partial_triton(q: torch.Tensor, seg: TokenSegment, key_valid: torch.Tensor | None,
                         dot_f32: bool | None = None):
    """(m, l, acc) of `q` [B, Hkv, M, D] (already scaled) over `seg`, split along tokens then merged; `dot_f32`: the
    IEEE fp32 dots, or fp16 operands with fp32 accumulation (None: fp32 for fp32 queries and under the
    interpreter)."""
    b, h, m, d = q.shape
    n_tok = seg.tokens
    qp, m_pad = padded_rows(q)
    k, v = seg.keys, seg.values
    parts = [k.codes.contiguous(), k.scale.contiguous(), (k.zero if k.zero is not None else k.scale).contiguous(),
             v.codes.contiguous(), v.scale.contiguous(), (v.zero if v.zero is not None else v.scale).contiguous()]
    codec = seg.key_codec
    if codec is not None:
        shift = codec.shift.float().reshape(-1, h, d).contiguous()
        cscale = codec.scale.float().reshape(-1, h, d).contiguous()
        positions = seg.positions.reshape(-1, n_tok).to(torch.int32).contiguous()
        freq = codec.rope.inv_freq.to(q.device, torch.float32).contiguous()
        frame = [shift, cscale, positions, freq]
        stats_batched, pos_batched, scaling = int(shift.shape[0] > 1), int(positions.shape[0] > 1), codec.rope.scaling
    else:
        frame, stats_batched, pos_batched, scaling = [qp, qp, qp, qp], 0, 0, 1.0
    valid = key_valid.to(torch.int8).contiguous() if key_valid is not None else parts[0]
    dot_f32 = interpreting() or (q.dtype == torch.float32 if dot_f32 is None else dot_f32)
    n_split, per_split, (m_out, l_out, acc_out) = split_plan(q, n_tok, m_pad)
    _token_attn_kernel[(b * h, n_split)](
        qp, *parts, *frame, valid, m_out, l_out, acc_out, n_tok, h, per_split, parts[0].shape[-1],
        parts[3].shape[-1], stats_batched, pos_batched, scaling,
        HAS_VALID=key_valid is not None, PREROPE=codec is not None, M_PAD=m_pad, D=d, BLOCK=BLOCK_T,
        K_BITS=k.bits, V_BITS=v.bits, K_GROUP=k.group_size, V_GROUP=v.group_size, K_ZERO=k.zero is not None,
        V_ZERO=v.zero is not None, DOT_F32=dot_f32,
    )
    return merge_splits(m_out, l_out, acc_out, q.shape)
