"""Uniform baselines: every token stored at the same precision (INT8, INT4 with two codes per byte, FP8).

Scales are per token and KV head, over groups of `group_size` channels, so new tokens are appended without touching
the ones already stored. Defaults come from measurements on SmolLM2-135M / Moby Dick (see README, "Uniform caches").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..options import CacheOptions, check_choice, check_positive_int
from ..quant.uniform import FP8_DTYPES, QuantizedTensor, dequantize, quantize
from .base import CompressedCache, CompressedLayer

DTYPES = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")
ALIASES = {"fp8": "fp8_e4m3"}
# dtype -> (bits, default group size (None: the whole head), default symmetric)
DEFAULTS = {"int8": (8, None, True), "int4": (4, 32, True), "fp8_e4m3": (8, None, True), "fp8_e5m2": (8, None, True)}


@dataclass
class UniformQuantOptions(CacheOptions):
    dtype: str = "int8"
    group_size: int | None = None
    symmetric: bool | None = None

    def validate(self) -> None:
        self.dtype = ALIASES.get(self.dtype, self.dtype)
        check_choice("dtype", self.dtype, DTYPES + tuple(ALIASES))
        check_positive_int("group_size", self.group_size, allow_none=True)
        if self.symmetric is not None and not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be True, False or None, got {self.symmetric!r}")
        if self.dtype in FP8_DTYPES and self.symmetric is False:
            raise ValueError("fp8 formats are symmetric; leave symmetric unset")

    @property
    def bits(self) -> int:
        return DEFAULTS[self.dtype][0]

    @property
    def fmt(self) -> str:
        return self.dtype if self.dtype in FP8_DTYPES else "int"

    def resolved_group(self, head_dim: int) -> int:
        group = self.group_size or DEFAULTS[self.dtype][1] or head_dim
        if head_dim % group:
            raise ValueError(f"group_size={group} must divide head_dim={head_dim}")
        return group

    def resolved_symmetric(self) -> bool:
        return DEFAULTS[self.dtype][2] if self.symmetric is None else self.symmetric


class UniformQuantLayer(CompressedLayer):
    """Keys and values quantized per token: `{k,v}_codes`, `{k,v}_scale` (and `{k,v}_zero` when asymmetric)."""

    options: UniformQuantOptions

    def _quantize(self, x: torch.Tensor) -> QuantizedTensor:
        o = self.options
        return quantize(x, o.fmt, o.bits, o.resolved_group(x.shape[-1]), o.resolved_symmetric())

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for prefix, x in (("k", key_states), ("v", value_states)):
            q = self._quantize(x)
            new = {"codes": q.codes, "scale": q.scale, "zero": q.zero}
            for field, t in new.items():
                if t is None:
                    continue
                name = f"{prefix}_{field}"
                self.store[name] = torch.cat([self.store[name], t], dim=2) if name in self.store else t

    def _decode(self, prefix: str, n: int) -> torch.Tensor:
        o = self.options
        s = self.store
        q = QuantizedTensor(
            s[f"{prefix}_codes"], s[f"{prefix}_scale"], s.get(f"{prefix}_zero"), o.fmt, o.bits,
            o.resolved_group(n), n,
        )
        return dequantize(q, self.dtype)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode("k", self.head_dim), self._decode("v", self.value_dim)


class UniformQuantCache(CompressedCache):
    """INT8 / INT4 / FP8 KV cache. `UniformQuantCache(config=model.config, dtype="int4")`."""

    options_class = UniformQuantOptions
    layer_class = UniformQuantLayer
