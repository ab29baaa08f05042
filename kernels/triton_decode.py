"""Triton kernels for attention over a `QuantSegment`: the partial (m, l, acc) and the per-key attention mass.

One program per (batch * kv_head, token split). Codes are unpacked and dequantized in registers, tile by tile; the
cache is never expanded in memory. Rows are the query heads of the KV group times the query positions, padded to 16
for `tl.dot`. The torch reference is `decode_attention._quant_partial_torch` / `reference_attention`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .segments import QuantSegment

BLOCK_T = 64


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _unpack(base, row_off, col, tmask, BITS: tl.constexpr):
    """Code `col` of each row, from a little-endian bit stream (code d at bit BITS * d)."""
    bit = col * BITS
    byte0 = bit >> 3
    sh = bit & 7
    word = tl.load(base + row_off + byte0, mask=tmask, other=0).to(tl.int32)
    if (8 % BITS) != 0:
        straddles = tmask & ((sh + BITS) > 8)
        hi = tl.load(base + row_off + byte0 + 1, mask=straddles, other=0).to(tl.int32)
        word = word | (hi << 8)
    return (word >> sh) & ((1 << BITS) - 1)


@triton.jit
def _dequant_keys(kc, ks, kz, t, cols, tmask, n_tok, kc_row, D: tl.constexpr, K_BITS: tl.constexpr,
                  K_GROUP: tl.constexpr):
    codes = _unpack(kc, t[:, None] * kc_row, cols[None, :], tmask[:, None], K_BITS)
    g_off = (t // K_GROUP)[:, None] * D + cols[None, :]
    scale = tl.load(ks + g_off, mask=tmask[:, None], other=0.0).to(tl.float32)
    zero = tl.load(kz + g_off, mask=tmask[:, None], other=0.0).to(tl.float32)
    return codes.to(tl.float32) * scale + zero


@triton.jit
def _scores(q, k, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q.to(tl.float16), tl.trans(k).to(tl.float16))


@triton.jit
def _program(q_ptr, kv_heads, M_PAD: tl.constexpr, D: tl.constexpr):
    """This program's (batch * kv_head, token split, splits, batch row, row and channel ranges, its queries)."""
    bh = tl.program_id(0)
    rows = tl.arange(0, M_PAD)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + bh * M_PAD * D + rows[:, None] * D + cols[None, :])
    return bh, tl.program_id(1), tl.num_programs(1), bh // kv_heads, rows, cols, q


