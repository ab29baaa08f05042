"""Fused quantize + pack for KIVI storage, beside its torch reference (bit-identical codes, scales and zeros).

- keys, per channel: each channel of each group of `group` consecutive tokens gets a scale and zero point;
  `[B, H, T, D]` -> codes `[B, H, T, packed(D)]`, scale/zero `[B, H, T // group, D]` (T a multiple of `group`).
- values, per token: groups of `group` channels; codes `[B, H, T, packed(D)]`, scale/zero `[B, H, T, D // group]`.
Asymmetric min/max, codes packed along the channel dim as a little-endian bit stream (`quant.packing`), fp16 scales
rounded up (`quant.uniform.scale_to_fp16`). Triton runs on CUDA tensors: `quant.kivi.quantize_kivi` (what the caches
call; `kivi_key_codes` / `kivi_value_codes` as tuples) dispatches here when no clipping is asked for, and is the torch
reference (`use_triton=False`). This module imports nothing of `quant.kivi`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_kvcache.quant.packing import packed_length

_TINY = 1e-6
_SUPPORTED_BITS = (2, 3, 4, 8)


def _check(x: torch.Tensor, bits: int, group: int, axis_len: int, what: str) -> None:
    if x.dim() != 4 or not torch.is_floating_point(x):
        raise ValueError(f"{what} must be a floating [batch, heads, tokens, head_dim] tensor, got {tuple(x.shape)}")
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {_SUPPORTED_BITS}, got {bits}")
    if axis_len % group:
        raise ValueError(f"{what}: {axis_len} is not a multiple of group={group}")


# ---- Triton -----------------------------------------------------------------------------------------------------------
@triton.jit
def _codes(x, lo, scale_f32, BITS: tl.constexpr):
    y = tl.math.div_rn(x - lo, scale_f32)
    f = tl.floor(y)
    frac = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)  # 1.0 when f is odd: ties go to the even neighbour, as torch.round
    q = tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))
    return tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1).to(tl.int32)


@triton.jit
def _fp16_scale(lo, hi, BITS: tl.constexpr):
    """(hi - lo) / qmax rounded up to fp16 (never below the fp32 value), as `scale_to_fp16`."""
    s32 = tl.math.div_rn(hi - lo, ((1 << BITS) - 1) * 1.0)
    s16 = tl.maximum(s32, 1e-6).to(tl.float16)
    bumped = (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    return tl.where(s16.to(tl.float32) < s32, bumped, s16)


@triton.jit
def _store_packed(out, row_off, codes, rmask, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Pack `codes` [R, D] along D (little-endian bit stream) and store at out + row_off [R, 1]."""
    if (8 % BITS) == 0:
        PER: tl.constexpr = 8 // BITS
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(tl.reshape(codes, (R, D // PER, PER)) << shifts[None, None, :], 2)
        col = tl.arange(0, D // PER)
        tl.store(out + row_off + col[None, :], packed.to(tl.uint8), mask=rmask)
    else:
        shifts = tl.arange(0, 8) * BITS
        word = tl.sum(tl.reshape(codes, (R, D // 8, 8)) << shifts[None, None, :], 2)
        col = tl.arange(0, D // 8) * BITS
        for j in tl.static_range(BITS):
            tl.store(out + row_off + col[None, :] + j, ((word >> (8 * j)) & 255).to(tl.uint8), mask=rmask)


@triton.jit
def _values_kernel(x_ptr, c_ptr, s_ptr, z_ptr, n_rows, c_row,
                   BLOCK_R: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = (rows < n_rows)[:, None]
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=rmask, other=0.0).to(tl.float32)
    g = tl.reshape(x, (BLOCK_R, D // GROUP, GROUP))
    lo, hi = tl.min(g, 2), tl.max(g, 2)
    scale = _fp16_scale(lo, hi, BITS)
    zero = lo.to(tl.float16)
    codes = _codes(g, zero.to(tl.float32)[:, :, None], scale.to(tl.float32)[:, :, None], BITS)
    gcol = tl.arange(0, D // GROUP)
    s_off = rows[:, None] * (D // GROUP) + gcol[None, :]
    tl.store(s_ptr + s_off, scale, mask=rmask)
    tl.store(z_ptr + s_off, zero, mask=rmask)
    _store_packed(c_ptr, rows[:, None] * c_row, tl.reshape(codes, (BLOCK_R, D)), rmask, BLOCK_R, D, BITS)


@triton.jit
def _keys_kernel(x_ptr, c_ptr, s_ptr, z_ptr, n_tok, c_row,
                 D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
    bh = tl.program_id(0)
    grp = tl.program_id(1)
    t = grp * GROUP + tl.arange(0, GROUP)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + (bh * n_tok + t[:, None]) * D + cols[None, :]).to(tl.float32)
    lo, hi = tl.min(x, 0), tl.max(x, 0)
    scale = _fp16_scale(lo, hi, BITS)
    zero = lo.to(tl.float16)
    codes = _codes(x, zero.to(tl.float32)[None, :], scale.to(tl.float32)[None, :], BITS)
    s_off = (bh * (n_tok // GROUP) + grp) * D + cols
    tl.store(s_ptr + s_off, scale)
    tl.store(z_ptr + s_off, zero)
    all_rows = (t < n_tok)[:, None]
    _store_packed(c_ptr, (bh * n_tok + t[:, None]) * c_row, codes, all_rows, GROUP, D, BITS)


def _pow2(n: int, what: str) -> None:
    if n & (n - 1):
        raise ValueError(f"the Triton kernels need {what} to be a power of two, got {n}")


def _outputs(x: torch.Tensor, bits: int, group: int, axis: str):
    """Checked contiguous input and empty (codes, scale, zero) for `x` `[B, H, T, D]` quantized along `axis`."""
    _check(x, bits, group, x.shape[-2 if axis == "channel" else -1], "keys" if axis == "channel" else "values")
    b, h, t, d = x.shape
    _pow2(d, "head_dim")
    _pow2(group, "group")
    codes = torch.empty(b, h, t, packed_length(d, bits), dtype=torch.uint8, device=x.device)
    groups = (t // group, d) if axis == "channel" else (t, d // group)
    scale = torch.empty(b, h, *groups, dtype=torch.float16, device=x.device)
    return x.contiguous(), codes, scale, torch.empty_like(scale)


def kivi_keys_triton(k: torch.Tensor, bits: int, group: int):
    x, codes, scale, zero = _outputs(k, bits, group, "channel")
    b, h, t, d = x.shape
    if t:
        _keys_kernel[(b * h, t // group)](x, codes, scale, zero, t, codes.shape[-1], D=d, GROUP=group, BITS=bits)
    return codes, scale, zero


def kivi_values_triton(v: torch.Tensor, bits: int, group: int, block_rows: int = 16):
    x, codes, scale, zero = _outputs(v, bits, group, "token")
    b, h, t, d = x.shape
    n_rows = b * h * t
    if n_rows:
        _values_kernel[(triton.cdiv(n_rows, block_rows),)](
            x, codes, scale, zero, n_rows, codes.shape[-1], BLOCK_R=block_rows, D=d, GROUP=group, BITS=bits
        )
    return codes, scale, zero
