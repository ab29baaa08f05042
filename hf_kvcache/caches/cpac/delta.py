"""The delta codec of CPAC: deltas `[n, P, D]` quantized to `bits` with one fp16 scale per page, token or channel
(the reference quantizer of `hf_kvcache.quant`, codes packed): the functions, and `DeltaCodec`, the codec of
one stream of a layer with its parameters bound."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...quant.packing import packed_length
from ...quant.uniform import QuantizedTensor, dequantize, quantize


def _delta_group(scale: str, page_size: int, dim: int) -> int:
    return {"page": page_size * dim, "token": dim, "channel": page_size}[scale]


def encode_delta(
    delta: torch.Tensor, bits: int, scale: str = "page", symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize deltas `[n, P, D]` to `bits`: (packed uint8 codes `[n, packed]`, fp16 scales `[n, groups]`, fp16 zero
    points `[n, groups]` or None when symmetric), one scale per page, per token or per channel."""
    n, p, d = delta.shape
    x = delta.transpose(1, 2) if scale == "channel" else delta
    q = quantize(x.reshape(n, p * d), "int", bits, _delta_group(scale, p, d), symmetric=symmetric)
    return q.codes, q.scale, q.zero


def decode_delta(
    codes: torch.Tensor, scales: torch.Tensor, bits: int, scale: str, page_size: int, dim: int,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of `encode_delta`: fp32 deltas `[n, P, D]`."""
    n = codes.shape[0]
    q = QuantizedTensor(codes, scales, zeros, "int", bits, _delta_group(scale, page_size, dim), page_size * dim)
    x = dequantize(q, torch.float32)
    if scale == "channel":
        return x.reshape(n, dim, page_size).transpose(1, 2)
    return x.reshape(n, page_size, dim)


@dataclass(frozen=True)
class DeltaCodec:
    """The delta codec of one stream of a layer: pages of `page_size` tokens of `dim` channels, `bits` per element,
    one fp16 scale per `scale` group ("page", "token" or "channel"), fp16 zero points unless `symmetric`."""

    bits: int
    scale: str
    symmetric: bool
    page_size: int
    dim: int

    @property
    def groups(self) -> int:
        """Scale groups per page."""
        return (self.page_size * self.dim) // _delta_group(self.scale, self.page_size, self.dim)

    @property
    def packed(self) -> int:
        """Bytes of packed codes per page."""
        return packed_length(self.page_size * self.dim, self.bits)

    def encode(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return encode_delta(delta, self.bits, self.scale, self.symmetric)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> torch.Tensor:
        return decode_delta(codes, scales, self.bits, self.scale, self.page_size, self.dim, zeros)
