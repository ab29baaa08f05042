"""Triton kernel for attention over a `SubspaceSegment` (a tiered archive coded in fitted per-head bases): the
softmax partial with its output in the values' whitened coefficients, as `native_subspace.coefficient_partial`
computes it on the CPU (`from_subspace.subspace_partial` takes it to the model's basis).

One program per (batch * kv_head, token split), as `triton_decode`. Per tile of tokens: each key's coefficients are
gathered from its row of codes (every direction's byte, shift and width from the layout, `_directions`), scaled by
its key group's scale and zero, and rebuilt into the model's key by two dots with the basis times sigma (channels
`[0, D/2)` and `[D/2, D)`, the pairs of `rotate_half`), RoPE put back at the token's position for pre-RoPE keys (the
angles as `triton_tokens` computes them), and scored against the queries; the values' coefficients are gathered the
same way, centred on their subspace's middle code and scaled per token and subspace, and weighted by the
probabilities without leaving the whitened basis. Reference: `from_subspace.blockwise_partial` with
`subspace_scores` / `subspace_coefficients`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import native_subspace
from .from_subspace import in_model_basis
from .segments import SubspaceSegment
from .triton_decode import _online_step, _scores, _store_partial, interpreting, merge_splits, padded_rows, split_plan
from .triton_tokens import _cos_sin

# (tokens per tile, channel pairs of a key rebuilt at once, warps) by head dim and the dots' precision (fp32 / fp16
# operands), chosen from the cubins compiled for sm_90 alone (the fewest spills, then the largest tile, at full-rank
# bases; docs/results/kernels.md); not yet timed on a GPU. Token splits for SUB_WAVES programs per SM.
SUB_LAUNCH = {(64, False): (64, 32, 8), (64, True): (64, 16, 8), (128, False): (32, 32, 8), (128, True): (32, 32, 8),
              (256, False): (32, 32, 8), (256, True): (32, 16, 8)}
SUB_WAVES = 4


def subspace_launch(head_dim: int, dot_f32: bool) -> tuple[int, int, int]:
    """(tokens per tile, channel pairs rebuilt at once, warps) of the subspace kernel's launch for `head_dim` (32 takes
    64's) and the dots' precision."""
    block, channels, warps = SUB_LAUNCH[(max(head_dim, 64), dot_f32)]
    return block, min(channels, head_dim // 2), warps


@functools.lru_cache(maxsize=64)
def _directions(bounds: tuple, bits: tuple, row_bytes: int, padded: int, device: str) -> torch.Tensor:
    """int32 `[5, padded]` on `device` (made once per layout and device: no host copy in a step): per direction of a
    layout (`native_subspace._layout`'s subspaces) its byte in a token's row, bit shift in that byte and code mask,
    its subspace and (value codes) its subspace's middle code times 2; zeros past the rank (a zero mask reads code
    0)."""
    table = torch.zeros(5, padded, dtype=torch.int32)
    for s, (lo, hi, width, byte) in enumerate(native_subspace._layout(bounds, bits, row_bytes).view(-1, 4).tolist()):
        for j in range(lo, hi):
            bit = 8 * byte + width * (j - lo)
            table[:, j] = torch.tensor([bit >> 3, bit & 7, (1 << width) - 1, s, 2**width - 1])
    return table.to(device)


@functools.lru_cache(maxsize=64)
def _value_steps(bits: tuple, device: str) -> torch.Tensor:
    """float32 `[subspaces]` on `device`: the step of each value subspace's width (`native_subspace.value_levels`)."""
    return native_subspace.value_levels(bits)[0].to(device)


@triton.jit
def _gather_codes(c_ptr, t, tmask, row_bytes, byte, shift, mask):
    """Codes `[BLOCK, R]` of tokens `t` (rows of `row_bytes`), direction j at byte[j] >> shift[j] & mask[j] (two bytes
    read where a code crosses one)."""
    live = tmask[:, None] & (mask[None, :] != 0)
    at = c_ptr + t[:, None] * row_bytes + byte[None, :]
    word = tl.load(at, mask=live, other=0).to(tl.int32)
    high = live & (byte[None, :] + 1 < row_bytes)
    word = word | (tl.load(at + 1, mask=high, other=0).to(tl.int32) << 8)
    return (word >> shift[None, :]) & mask[None, :]


