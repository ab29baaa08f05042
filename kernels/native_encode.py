"""New keys and values into per-token integer codes on the CPU in one C call (`native_encode.c`): what
`quant.uniform.quantize` computes (and, for pre-RoPE keys, `PreRopeKeys.derotate` then the frame's normalization
first), bit for bit, without the two dozen small torch operations a decode step's single token otherwise costs per
layer. Also KIVI's codes (`kivi_candidate`: one clip candidate's range, fp16 scale / zero and squared errors or codes;
the sums per group stay torch's, whose order the bits depend on) and the packing of `quant.packing.pack_bits`.

Built like the decode kernel (`native.compile_library`), but without -ffast-math and with -ffp-contract=off, so that
every operation rounds as torch's does. Unavailable (None from `encode`) where no compiler works, with
`HF_KVCACHE_NATIVE=0`, off the CPU, or for a format it does not take (fp8, 3 / 5 / 6 / 7 bits); callers then keep
the torch code.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_kvcache.quant.uniform import QuantizedTensor

from .native import _Build, _ptr, as_float32, blocks_of, compile_library

SOURCE = Path(__file__).with_name("native_encode.c")
FLAGS = ("-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-shared", "-fPIC")
BITS = (2, 4, 8)

_build = _Build()


def library() -> ctypes.CDLL | None:
    """The compiled encoder, built on first use; None (after one warning) where it cannot be built or is off."""
    if os.environ.get("HF_KVCACHE_NATIVE", "1") == "0":
        return None
    return _build.load(_compile, "the native CPU encoder (codes are computed by torch)")


def _compile() -> ctypes.CDLL:
    lib = compile_library(SOURCE, FLAGS)
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.encode_tokens.restype = i
    lib.encode_tokens.argtypes = [p, i, i, i, i, p, p, i64, ctypes.c_float, p, p, i64, i, i, i, p, p, p]
    lib.kivi_candidate.restype = i
    lib.kivi_candidate.argtypes = [p, p, p, i64, i64, i64, ctypes.c_float, ctypes.c_float, p, p, p, p, p, p]
    lib.pack_codes.restype = None
    lib.pack_codes.argtypes = [p, i64, i64, i, p]
    return lib


def encode(x: torch.Tensor, bits: int, group: int, symmetric: bool, angles: tuple[torch.Tensor, torch.Tensor] | None
           = None, unscale: float = 1.0, frame: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> QuantizedTensor | None:
    """Integer codes of `x [B, H, N, D]` per token in groups of `group` channels, or None where the encoder does not
    serve (see the module docstring).

    Args:
        x: keys or values, any float dtype (read as float32).
        bits, group, symmetric: the format (`quant.uniform.quantize`'s `bits`, `group_size`, `symmetric`).
        angles: (cos, sin) `[B or 1, N, D / 2]` float32 of each token's RoPE angles: the rotation is undone first,
            then the result divided by `unscale` (the RoPE's attention scaling).
        frame: (shift, scale) `[B or 1, H, 1, D]` float32: channels normalized as `(x - shift) / scale` next.

    Returns:
        The `QuantizedTensor` `quantize(x', "int", bits, group, symmetric)` gives for the transformed `x'`.
    """
    b, h, n, d = x.shape
    if x.device.type != "cpu" or bits not in BITS or d % group or d > 1024 or d % 2:
        return None
    lib = library()
    if lib is None:
        return None
    x = as_float32(x)
    cos = sin = shift = scale = None
    ang_sb = frame_sb = 0
    if angles is not None:  # read as [B or 1, N, D / 2]
        cos, sin = as_float32(angles[0]), as_float32(angles[1])
        rows = blocks_of(cos, n * (d // 2))
        if rows not in (1, b):
            return None
        ang_sb = n * (d // 2) if rows > 1 else 0
    if frame is not None:  # read as [B or 1, H, D]
        shift, scale = as_float32(frame[0]), as_float32(frame[1])
        rows = blocks_of(shift, h * d)
        if rows not in (1, b):
            return None
        frame_sb = h * d if rows > 1 else 0
    codes = torch.empty(b, h, n, d * bits // 8, dtype=torch.uint8)
    scales = torch.empty(b, h, n, d // group, dtype=torch.float16)
    zeros = None if symmetric else torch.empty_like(scales)
    rc = lib.encode_tokens(
        x.data_ptr(), b, h, n, d, _ptr(cos), _ptr(sin), ang_sb, unscale, _ptr(shift), _ptr(scale), frame_sb, bits,
        group, int(symmetric), codes.data_ptr(), scales.data_ptr(), _ptr(zeros),
    )
    if rc:
        return None
    return QuantizedTensor(codes, scales, zeros, "int", bits, group, d)


@dataclass
class KIVICandidate:
    """What `kivi_candidate` computes for one clip ratio: the groups' range and fp16 scale and zero (`g`'s shape
    without its group dimension), and the squared errors or the codes (`g`'s shape)."""

    lo: torch.Tensor
    hi: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    errors: torch.Tensor | None = None
    codes: torch.Tensor | None = None


def kivi_candidate(g: torch.Tensor, red: int, lo: torch.Tensor, hi: torch.Tensor, ratio: float, bits: int,
                   errors: bool) -> KIVICandidate | None:
    """One KIVI clip candidate in one C call (`quant.kivi.quantize_kivi`'s torch code, bit for bit), or None where
    the encoder does not serve (off the CPU, not float32, no compiler, `HF_KVCACHE_NATIVE=0`).

    Args:
        g: the groups, float32 contiguous: `[..., groups, group, dim]` (`red` -2, keys per channel) or
            `[..., group]` (`red` -1, values per token).
        red: the dimension a group's elements lie along (-2 or -1).
        lo, hi: each group's extent, float32 contiguous (`g`'s shape without `red`).
        ratio: the clip ratio the range is shrunk by about its midpoint (1.0: the extent as it is).
        bits: the code width.
        errors: the squared error of each element's round trip (float32) instead of the codes (uint8).

    Returns:
        The candidate (see `KIVICandidate`).
    """
    if g.device.type != "cpu" or g.dtype != torch.float32 or not g.is_contiguous() or red not in (-1, -2):
        return None
    lib = library()
    if lib is None:
        return None
    group = g.shape[red]
    inner = g.shape[-1] if red == -2 else 1
    for t in (lo, hi):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() * group != g.numel():
            return None
    r_lo, r_hi = torch.empty_like(lo), torch.empty_like(lo)
    scale, zero = torch.empty(lo.shape, dtype=torch.float16), torch.empty(lo.shape, dtype=torch.float16)
    out = torch.empty_like(g) if errors else torch.empty(g.shape, dtype=torch.uint8)
    rc = lib.kivi_candidate(g.data_ptr(), lo.data_ptr(), hi.data_ptr(), g.numel() // (group * inner), group, inner,
                            -1.0 if ratio == 1.0 else 0.5 * ratio, float(2**bits - 1), r_lo.data_ptr(),
                            r_hi.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr() if errors else None,
                            None if errors else out.data_ptr())
    if rc:
        raise MemoryError("the native KIVI encoder could not allocate its scale / zero buffers")
    return KIVICandidate(r_lo, r_hi, scale, zero, out if errors else None, None if errors else out)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor | None:
    """`quant.packing.pack_bits(codes, bits)` in one C call for `bits` 1, 2 or 4 (uint8 `codes [..., n]` on the CPU,
    contiguous), or None where the encoder does not serve."""
    if codes.device.type != "cpu" or codes.dtype != torch.uint8 or not codes.is_contiguous() or bits not in (1, 2, 4):
        return None
    lib = library()
    if lib is None:
        return None
    n = codes.shape[-1]
    per = 8 // bits
    out = torch.empty(*codes.shape[:-1], -(-n // per), dtype=torch.uint8)
    lib.pack_codes(codes.data_ptr(), codes.numel() // max(n, 1), n, bits, out.data_ptr())
    return out


__all__ = ["KIVICandidate", "encode", "kivi_candidate", "library", "pack_codes"]