@triton.jit
def _segment_bases(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bh, n_tok, kc_row, vc_row, D: tl.constexpr,
                   K_GROUP: tl.constexpr, NVG: tl.constexpr):
    """The six pointers of one (batch, kv_head) row of a KIVI-layout segment: key codes, scales, zeros (one row per
    group of K_GROUP tokens), value codes, scales, zeros (NVG per token)."""
    ks = ks_ptr + bh * (n_tok // K_GROUP) * D
    kz = kz_ptr + bh * (n_tok // K_GROUP) * D
    return (kc_ptr + bh * n_tok * kc_row, ks, kz, vc_ptr + bh * n_tok * vc_row, vs_ptr + bh * n_tok * NVG,
            vz_ptr + bh * n_tok * NVG)


@triton.jit
def _online_step(m_i, l_i, acc, s, v, valid, DOT_F32: tl.constexpr, PV_IN_V_DTYPE: tl.constexpr = False):
    """One tile of flash-decoding: scores `s [M_PAD, BLOCK]` (keys where `valid`), values `v [BLOCK, D]` folded into
    the running row max, row sum and unnormalized output. The values' dot: IEEE fp32 (`DOT_F32`), else on fp16
    operands, or on operands of v's own dtype (`PV_IN_V_DTYPE`: bf16 values stay bf16)."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        pv = tl.dot(p, v, input_precision="ieee")
    elif PV_IN_V_DTYPE:
        pv = tl.dot(p.to(v.dtype), v)
    else:
        pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _store_partial(m_ptr, l_ptr, acc_ptr, m_i, l_i, acc, bh, split, n_split, rows, cols, M_PAD: tl.constexpr,
                   D: tl.constexpr):
    out = (bh * n_split + split) * M_PAD + rows
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)
    tl.store(acc_ptr + out[:, None] * D + cols[None, :], acc)


@triton.jit
def _quant_attn_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr,
    n_tok, kv_heads, tokens_per_split, kc_row, vc_row,
    HAS_VALID: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    bh, split, n_split, b, rows, cols, q = _program(q_ptr, kv_heads, M_PAD, D)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    NVG: tl.constexpr = D // V_GROUP
    kc, ks, kz, vc, vs, vz = _segment_bases(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bh, n_tok, kc_row,
                                            vc_row, D, K_GROUP, NVG)
    t_start = split * tokens_per_split
    t_end = tl.minimum(t_start + tokens_per_split, n_tok)
    for t0 in range(t_start, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tmask = t < t_end
        k = _dequant_keys(kc, ks, kz, t, cols, tmask, n_tok, kc_row, D, K_BITS, K_GROUP)
        s = _scores(q, k, DOT_F32)
        valid = tmask
        if HAS_VALID:
            valid = valid & (tl.load(valid_ptr + b * n_tok + t, mask=tmask, other=0) != 0)
        vcodes = _unpack(vc, t[:, None] * vc_row, cols[None, :], tmask[:, None], V_BITS)
        v_off = t[:, None] * NVG + (cols // V_GROUP)[None, :]
        v_scale = tl.load(vs + v_off, mask=tmask[:, None], other=0.0).to(tl.float32)
        v_zero = tl.load(vz + v_off, mask=tmask[:, None], other=0.0).to(tl.float32)
        v = tl.where(tmask[:, None], vcodes.to(tl.float32) * v_scale + v_zero, 0.0)
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, v, valid, DOT_F32)
    _store_partial(m_ptr, l_ptr, acc_ptr, m_i, l_i, acc, bh, split, n_split, rows, cols, M_PAD, D)


@triton.jit
def _quant_mass_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, valid_ptr, lse_ptr, mass_ptr,
    n_tok, kv_heads, n_rows, kc_row,
    HAS_VALID: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    K_BITS: tl.constexpr, K_GROUP: tl.constexpr, DOT_F32: tl.constexpr,
):
    bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = bh // kv_heads
    rows = tl.arange(0, M_PAD)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + bh * M_PAD * D + rows[:, None] * D + cols[None, :])
    lse = tl.load(lse_ptr + bh * M_PAD + rows)
    t = blk * BLOCK + tl.arange(0, BLOCK)
    tmask = t < n_tok
    kc = kc_ptr + bh * n_tok * kc_row
    ks = ks_ptr + bh * (n_tok // K_GROUP) * D
    kz = kz_ptr + bh * (n_tok // K_GROUP) * D
    k = _dequant_keys(kc, ks, kz, t, cols, tmask, n_tok, kc_row, D, K_BITS, K_GROUP)
    s = _scores(q, k, DOT_F32)
    valid = tmask
    if HAS_VALID:
        valid = valid & (tl.load(valid_ptr + b * n_tok + t, mask=tmask, other=0) != 0)
    keep = (rows < n_rows)[:, None] & valid[None, :]
    p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
    tl.store(mass_ptr + bh * n_tok + t, tl.sum(p, 0), mask=tmask)


def padded_rows(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Queries `[B, Hkv, M, D]` as float32 `[B Hkv, M_PAD, D]`, the rows padded with zeros to a power of two >= 16
    (what `tl.dot` takes), and M_PAD."""
    b, h, m, d = q.shape
    m_pad = max(16, triton.next_power_of_2(m))
    qp = torch.zeros(b * h, m_pad, d, device=q.device, dtype=torch.float32)
    qp[:, :m] = q.reshape(b * h, m, d)
    return qp, m_pad


def _launch_args(q: torch.Tensor, seg: QuantSegment, key_valid: torch.Tensor | None):
    b, h, m, d = q.shape
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"the Triton decode kernel needs head_dim a power of two in 16..256, got {d}")
    qp, m_pad = padded_rows(q)
    parts = [t.contiguous() for t in (seg.k_codes, seg.k_scale, seg.k_zero, seg.v_codes, seg.v_scale, seg.v_zero)]
    valid = key_valid.to(torch.int8).contiguous() if key_valid is not None else parts[0]
    dot_f32 = interpreting() or q.dtype == torch.float32
    return qp, parts, valid, m_pad, dot_f32


def quant_partial_triton(q: torch.Tensor, seg: QuantSegment, key_valid: torch.Tensor | None, block: int = BLOCK_T,
                         num_warps: int = 4, dot_f32: bool | None = None, waves: int = 2):
    """(m, l, acc) of `q` [B, Hkv, M, D] (already scaled) over `seg`, split along tokens then merged.

    Args:
        block: tokens per tile. num_warps: warps per program. dot_f32: the fp32 (IEEE) dots, or fp16 operands with
            fp32 accumulation (None: fp32 for fp32 queries and under the interpreter). waves: programs per SM.
    """
    b, h, m, d = q.shape
    n_tok = seg.tokens
    qp, parts, valid, m_pad, default_f32 = _launch_args(q, seg, key_valid)
    n_split, per_split, (m_out, l_out, acc_out) = split_plan(q, n_tok, m_pad, block, waves)
    _quant_attn_kernel[(b * h, n_split)](
        qp, *parts, valid, m_out, l_out, acc_out, n_tok, h, per_split, parts[0].shape[-1], parts[3].shape[-1],
        HAS_VALID=key_valid is not None, M_PAD=m_pad, D=d, BLOCK=block, K_BITS=seg.k_bits, V_BITS=seg.v_bits,
        K_GROUP=seg.k_group, V_GROUP=seg.v_group,
        DOT_F32=default_f32 if dot_f32 is None else (dot_f32 or interpreting()),
        num_warps=num_warps,
    )
    return merge_splits(m_out, l_out, acc_out, q.shape)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Multiprocessors of CUDA device `device_index` (asked once: the query costs host time on every launch)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_plan(q: torch.Tensor, n_tok: int, m_pad: int, block: int = BLOCK_T, waves: int = 2,
               width: int | None = None):
    """(splits, tokens per split, the per-split outputs m, l `[B Hkv, splits, M_PAD]` and acc `[..., width]`, width
    None: D) for a launch over `n_tok` tokens: enough programs to fill the GPU `waves` times, whole tiles of `block`
    per split."""
    b, h, _, d = q.shape
    sms = sm_count(q.device.index or 0) if q.is_cuda else 4
    n_split = max(1, min(triton.cdiv(n_tok, block), triton.cdiv(waves * sms, b * h)))
    per_split = triton.cdiv(triton.cdiv(n_tok, n_split), block) * block
    n_split = triton.cdiv(n_tok, per_split)
    m_out = torch.empty(b * h, n_split, m_pad, device=q.device, dtype=torch.float32)
    acc_out = torch.empty(b * h, n_split, m_pad, width or d, device=q.device, dtype=torch.float32)
    return n_split, per_split, (m_out, torch.empty_like(m_out), acc_out)


def merge_splits(m_out: torch.Tensor, l_out: torch.Tensor, acc_out: torch.Tensor, q_shape):
    """The per-split partials merged by log-sum-exp into (m, l, acc) of the real rows of queries `q_shape`."""
    b, h, m, d = q_shape
    m_pad = m_out.shape[-1]
    mx = m_out.amax(1)
    safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    w = torch.exp(m_out - safe.unsqueeze(1))
    l_sum = (l_out * w).sum(1)
    acc = (acc_out * w.unsqueeze(-1)).sum(1)
    shape = (b, h, m_pad)
    return mx.view(shape)[..., :m], l_sum.view(shape)[..., :m], acc.view(b, h, m_pad, d)[:, :, :m]


def quant_mass_triton(q: torch.Tensor, seg: QuantSegment, key_valid: torch.Tensor | None, lse: torch.Tensor):
    """Attention probability per key of `seg` [B, Hkv, T], given the final log-sum-exp per row [B, Hkv, M]."""
    b, h, m, d = q.shape
    n_tok = seg.tokens
    qp, parts, valid, m_pad, dot_f32 = _launch_args(q, seg, key_valid)
    lse_p = torch.zeros(b * h, m_pad, device=q.device, dtype=torch.float32)
    lse_p[:, :m] = lse.reshape(b * h, m)
    mass = torch.empty(b * h, n_tok, device=q.device, dtype=torch.float32)
    _quant_mass_kernel[(b * h, triton.cdiv(n_tok, BLOCK_T))](
        qp, parts[0], parts[1], parts[2], valid, lse_p, mass, n_tok, h, m, parts[0].shape[-1],
        HAS_VALID=key_valid is not None, M_PAD=m_pad, D=d, BLOCK=BLOCK_T, K_BITS=seg.k_bits, K_GROUP=seg.k_group,
        DOT_F32=dot_f32,
    )
    return mass.view(b, h, n_tok)
