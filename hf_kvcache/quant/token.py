"""`TokenQuant`: how a cache that keeps an arbitrary, changing set of tokens stores each of them quantized.

Each token is quantized on its own (KIVI-style asymmetric min/max groups of `group_size` channels along head_dim,
fp16 scale and zero per group; default group: the whole head), so eviction gathers a token's codes like any other
per-slot tensor. Keys by default with RoPE undone and each channel shifted and scaled first (`key_quant="prerope"`,
`quant.prerope.PreRopeKeys`, which needs the model's RoPE); `"token"` quantizes the post-RoPE keys as they come.
Used by the evicting cache's slots and by the quantized sliding-window layers beside them (a `quant.rows.TokenFormat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..options import check_choice, check_positive_int
from .kivi import KIVIQuantized, dequantize_kivi, quantize_kivi

TOKEN_QUANT_BITS = (8, 4, 2)
KEY_QUANT = ("prerope", "token")


@dataclass
class TokenQuant:
    """`bits` (8, 4 or 2) per entry, `group_size` channels per scale / zero (None: the whole head), `key_quant`
    ("prerope" or "token")."""

    bits: int = 4
    group_size: int | None = None
    key_quant: str = "prerope"

    def __post_init__(self) -> None:
        if self.bits not in TOKEN_QUANT_BITS or isinstance(self.bits, bool):
            raise ValueError(f"quant_bits={self.bits!r} is not valid; choose None (the model's dtype), 8, 4 or 2")
        check_positive_int("quant_group_size", self.group_size, allow_none=True)
        check_choice("key_quant", self.key_quant, KEY_QUANT)

    @property
    def prerope_keys(self) -> bool:
        """Whether keys are quantized in the pre-RoPE frame (`key_quant="prerope"`)."""
        return self.key_quant == "prerope"

    def quantize(self, x: torch.Tensor) -> KIVIQuantized:
        """KIVI codes of `x [..., tokens, dim]` per token: codes `[..., tokens, packed]`, fp16 scale / zero
        `[..., tokens, groups]`."""
        return quantize_kivi(x, self.bits, self.group_size or x.shape[-1], axis="token")

    reads_in_place: ClassVar[bool] = False  # the fused attention reads uniform codes, not these

    def dequantize(self, q: KIVIQuantized, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of `quantize`: `[..., tokens, dim]` in `dtype`."""
        return dequantize_kivi(q, dtype)

    def rows(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, n: int) -> KIVIQuantized:
        """Codes of this format from their stored tensors (`n`: the dim before packing)."""
        return KIVIQuantized(codes, scale, zero, self.bits, self.group_size or n, "token", n)

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Raise unless `group_size` divides the key and value head dims into groups of whole bytes of codes."""
        group = self.group_size
        for name, dim in (("head_dim", key_dim), ("value head_dim", value_dim)):
            if (group or dim) > dim or dim % (group or dim) or ((group or dim) * self.bits) % 8:
                raise ValueError(
                    f"quant_group_size={group} must divide the {name} {dim} (and hold whole bytes of codes); "
                    f"choose a divisor of {dim} such as {dim // 2}, or leave it None (one group per head)"
                )
