"""Group-wise quantization along the last dimension, the reference every cache and kernel is checked against.

A tensor `[..., n]` is cut into groups of `group_size` consecutive elements; each group gets its own scale (and zero
point when asymmetric), stored in fp16. Scales are rounded (up) to fp16 *before* the codes are computed, so dequantizing
with the stored scale reproduces exactly what the quantizer aimed at.

Formats:
- integer, symmetric: scale = absmax / qmax with qmax = 2**(bits-1) - 1; the signed code round(x / scale) is stored
  offset by qmax, so it is unsigned
- integer, asymmetric: code = round((x - zero) / scale), scale = (max - min) / (2**bits - 1), zero = min
- fp8 (`e4m3`, `e5m2`): x / scale cast to the fp8 dtype, scale = absmax / fp8_max
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import lane_factors, pack_bits, unpack_lanes
from .rows import TokenRows

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_SCALE_DTYPE = torch.float16
_TINY = 1e-6  # smallest scale kept; fp16 still represents it (as a subnormal) and it avoids division by zero


@dataclass
class QuantizedTensor(TokenRows):
    """Codes plus per-group scale (and zero point); every field keeps the leading dims of the source tensor. Of a
    tensor laid out `[batch, kv_heads, tokens, n]` (the caches' keys and values) every field has one row per token
    along dim -2, so `TokenRows` slices, concatenates and maps it by rows."""

    codes: torch.Tensor  # uint8 packed codes, or an fp8 tensor
    scale: torch.Tensor  # [..., n_groups] fp16
    zero: torch.Tensor | None  # [..., n_groups] fp16, asymmetric only
    fmt: str  # "int" or an fp8 name
    bits: int
    group_size: int
    n: int  # elements along the last dim before packing

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.zero) if t is not None]

    def row_fields(self) -> dict[str, int]:
        return dict(codes=1, scale=1) | ({} if self.zero is None else dict(zero=1))


def scale_to_fp16(scale: torch.Tensor) -> torch.Tensor:
    """fp16 scale never below the fp32 one, so the largest value of a group is never clipped."""
    s16 = scale.clamp_min(_TINY).to(_SCALE_DTYPE)
    return torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)


_scale_fp16 = scale_to_fp16  # older private name, still imported by quant.kivi


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    n = x.shape[-1]
    if n % group_size:
        raise ValueError(f"last dim {n} is not a multiple of group_size={group_size}; choose a divisor of {n}")
    return x.reshape(*x.shape[:-1], n // group_size, group_size)


def quantize(
    x: torch.Tensor, fmt: str = "int", bits: int = 8, group_size: int | None = None, symmetric: bool = True
) -> QuantizedTensor:
    """Quantize `x` along its last dim in groups of `group_size` (default: the whole last dim)."""
    if not torch.is_floating_point(x):
        raise ValueError(f"can only quantize floating-point tensors, got {x.dtype}")
    n = x.shape[-1]
    group_size = group_size or n
    g = _grouped(x.float(), group_size)
    if fmt in FP8_DTYPES:
        fp8 = FP8_DTYPES[fmt]
        scale = scale_to_fp16(g.abs().amax(-1) / torch.finfo(fp8).max)
        codes = (g / scale.float().unsqueeze(-1)).to(fp8).reshape(x.shape)
        return QuantizedTensor(codes, scale, None, fmt, 8, group_size, n)
    if fmt != "int":
        raise ValueError(f"unknown format {fmt!r}; choose 'int' or one of {sorted(FP8_DTYPES)}")
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = scale_to_fp16(g.abs().amax(-1) / qmax)
        q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-qmax, qmax) + qmax
        zero = None
    else:
        qmax = 2**bits - 1
        lo, hi = g.amin(-1), g.amax(-1)
        scale = scale_to_fp16((hi - lo) / qmax)
        zero = (lo + 0.0).to(_SCALE_DTYPE)  # + 0.0: a zero of -0.0 kept as +0.0 (the same value, one bit pattern)
        q = torch.round((g - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp(0, qmax)
    codes = pack_bits(q.to(torch.uint8).reshape(x.shape), bits)
    return QuantizedTensor(codes, scale, zero, "int", bits, group_size, n)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rebuild the tensor `q` was made from (up to quantization error)."""
    if q.fmt in FP8_DTYPES:  # either way a fresh float32 tensor, worked on in place
        vals = q.codes.float()
    else:
        vals, shifted = unpack_lanes(q.codes, q.bits, q.n)
        if shifted:  # lane d holds code * 2**k: an exact power-of-two factor
            vals.mul_(lane_factors(q.bits, q.n, vals.device))
        if q.zero is None:
            vals.sub_(2 ** (q.bits - 1) - 1)
    g = _grouped(vals, q.group_size).mul_(q.scale.float().unsqueeze(-1))
    if q.zero is not None:
        g.add_(q.zero.float().unsqueeze(-1))
    return g.reshape(*vals.shape[:-1], q.n).to(dtype)
