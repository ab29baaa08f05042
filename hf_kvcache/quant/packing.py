"""Bit packing of small unsigned codes along the last dimension.

`bits` in 1..8. For widths that divide 8 (1, 2, 4, 8) the codes of one byte are its bit fields, lowest code in the
lowest bits. Other widths (3, 5, 6, 7) pack 8 codes into `bits` bytes, little-endian.

Two unpackers: `unpack_bits` returns the integer codes; `unpack_lanes` returns them as float32 for dequantization
(every quantized format's dequantizer goes through it: the cache, the torch fused path and the Triton references).
For widths that divide 8 it avoids a table lookup: each byte is copied into the lanes of a wider int by one
multiply, one mask keeps each lane's own code, and the lanes, read as bytes, are converted to float. Channel `d`
then holds `code * 2**(bits * (d % per_byte))`, which the caller folds into its scales (`lane_factors`).
"""

from __future__ import annotations

import torch

_VALID_BITS = tuple(range(1, 9))
_LANE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # codes per byte -> an int with one byte per code
_FACTORS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _check_bits(bits: int) -> None:
    if bits not in _VALID_BITS:
        raise ValueError(f"bits must be one of {_VALID_BITS}, got {bits!r}")


def packed_length(n: int, bits: int) -> int:
    """Bytes taken by `n` codes of `bits` bits (the last group is padded)."""
    _check_bits(bits)
    if 8 % bits == 0:
        per_byte = 8 // bits
        return -(-n // per_byte)
    return -(-n // 8) * bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 `codes` (values < 2**bits) along the last dim into a uint8 tensor of `packed_length` bytes."""
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    n = codes.shape[-1]
    if bits == 8:
        return codes.contiguous()
    if codes.is_cpu and 8 % bits == 0 and n > 0:
        from ..kernels.native_kivi import pack_codes  # the same bytes in one C call, where it serves

        packed = pack_codes(codes.contiguous(), bits)
        if packed is not None:
            return packed
    group = 8 // bits if 8 % bits == 0 else 8
    pad = (-n) % group
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.reshape(*codes.shape[:-1], -1, group)
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=codes.device)
    word = (grouped.to(torch.int64) << shifts).sum(dim=-1)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=codes.device)
    out = ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)
    return out.reshape(*codes.shape[:-1], -1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `n` codes along the last dim, as uint8."""
    _check_bits(bits)
    if bits == 8:
        return packed[..., :n]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(-1) >> shifts) & mask
        return codes.reshape(*packed.shape[:-1], -1)[..., :n]
    return _unpack_words(packed, bits, n).to(torch.uint8)


def _unpack_words(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Widths that do not divide 8: every `bits` bytes as one little-endian word of 8 codes (int32 when the word
    fits, 3 bits: a quarter of the memory traffic of int64), the first `n` codes as that int type."""
    dtype = torch.int32 if 8 * bits < 32 else torch.int64
    grouped = packed.reshape(*packed.shape[:-1], -1, bits).to(dtype)
    word = grouped[..., 0].clone()
    for i in range(1, bits):
        word.bitwise_or_(grouped[..., i] << (8 * i))
    shifts = torch.arange(0, 8 * bits, bits, dtype=dtype, device=packed.device)
    codes = (word.unsqueeze(-1) >> shifts).bitwise_and_((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]


def _signed(x: int, width_bits: int) -> int:
    return x - (1 << width_bits) if x >= 1 << (width_bits - 1) else x


def lane_factors(bits: int, n: int, device: torch.device) -> torch.Tensor:
    """`[n]` float32: what `unpack_lanes` leaves to multiply by, `2**-(bits * (channel % codes per byte))` (exact
    powers of two, so folding them into a scale changes no result)."""
    key = (bits, n, device)
    f = _FACTORS.get(key)
    if f is None:
        per = 8 // bits
        f = _FACTORS[key] = torch.tensor([2.0 ** -(bits * (d % per)) for d in range(n)], device=device)
    return f


def unpack_lanes(packed: torch.Tensor, bits: int, n: int, out: torch.Tensor | None = None,
                 work: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
    """The first `n` codes along the last dim of `packed` `[..., packed_length(n)]` as float32 `[..., n]`, written
    into `out` when given (float32, that shape, last dim contiguous). The flag is True when channel `d` holds
    `code * 2**(bits * (d % (8 // bits)))`: the caller must still multiply by `lane_factors` (fold them into a
    scale: no extra pass). `work`: a 1-D uint8 buffer of at least `packed.numel() * (8 // bits)` bytes for the wide
    lanes (reused scratch instead of a fresh allocation per call)."""
    _check_bits(bits)
    lead, nbytes = packed.shape[:-1], packed.shape[-1]
    if out is not None and (out.shape != (*lead, n) or out.dtype != torch.float32 or out.stride(-1) != 1):
        raise ValueError(f"out must be a float32 tensor of shape {(*lead, n)} with a contiguous last dim")
    if 8 % bits:
        codes = _unpack_words(packed, bits, n)
        return (codes.float() if out is None else out.copy_(codes)), False
    per = 8 // bits
    full = nbytes * per
    vals = out if out is not None and full == n else torch.empty(*lead, full, dtype=torch.float32, device=packed.device)
    if per == 1:
        vals.copy_(packed)
    else:
        width = 8 * per
        if work is None:
            lanes = packed.to(_LANE_INT[per])
        else:
            if work.dtype != torch.uint8 or work.dim() != 1 or work.numel() < packed.numel() * per:
                raise ValueError(f"work must be a 1-D uint8 tensor of at least {packed.numel() * per} bytes")
            lanes = work[: packed.numel() * per].view(_LANE_INT[per]).view(packed.shape)
            lanes.copy_(packed)
        lanes.mul_(_signed(sum(1 << (8 * i) for i in range(per)), width))
        lanes.bitwise_and_(_signed(sum(((1 << bits) - 1) << (bits * i) << (8 * i) for i in range(per)), width))
        vals.view(*lead, nbytes, per).copy_(lanes.view(torch.uint8).view(*lead, nbytes, per))
    if full != n:
        vals = vals[..., :n] if out is None else out.copy_(vals[..., :n])
    return vals, per > 1
