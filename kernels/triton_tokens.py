"""Triton kernel for attention over a `TokenSegment` (the uniform cache's per-token codes): the softmax partial.

One program per (batch * kv_head, token split), as `triton_decode`. Each token's codes are read as one row of bytes
and unpacked by shifts in registers (`triton_quant._code_rows`), its scales (and zeros) per group of channels
expanded alongside. Pre-RoPE keys (`key_codec`) are brought back in registers in two halves, channels `[0, D/2)` and
`[D/2, D)` (the pairs of `rotate_half`): each half's shift and scale, then RoPE at the slot's position (angles from
the positions and the RoPE's frequencies, as `rope.KeyRotation.rotate_at` computes them, reduced to [-pi, pi] in
the kernel), the scores summed over two dots of D/2 channels. Reference: `TokenSegment.dequantize` + softmax
attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .segments import TokenSegment
from .triton_decode import (_online_step, _program, _scores, _store_partial, interpreting, merge_splits, padded_rows,
                            split_plan)
from .triton_quant import _code_rows

# the launch, chosen from a GPU sweep (one H200, `benchmarks/gpu/sweep_tokens.py`, docs/gpu/README.md): with fp16 /
# bf16 dots at head dims up to 128, tiles of 64 tokens on 4 warps and token splits for 8 programs per SM (the 16-token,
# 8-warp launch, chosen earlier from the compiled cubins alone for no spill, ran 2.5-3.7x slower there); fp32 dots and
# head dim 256 keep that launch (the larger tile spills there; not timed on a GPU)
TOKEN_BLOCK, TOKEN_WARPS, TOKEN_WAVES = 64, 4, 8
SMALL_BLOCK, SMALL_WARPS, SMALL_WAVES = 16, 8, 2


def token_launch(head_dim: int, dot_f32: bool) -> tuple[int, int, int]:
    """(tokens per tile, warps, programs per SM) of the token kernel's default launch for `head_dim` and the dots'
    precision."""
    if head_dim <= 128 and not dot_f32:
        return TOKEN_BLOCK, TOKEN_WARPS, TOKEN_WAVES
    return SMALL_BLOCK, SMALL_WARPS, SMALL_WAVES


@triton.jit
def _token_rows(c_ptr, s_ptr, z_ptr, t, tmask, c_row, COL0: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr,
                BITS: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, HAS_ZERO: tl.constexpr,
                OFFSET: tl.constexpr):
    """Channels `COL0 .. COL0 + W` of tokens `t`, dequantized: float32 `[BLOCK, W]` (x = code * s + z, or
    (code - OFFSET) * s for a symmetric format). Each token's codes are read as one row of bytes and unpacked by shifts
    (`triton_quant._code_rows`); its scales (and zeros), one per group of GROUP channels, are expanded in registers."""
    codes = _code_rows(c_ptr + COL0 * BITS // 8, t, tmask, c_row, BLOCK, W, BITS).to(tl.float32)
    if GROUP >= W:  # one scale per token over these channels
        off = t * NG + COL0 // GROUP
        scale = tl.load(s_ptr + off, mask=tmask, other=0.0).to(tl.float32)[:, None]
        zero = tl.load(z_ptr + off, mask=tmask, other=0.0).to(tl.float32)[:, None] if HAS_ZERO else 0.0
    else:
        WG: tl.constexpr = W // GROUP
        off = t[:, None] * NG + COL0 // GROUP + tl.arange(0, WG)[None, :]
        scale = tl.load(s_ptr + off, mask=tmask[:, None], other=0.0).to(tl.float32)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK, WG, GROUP]), [BLOCK, W])
        if HAS_ZERO:
            zero = tl.load(z_ptr + off, mask=tmask[:, None], other=0.0).to(tl.float32)
            zero = tl.reshape(tl.broadcast_to(zero[:, :, None], [BLOCK, WG, GROUP]), [BLOCK, W])
        else:
            zero = 0.0
    if HAS_ZERO:
        return codes * scale + zero
    return (codes - OFFSET) * scale


@triton.jit
def _cos_sin(angle, FAST: tl.constexpr):
    """cos and sin of float32 `angle`: reduced to [-pi, pi] first (Cody-Waite, 2 pi in three parts), then the GPU's
    fast approximations (`FAST`: no slow-path argument reduction, so no stack frame) or `tl.cos` / `tl.sin`."""
    k = tl.floor(angle * 0.15915494309189535 + 0.5)
    r = tl.fma(-k, 6.28125, angle)
    r = tl.fma(-k, 0.0019353071693331003, r)
    r = tl.fma(-k, 1.0253131677018246e-11, r)
    if FAST:
        return libdevice.fast_cosf(r), libdevice.fast_sinf(r)
    return tl.cos(r), tl.sin(r)


@triton.jit
def _token_attn_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, shift_ptr, cscale_ptr, pos_ptr, freq_ptr, valid_ptr,
    m_ptr, l_ptr, acc_ptr,
    n_tok, kv_heads, tokens_per_split, kc_row, vc_row, stats_batched, pos_batched, rope_scaling,
    HAS_VALID: tl.constexpr, PREROPE: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    K_ZERO: tl.constexpr, V_ZERO: tl.constexpr, DOT_F32: tl.constexpr, FAST_TRIG: tl.constexpr,
):
    bh, split, n_split, b, rows, cols, q = _program(q_ptr, kv_heads, M_PAD, D)  # q unused (DCE'd) with PREROPE
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    KG: tl.constexpr = D // K_GROUP
    VG: tl.constexpr = D // V_GROUP
    K_OFF: tl.constexpr = (1 << (K_BITS - 1)) - 1
    V_OFF: tl.constexpr = (1 << (V_BITS - 1)) - 1
    kc = kc_ptr + bh * n_tok * kc_row
    ks = ks_ptr + bh * n_tok * KG
    kz = kz_ptr + bh * n_tok * KG
    vc = vc_ptr + bh * n_tok * vc_row
    vs = vs_ptr + bh * n_tok * VG
    vz = vz_ptr + bh * n_tok * VG
    HALF: tl.constexpr = D // 2
    if PREROPE:
        # rotate_half pairs channel d with d + D/2: the keys are read, and the scores summed, in two halves
        q_rows = q_ptr + bh * M_PAD * D + rows[:, None] * D
        half = tl.arange(0, HALF)
        q1 = tl.load(q_rows + half[None, :])
        q2 = tl.load(q_rows + HALF + half[None, :])
        stats = (b * stats_batched * kv_heads + bh % kv_heads) * D
        shift1 = tl.load(shift_ptr + stats + half)
        shift2 = tl.load(shift_ptr + stats + HALF + half)
        cscale1 = tl.load(cscale_ptr + stats + half)
        cscale2 = tl.load(cscale_ptr + stats + HALF + half)
        freq = tl.load(freq_ptr + half)
    t_start = split * tokens_per_split
    t_end = tl.minimum(t_start + tokens_per_split, n_tok)
    for t0 in range(t_start, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tmask = t < t_end
        if PREROPE:
            k1 = _token_rows(kc, ks, kz, t, tmask, kc_row, 0, BLOCK, HALF, K_BITS, K_GROUP, KG, K_ZERO, K_OFF)
            k2 = _token_rows(kc, ks, kz, t, tmask, kc_row, HALF, BLOCK, HALF, K_BITS, K_GROUP, KG, K_ZERO, K_OFF)
            k1 = k1 * cscale1[None, :] + shift1[None, :]
            k2 = k2 * cscale2[None, :] + shift2[None, :]
            pos = tl.load(pos_ptr + b * pos_batched * n_tok + t, mask=tmask, other=0).to(tl.float32)
            angle = pos[:, None] * freq[None, :]
            cos, sin = _cos_sin(angle, FAST_TRIG)
            cos, sin = cos * rope_scaling, sin * rope_scaling
            s = _scores(q1, k1 * cos - k2 * sin, DOT_F32) + _scores(q2, k2 * cos + k1 * sin, DOT_F32)
        else:
            k = _token_rows(kc, ks, kz, t, tmask, kc_row, 0, BLOCK, D, K_BITS, K_GROUP, KG, K_ZERO, K_OFF)
            s = _scores(q, k, DOT_F32)
        valid = tmask
        if HAS_VALID:
            valid = valid & (tl.load(valid_ptr + b * n_tok + t, mask=tmask, other=0) != 0)
        v = _token_rows(vc, vs, vz, t, tmask, vc_row, 0, BLOCK, D, V_BITS, V_GROUP, VG, V_ZERO, V_OFF)
        v = tl.where(tmask[:, None], v, 0.0)
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, v, valid, DOT_F32)
    _store_partial(m_ptr, l_ptr, acc_ptr, m_i, l_i, acc, bh, split, n_split, rows, cols, M_PAD, D)


def supports_tokens(q: torch.Tensor, seg: TokenSegment) -> bool:
    """Integer codes of 2, 4 or 8 bits, keys and values of head_dim a power of two in 32..256 (pre-RoPE keys are
    read in halves, each a dot of at least 16 channels), channel groups a power of two."""
    k, v = seg.keys, seg.values
    d = q.shape[-1]
    groups = (k.group_size, v.group_size)
    return (k.fmt == "int" and v.fmt == "int" and k.bits in (2, 4, 8) and v.bits in (2, 4, 8) and k.n == v.n == d
            and d in (32, 64, 128, 256) and all(g & (g - 1) == 0 and d % g == 0 for g in groups))


def token_partial_triton(q: torch.Tensor, seg: TokenSegment, key_valid: torch.Tensor | None,
                         dot_f32: bool | None = None, merged: bool = True, block: int | None = None,
                         num_warps: int | None = None, waves: int | None = None, num_stages: int | None = None):
    """(m, l, acc) of `q` [B, Hkv, M, D] (already scaled) over `seg`, split along tokens then merged.

    Args:
        dot_f32: the IEEE fp32 dots, or fp16 operands with fp32 accumulation (None: fp32 for fp32 queries and under
            the interpreter). merged: False returns the per-split partials (m, l `[B*Hkv, S, M_PAD]`, acc
            `[..., D]`). block, num_warps, waves, num_stages: tokens per tile, warps per program, programs per SM,
            software-pipeline stages (None: `token_launch`'s, and Triton's default stages; the launch knobs
            `hf-kvcache gpu-check` sweeps).
    """
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
    default_block, default_warps, default_waves = token_launch(d, dot_f32)
    block, num_warps, waves = block or default_block, num_warps or default_warps, waves or default_waves
    n_split, per_split, (m_out, l_out, acc_out) = split_plan(q, n_tok, m_pad, block, waves)
    _token_attn_kernel[(b * h, n_split)](
        qp, *parts, *frame, valid, m_out, l_out, acc_out, n_tok, h, per_split, parts[0].shape[-1],
        parts[3].shape[-1], stats_batched, pos_batched, scaling,
        HAS_VALID=key_valid is not None, PREROPE=codec is not None, M_PAD=m_pad, D=d, BLOCK=block,
        K_BITS=k.bits, V_BITS=v.bits, K_GROUP=k.group_size, V_GROUP=v.group_size, K_ZERO=k.zero is not None,
        V_ZERO=v.zero is not None, DOT_F32=dot_f32, FAST_TRIG=not interpreting(), num_warps=num_warps,
        **({} if num_stages is None else dict(num_stages=num_stages)),
    )
    return merge_splits(m_out, l_out, acc_out, q.shape) if merged else (m_out, l_out, acc_out)