@triton.jit
def _subspace_attn_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, w_ptr, mean_ptr, freq_ptr, vc_ptr, vs_ptr, kdir_ptr, vdir_ptr, valid_ptr,
    m_ptr, l_ptr, acc_ptr,
    n_tok, kv_heads, tokens_per_split, k_row, v_row, k_rank, v_sub, start, rope_scaling,
    HAS_VALID: tl.constexpr, PREROPE: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr, KR: tl.constexpr,
    VR: tl.constexpr, BLOCK: tl.constexpr, CH: tl.constexpr, K_GROUP: tl.constexpr, DOT_F32: tl.constexpr,
    FAST_TRIG: tl.constexpr,
):
    bh = tl.program_id(0)
    split, n_split = tl.program_id(1), tl.num_programs(1)
    b, h = bh // kv_heads, bh % kv_heads
    rows = tl.arange(0, M_PAD)
    HALF: tl.constexpr = D // 2
    kr = tl.arange(0, KR)
    vr = tl.arange(0, VR)
    q_rows = q_ptr + bh * M_PAD * D + rows[:, None] * D
    w_rows = w_ptr + h * KR * D + kr[:, None] * D  # the basis times sigma [KR, D], rows past the rank zero
    mean = mean_ptr + h * D
    k_byte, k_shift, k_mask = tl.load(kdir_ptr + kr), tl.load(kdir_ptr + KR + kr), tl.load(kdir_ptr + 2 * KR + kr)
    v_byte, v_shift, v_mask = tl.load(vdir_ptr + vr), tl.load(vdir_ptr + VR + vr), tl.load(vdir_ptr + 2 * VR + vr)
    v_of = tl.load(vdir_ptr + 3 * VR + vr)
    v_mid = tl.load(vdir_ptr + 4 * VR + vr).to(tl.float32) * 0.5
    kc = kc_ptr + bh * n_tok * k_row
    vc = vc_ptr + bh * n_tok * v_row
    ks = ks_ptr + bh * (n_tok // K_GROUP) * k_rank
    kz = kz_ptr + bh * (n_tok // K_GROUP) * k_rank
    vs = vs_ptr + bh * n_tok * v_sub
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, VR], tl.float32)
    t_start = split * tokens_per_split
    t_end = tl.minimum(t_start + tokens_per_split, n_tok)
    for t0 in range(t_start, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tmask = t < t_end
        live = tmask[:, None] & (k_mask[None, :] != 0)
        group = (t // K_GROUP)[:, None] * k_rank + kr[None, :]
        z = _gather_codes(kc, t, tmask, k_row, k_byte, k_shift, k_mask).to(tl.float32)
        z = z * tl.load(ks + group, mask=live, other=0.0).to(tl.float32) + tl.load(kz + group, mask=live,
                                                                                    other=0.0).to(tl.float32)
        s = tl.zeros([M_PAD, BLOCK], tl.float32)
        for c0 in range(0, HALF, CH):  # the keys rebuilt CH channel pairs at a time: the basis is read, not held
            ch = c0 + tl.arange(0, CH)
            k1 = _scores(z, tl.trans(tl.load(w_rows + ch[None, :])), DOT_F32) + tl.load(mean + ch)[None, :]
            k2 = _scores(z, tl.trans(tl.load(w_rows + HALF + ch[None, :])), DOT_F32)
            k2 += tl.load(mean + HALF + ch)[None, :]
            if PREROPE:
                angle = (start + t).to(tl.float32)[:, None] * tl.load(freq_ptr + ch)[None, :]
                cos, sin = _cos_sin(angle, FAST_TRIG)
                cos, sin = cos * rope_scaling, sin * rope_scaling
                k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
            s += _scores(tl.load(q_rows + ch[None, :]), k1, DOT_F32)
            s += _scores(tl.load(q_rows + HALF + ch[None, :]), k2, DOT_F32)
        valid = tmask
        if HAS_VALID:
            valid = valid & (tl.load(valid_ptr + b * n_tok + t, mask=tmask, other=0) != 0)
        vlive = tmask[:, None] & (v_mask[None, :] != 0)
        scale = tl.load(vs + t[:, None] * v_sub + v_of[None, :], mask=vlive, other=0.0).to(tl.float32)
        c = (_gather_codes(vc, t, tmask, v_row, v_byte, v_shift, v_mask).to(tl.float32) - v_mid[None, :]) * scale
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, c, valid, DOT_F32)
    _store_partial(m_ptr, l_ptr, acc_ptr, m_i, l_i, acc, bh, split, n_split, rows, vr, M_PAD, VR)


def serves(q: torch.Tensor, seg: SubspaceSegment) -> bool:
    """Whether the kernel takes the shape: head dim a power of two in 32..256 (two dots of D/2 channels), keys coded
    per channel in whole token groups, values per token."""
    d = q.shape[-1]
    k, v = seg.keys, seg.values
    return (d in (32, 64, 128, 256) and k.axis == "channel" and v.axis == "token" and k.tokens % k.token_group == 0
            and k.basis.dim == d and v.basis.dim == d)


def _padded(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


def coefficient_partial(q: torch.Tensor, seg: SubspaceSegment, key_valid: torch.Tensor | None,
                        dot_f32: bool | None = None, block: int | None = None, num_warps: int | None = None,
                        merged: bool = True, channels: int | None = None):
    """(row max [B, H, M], row sum [B, H, M], `[B, H, M, rank]` = the unnormalized probabilities times the values'
    whitened coefficients) of grouped, scaled queries `q` [B, H, M, D] over `seg`, as
    `native_subspace.coefficient_partial`; None where `serves` says no.

    Args:
        key_valid: `[B, T]` bool (False: the key is masked for every row) or None.
        dot_f32: IEEE fp32 dots, or fp16 operands with fp32 accumulation (None: fp32 for fp32 queries and under the
            interpreter). block, num_warps, channels: tokens per tile, warps per program and channel pairs per
            rebuild step (None: `subspace_launch`'s; the knobs `benchmarks/gpu/sweep_subspace.py` sweeps).
        merged: False returns the per-split partials (m, l `[B*H, S, M_PAD]`, the coefficients `[..., VR]`, VR the
            rank padded to a power of two >= 16, zero past the rank).
    """
    if not serves(q, seg):
        return None
    b, h, m, d = q.shape
    k, v, n_tok = seg.keys, seg.values, seg.tokens
    kr, vr = _padded(k.rank), _padded(v.rank)
    dev = q.device
    w, mean = native_subspace.basis_weights(k)
    w = torch.nn.functional.pad(w, (0, 0, 0, kr - k.rank)).to(dev).contiguous()  # [H, KR, D]
    kdir = _directions(tuple(k.bounds), tuple(k.bits), k.codes.shape[-1], kr, str(dev))
    vdir = _directions(tuple(v.bounds), tuple(v.bits), v.codes.shape[-1], vr, str(dev))
    vscale = (v.scale.float() * _value_steps(tuple(v.bits), str(dev))).contiguous()
    freq = seg.rope.inv_freq.to(dev, torch.float32).contiguous() if seg.rope is not None else mean
    qp, m_pad = padded_rows(q)
    valid = key_valid.to(torch.int8).contiguous() if key_valid is not None else qp
    dot_f32 = interpreting() or (q.dtype == torch.float32 if dot_f32 is None else dot_f32)
    default_block, default_channels, default_warps = subspace_launch(d, dot_f32)
    block, num_warps, channels = block or default_block, num_warps or default_warps, channels or default_channels
    n_split, per_split, (m_out, l_out, acc_out) = split_plan(q, n_tok, m_pad, block, SUB_WAVES, width=vr)
    _subspace_attn_kernel[(b * h, n_split)](
        qp, k.codes.contiguous(), k.scale.contiguous(), k.zero.contiguous(), w, mean.to(dev), freq,
        v.codes.contiguous(), vscale, kdir, vdir, valid, m_out, l_out, acc_out,
        n_tok, h, per_split, k.codes.shape[-1], v.codes.shape[-1], k.rank, len(v.bits), seg.start,
        seg.rope.scaling if seg.rope is not None else 1.0,
        HAS_VALID=key_valid is not None, PREROPE=seg.rope is not None, M_PAD=m_pad, D=d, KR=kr, VR=vr,
        BLOCK=block, CH=channels, K_GROUP=k.token_group, DOT_F32=dot_f32, FAST_TRIG=not interpreting(),
        num_warps=num_warps,
    )
    if not merged:
        return m_out, l_out, acc_out
    mx, total, acc = merge_splits(m_out, l_out, acc_out, (b, h, m, vr))
    return mx, total, acc[..., : v.rank]


def split_partials_in_basis(q: torch.Tensor, seg: SubspaceSegment, key_valid: torch.Tensor | None, dot_f32: bool,
                            v_rotation=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The kernel's per-split partials with each split's output taken to the model's basis (the coefficients times
    sigma and the basis, plus the row sum times the mean) and then to `v_rotation`'s (`x @ R`: the basis of the
    segments it is merged with), as `triton_step.step_attention` takes a partial set: m, l `[B*H, S, M_PAD]`, acc
    `[B*H, S, M_PAD, D]`; None where `serves` says no."""
    from hf_kvcache.quant.rotation import rotate

    part = coefficient_partial(q, seg, key_valid, dot_f32, merged=False)
    if part is None:
        return None
    m_out, l_out, coeff = part
    b, h, _, d = q.shape
    splits, m_pad = m_out.shape[1:]
    v = seg.values
    coeff = coeff[..., : v.rank].reshape(b, h, splits, m_pad, v.rank).transpose(1, 2)  # heads beside the rows
    acc = in_model_basis(v, coeff, l_out.view(b, h, splits, m_pad).transpose(1, 2)).transpose(1, 2)
    if v_rotation is not None:
        acc = rotate(acc, v_rotation)
    return m_out, l_out, acc.reshape(b * h, splits, m_pad, d).contiguous()
