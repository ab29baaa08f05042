"""Bit packing of small unsigned codes along the last dimension.

`bits` in 1..8. For widths that divide 8 (1, 2, 4, 8) the codes of one byte are its bit fields, lowest code in the
lowest bits. Other widths (3, 5, 6, 7) pack 8 codes into `bits` bytes, little-endian.
"""

from __future__ import annotations

import torch

_VALID_BITS = tuple(range(1, 9))


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
    grouped = packed.reshape(*packed.shape[:-1], -1, bits).to(torch.int64)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=packed.device)
    word = (grouped << byte_shifts).sum(dim=-1)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=packed.device)
    codes = ((word.unsqueeze(-1) >> shifts) & mask).to(torch.uint8)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]
