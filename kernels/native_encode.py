"""New keys and values into per-token integer codes on the CPU in one C call (`native_encode.c`): what
`quant.uniform.quantize` computes (and, for pre-RoPE keys, `PreRopeKeys.derotate` then the frame's normalization
first), bit for bit, without the two dozen small torch operations a decode step's single token otherwise costs per
layer.

Built like the decode kernel (`build.compile_library`), but without -ffast-math and with -ffp-contract=off, so that
every operation rounds as torch's does. Unavailable (None from `encode`) where no compiler works, with
`HF_KVCACHE_NATIVE=0`, off the CPU, or for a format it does not take (fp8, 3 / 5 / 6 / 7 bits); callers then keep
the torch code.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from hf_kvcache.quant.uniform import QuantizedTensor

from .build import LibraryBuild, compile_library, switched_off
from .native import _ptr, as_float32, blocks_of

SOURCE = Path(__file__).with_name("native_encode.c")
FLAGS = ("-O2", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-shared", "-fPIC")
BITS = (2, 4, 8)

_build = LibraryBuild()


def library() -> ctypes.CDLL | None:
    """The compiled encoder, built on first use; None (after one warning) where it cannot be built or is off."""
    if switched_off():
        return None
    return _build.load(_compile, "the native CPU encoder (codes are computed by torch)")


def _compile() -> ctypes.CDLL:
    lib = compile_library(SOURCE, FLAGS)
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.encode_tokens.restype = i
    lib.encode_tokens.argtypes = [p, i, i, i, i, p, p, i64, ctypes.c_float, p, p, i64, i, i, i, p, i64, i64, i64, p, p,
                                  i64, i64, i64]
    return lib


def encode(x: torch.Tensor, bits: int, group: int, symmetric: bool, angles: tuple[torch.Tensor, torch.Tensor] | None
           = None, unscale: float = 1.0, frame: tuple[torch.Tensor, torch.Tensor] | None = None,
           out: QuantizedTensor | None = None) -> QuantizedTensor | None:
    """Integer codes of `x [B, H, N, D]` per token in groups of `group` channels, or None where the encoder does not
    serve (see the module docstring).

    Args:
        x: keys or values, any float dtype (read as float32).
        bits, group, symmetric: the format (`quant.uniform.quantize`'s `bits`, `group_size`, `symmetric`).
        angles: (cos, sin) `[B or 1, N, D / 2]` float32 of each token's RoPE angles: the rotation is undone first,
            then the result divided by `unscale` (the RoPE's attention scaling).
        frame: (shift, scale) `[B or 1, H, 1, D]` float32: channels normalized as `(x - shift) / scale` next.
        out: where to write the codes (rows of a larger storage, `quant.rows.RowBuffer.spare`): used when its
            tensors have the shapes, dtypes and contiguous last dims of these codes (else new tensors are made).

    Returns:
        The `QuantizedTensor` `quantize(x', "int", bits, group, symmetric)` gives for the transformed `x'` (`out`
        itself when the codes were written there).
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
    if out is not None and _takes(out, b, h, n, d, bits, group, symmetric):
        codes, scales, zeros = out.codes, out.scale, out.zero
    else:
        out = None
        codes = torch.empty(b, h, n, d * bits // 8, dtype=torch.uint8)
        scales = torch.empty(b, h, n, d // group, dtype=torch.float16)
        zeros = None if symmetric else torch.empty_like(scales)
    rc = lib.encode_tokens(
        x.data_ptr(), b, h, n, d, _ptr(cos), _ptr(sin), ang_sb, unscale, _ptr(shift), _ptr(scale), frame_sb, bits,
        group, int(symmetric), codes.data_ptr(), *codes.stride()[:3], scales.data_ptr(), _ptr(zeros),
        *scales.stride()[:3],
    )
    if rc:
        return None
    return out if out is not None else QuantizedTensor(codes, scales, zeros, "int", bits, group, d)


def _takes(out: QuantizedTensor, b: int, h: int, n: int, d: int, bits: int, group: int, symmetric: bool) -> bool:
    """Whether `out` can hold the codes of `[b, h, n, d]` in this format: its shapes and dtypes, contiguous last dims,
    and the zeros' strides the scales' (the encoder writes both with one set of strides)."""
    codes, scales, zeros = out.codes, out.scale, out.zero
    return (out.fmt == "int" and out.bits == bits and out.group_size == group and out.n == d
            and (zeros is None) == symmetric and codes.dtype == torch.uint8 and scales.dtype == torch.float16
            and codes.shape == (b, h, n, d * bits // 8) and scales.shape == (b, h, n, d // group)
            and codes.stride(-1) == 1 and scales.stride(-1) == 1
            and (zeros is None or (zeros.dtype == torch.float16 and zeros.shape == scales.shape
                                   and zeros.stride() == scales.stride())))


__all__ = ["encode", "library"]
