"""KIVI group quantization (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

Tensors are `[..., tokens, dim]` (a cache layer's `[batch, kv_heads, tokens, head_dim]`). Two groupings:

- `axis="channel"` (KIVI's keys): every channel gets its own scale and zero point per group of `group_size`
  consecutive *tokens*; scale/zero are `[..., tokens // group_size, dim]`. The token count must be a multiple of
  `group_size`, which is why a cache moves tokens into a per-channel tier in whole groups.
- `axis="token"` (KIVI's values): every token gets a scale and zero point per group of `group_size` consecutive
  *channels*; scale/zero are `[..., tokens, dim // group_size]`.

Both are asymmetric min/max: `scale = (max - min) / (2**bits - 1)`, `zero = min`, `code = round((x - zero) / scale)`.
Scale and zero are stored in fp16 (the scale rounded up, so the group's maximum is never clipped by the rounding).
Codes are packed along `dim` with `quant.packing` whatever the axis, so codes stay token-aligned: slicing, cropping and
appending tokens never repacks anything, only the per-channel scales are per group of tokens.

Clipping (optional) shrinks each group's [min, max] around its midpoint by `clip_ratio`; `clip_search=True` tries
the ratios in `CLIP_GRID` and keeps, per group, the one with the smallest squared error. On the CPU each candidate
(its range, fp16 scale and zero, squared errors or codes) and the packing run in C (`kernels.native_kivi`), bit
for bit; the sums of the errors per group stay torch's.

Dequantization unpacks with `quant.packing.unpack_lanes` (float codes, lane factors folded into the per-channel key
scales) and applies scale and zero in place, optionally straight into a slice of a preallocated output: the one
dequantizer of this format, used by the cache, the fused attention's torch path and the Triton kernels' references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import lane_factors, pack_bits, unpack_lanes
from .rows import TokenRows
from .uniform import _scale_fp16

AXES = ("channel", "token")
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
_SCALE_DTYPE = torch.float16


@dataclass
class KIVIQuantized(TokenRows):
    """Packed codes `[..., tokens, packed(dim)]` plus fp16 scale and zero (shapes: see the module docstring)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    axis: str
    dim: int

    def row_fields(self) -> dict[str, int]:
        per = self.group_size if self.axis == "channel" else 1
        return {"codes": 1, "scale": per, "zero": per}

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale, self.zero]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


def check_kivi_args(bits: int, group_size: int, axis: str) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if axis not in AXES:
        raise ValueError(f"axis={axis!r} is not valid; choose one of {list(AXES)}")


