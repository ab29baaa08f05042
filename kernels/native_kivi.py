"""KIVI codes on the CPU in C (`native_kivi.c`): one clip candidate of a tensor's groups per call (`kivi_candidate`:
the range shrunk about its midpoint, the fp16 scale and zero, each element's squared error or code) and the packing
of `quant.packing.pack_bits` (`pack_codes`), bit for bit what the torch code of `quant.kivi.quantize_kivi` computes.
The sums of the errors per group stay torch's: the bits of a float32 sum depend on its order, and torch's order
(vectorized, by the CPU's instruction set) is not a sequential one.

Built with `build.compile_library` like the other CPU kernels, but without -ffast-math and with -ffp-contract=off
(at -O3, so that the loops vectorize), and with nothing of the package imported, so that `quant` can call it.
Unavailable (None from both functions) where no compiler works, with `HF_KVCACHE_NATIVE=0`, off the CPU, or for
a layout it does not take; callers then keep the torch code.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from .build import LibraryBuild, compile_library, switched_off

SOURCE = Path(__file__).with_name("native_kivi.c")
FLAGS = ("-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-shared", "-fPIC")

_build = LibraryBuild()


def library() -> ctypes.CDLL | None:
    """The compiled functions, built on first use; None (after one warning) where they cannot be built or are off."""
    if switched_off():
        return None
    return _build.load(_compile, "the native KIVI encoder (codes are computed by torch)")


def _compile() -> ctypes.CDLL:
    lib = compile_library(SOURCE, FLAGS)
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.kivi_candidate.restype = i
    lib.kivi_candidate.argtypes = [p, p, p, i64, i64, i64, f, f, p, p, p, p, p, p]
    lib.pack_codes.restype = None
    lib.pack_codes.argtypes = [p, i64, i64, i, p]
    return lib


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


__all__ = ["KIVICandidate", "kivi_candidate", "library", "pack_codes"]