def _group_view(x: torch.Tensor, group_size: int, axis: str, copy: bool = True) -> tuple[torch.Tensor, int]:
    """`x` reshaped so one dim holds the elements of a group; returns (view, that dim). `copy=False`: a view or a
    RuntimeError, never a copy."""
    tokens, dim = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    if axis == "channel":
        if tokens % group_size:
            raise ValueError(
                f"per-channel quantization needs whole groups of tokens: got {tokens} tokens, group_size={group_size}"
            )
        shape, red = (*lead, tokens // group_size, group_size, dim), -2
    else:
        if dim % group_size:
            raise ValueError(f"group_size={group_size} must divide the last dim {dim}; choose a divisor of {dim}")
        shape, red = (*lead, tokens, dim // group_size, group_size), -1
    return (x.reshape(shape) if copy else x.view(shape)), red


def _range(extent: tuple[torch.Tensor, torch.Tensor], ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi] of groups whose (min, max) is `extent`, shrunk around its midpoint by `ratio`."""
    lo, hi = extent
    if ratio == 1.0:
        return lo, hi
    mid, half = (hi + lo) * 0.5, (hi - lo) * (0.5 * ratio)
    return mid - half, mid + half


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor, bits: int, red: int):
    """fp16 scale / zero of groups spanning [lo, hi], and their float32 values unsqueezed along `red`."""
    scale = _scale_fp16((hi - lo) / (2**bits - 1))
    zero = lo.to(_SCALE_DTYPE)
    return scale, zero, scale.float().unsqueeze(red), zero.float().unsqueeze(red)


def _float_codes(g: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.round((g - z) / s).clamp_(0, 2**bits - 1)


def _candidate(g: torch.Tensor, red: int, extent: tuple[torch.Tensor, torch.Tensor], ratio: float, bits: int,
               errors: bool):
    """The groups of `g` coded over their `extent` shrunk by `ratio`: (lo, hi, fp16 scale, fp16 zero, the squared
    error of each element's round trip with `errors`, else its uint8 code). On the CPU in one C call
    (`kernels.native_kivi.kivi_candidate`), bit for bit the torch code."""
    from ..kernels.native_kivi import kivi_candidate

    got = kivi_candidate(g, red, *extent, ratio, bits, errors) if g.is_cpu else None
    if got is not None:
        return got.lo, got.hi, got.scale, got.zero, got.errors if errors else got.codes
    lo, hi = _range(extent, ratio)
    scale, zero, s, z = _scale_zero(lo, hi, bits, red)
    q = _float_codes(g, s, z, bits)
    return lo, hi, scale, zero, q.mul_(s).add_(z).sub_(g).square_() if errors else q.to(torch.uint8)


def quantize_kivi(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    axis: str = "token",
    clip_ratio: float = 1.0,
    clip_search: bool = False,
    use_triton: bool | None = None,
) -> KIVIQuantized:
    """Asymmetric min/max quantization of `x` ([..., tokens, dim]) in KIVI groups along `axis`.

    use_triton: the fused quantize+pack kernels of `hf_kvcache.kernels.kivi_pack` (bit-identical codes, scales and
    zeros); None: on CUDA tensors whenever they serve the call (no clipping, widths 2/3/4/8, power-of-two dims and
    groups, `[batch, heads, tokens, dim]`)."""
    check_kivi_args(bits, group_size, axis)
    if not torch.is_floating_point(x):
        raise ValueError(f"can only quantize floating-point tensors, got {x.dtype}")
    if not 0.0 < clip_ratio <= 1.0:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio!r}")
    if use_triton or (use_triton is None and x.is_cuda and _triton_serves(x, bits, group_size, clip_ratio, clip_search)):
        from ..kernels.kivi_pack import kivi_keys_triton, kivi_values_triton

        fn = kivi_keys_triton if axis == "channel" else kivi_values_triton
        codes, scale, zero = fn(x, bits, group_size)
        return KIVIQuantized(codes, scale, zero, bits, group_size, axis, x.shape[-1])
    dim = x.shape[-1]
    g, red = _group_view(x.float(), group_size, axis)
    g = g.contiguous()  # a view of a slice may not be
    extent = g.amin(red), g.amax(red)
    ratio = float(clip_ratio)
    if clip_search:  # per group, the first ratio of the grid with the smallest squared error; its codes
        los, his, errors = [], [], []
        for r in CLIP_GRID:
            r_lo, r_hi, _, _, err = _candidate(g, red, extent, r * clip_ratio, bits, errors=True)
            los.append(r_lo), his.append(r_hi), errors.append(err.sum(red))
        best = torch.stack(errors, -1).argmin(-1, keepdim=True)  # the first of equal errors
        extent = tuple(torch.stack(r, -1).gather(-1, best).squeeze(-1) for r in (los, his))
        ratio = 1.0
    _, _, scale, zero, q = _candidate(g, red, extent, ratio, bits, errors=False)
    codes = pack_bits(q.reshape(x.shape), bits)
    return KIVIQuantized(codes, scale.contiguous(), zero.contiguous(), bits, group_size, axis, dim)


def kivi_key_codes(k: torch.Tensor, bits: int, group: int, use_triton: bool | None = None):
    """(codes, scale, zero) of keys `[batch, heads, tokens, head_dim]` quantized per channel in groups of `group`
    tokens (`quantize_kivi`; `use_triton` as there: None uses the Triton kernel on CUDA tensors)."""
    q = quantize_kivi(k, bits, group, "channel", use_triton=use_triton)
    return q.codes, q.scale, q.zero


def kivi_value_codes(v: torch.Tensor, bits: int, group: int, use_triton: bool | None = None):
    """(codes, scale, zero) of values `[batch, heads, tokens, head_dim]` quantized per token in groups of `group`
    channels (`quantize_kivi`; `use_triton` as there)."""
    q = quantize_kivi(v, bits, group, "token", use_triton=use_triton)
    return q.codes, q.scale, q.zero


def _triton_serves(x: torch.Tensor, bits: int, group_size: int, clip_ratio: float, clip_search: bool) -> bool:
    pow2 = all(n > 0 and n & (n - 1) == 0 for n in (x.shape[-1], group_size))
    return x.dim() == 4 and bits in (2, 3, 4, 8) and pow2 and clip_ratio == 1.0 and not clip_search


def dequantize_kivi(
    q: KIVIQuantized, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensor `q` was made from (up to quantization error), `[..., tokens, dim]` in `dtype`.

    With `out` (any tensor of that shape whose last dim is contiguous, e.g. a token slice of a bigger buffer) the
    result is written there and `out` is returned; a float32 `out` is unpacked into and scaled in place, with no
    temporary of its size.
    """
    shape = (*q.codes.shape[:-1], q.dim)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    direct = out is not None and out.dtype == torch.float32 and out.stride(-1) == 1
    vals, shifted = unpack_lanes(q.codes, q.bits, q.dim, out if direct else None)
    try:
        g, red = _group_view(vals, q.group_size, q.axis, copy=False)
    except RuntimeError:  # a layout that cannot be split into groups without a copy: scale a contiguous copy
        vals = vals.contiguous()
        g, red = _group_view(vals, q.group_size, q.axis)
    scale, zero = q.scale.float().unsqueeze(red), q.zero.float().unsqueeze(red)
    if shifted and q.axis == "channel":  # per-channel scales: the lane factors fold into them
        scale = scale * lane_factors(q.bits, q.dim, vals.device)
    elif shifted:
        g.mul_(lane_factors(q.bits, q.dim, vals.device).view(-1, q.group_size))
    if q.axis == "channel":
        torch.addcmul(zero, g, scale, out=g)  # one pass; for per-token scales (broadcast over channels) mul + add is faster
    else:
        g.mul_(scale).add_(zero)
    if direct:
        return out
    if out is not None:
        return out.copy_(vals)
    return vals if dtype == torch.float32 else vals.to(dtype)
