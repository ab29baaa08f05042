"""Token-aligned quantized tensors: the slicing, concatenation and batch mapping every quantized format shares.

A quantized tensor keeps several tensors laid out `[batch, kv_heads, rows, ...]`, where dim -2 counts tokens (codes,
per-token scales, sparse outliers) or groups of `group_size` tokens (per-channel scales). A format lists them in
`row_fields()` with the tokens each row covers; `TokenRows` then slices along tokens (on group boundaries),
concatenates and applies batch-dim operations (beam reordering, row selection) to all of them at once, leaving
everything else (bit width, a shared codebook) as it is.

`TokenFormat` is what a layer holding per-token codes (`caches.coded.CodedLayer`) asks of the format of its codes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, Protocol

import torch


class TokenRows:
    """Mixin for dataclasses of token-aligned tensors (see the module docstring)."""

    codes: torch.Tensor

    def row_fields(self) -> dict[str, int]:
        """Field name -> tokens per row along dim -2 (1: one row per token; g: one row per group of g tokens)."""
        raise NotImplementedError

    @property
    def tokens(self) -> int:
        return self.codes.shape[-2]

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        """A copy with `fn` applied to every row-laid-out tensor (e.g. `t.index_select(0, beams)`)."""
        return dataclasses.replace(self, **{f: fn(getattr(self, f)) for f in self.row_fields()})

    def slice(self, start: int, stop: int | None = None):
        """Tokens `start:stop` (views); grouped fields need `start` and `stop` (unless the end) on group boundaries."""
        n = self.tokens
        stop = n if stop is None else stop
        out = {}
        for f, per in self.row_fields().items():
            if per > 1 and (start % per or (stop % per and stop != n)):
                raise ValueError(f"per-channel groups are {per} tokens; cannot slice tokens {start}:{stop} ({f})")
            out[f] = getattr(self, f)[..., start // per : -(-stop // per), :]
        return dataclasses.replace(self, **out)

    def shared(self) -> tuple:
        """The state every block of a layer shares and decodes with (a codebook, a basis): blocks that do not share
        it cannot be concatenated (the result would decode `other` with `self`'s)."""
        return ()

    def cat(self, other):
        """`self` followed by `other` (same format and shared state; `self` must end on a group boundary)."""
        fields = self.row_fields()
        if any(per > 1 and self.tokens % per for per in fields.values()):
            raise ValueError(f"cannot append to {self.tokens} tokens: not a whole number of groups")
        if any(a is not b for a, b in zip(self.shared(), other.shared(), strict=True)):
            raise ValueError(f"cannot append {type(other).__name__} blocks coded with another fitted state (codebook "
                             "or basis) than this one's: quantize them with the same fitted state")
        return dataclasses.replace(self, **{f: torch.cat([getattr(self, f), getattr(other, f)], -2) for f in fields})

    def clone(self):
        """A copy that owns its storage (no view keeps a larger tensor alive)."""
        return self.map_rows(lambda t: t.clone())


class TokenFormat(Protocol):
    """A per-token code format (`caches.uniform.UniformQuantOptions`, `quant.token.TokenQuant`)."""

    reads_in_place: ClassVar[bool]  # the fused attention reads these codes as they are (`kernels.segments`)

    def quantize(self, x: torch.Tensor) -> TokenRows:
        """Codes of `x [batch, kv_heads, tokens, dim]`, every field `[batch, kv_heads, tokens, ...]`."""

    def dequantize(self, q: TokenRows, dtype: torch.dtype) -> torch.Tensor:
        """The tensor `[batch, kv_heads, tokens, dim]` in `dtype` that `q` holds."""

    def rows(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, n: int) -> TokenRows:
        """The codes of this format from their stored tensors (`n`: the dim before packing)."""

    def tensors(self, n: int, device: torch.device) -> list[torch.Tensor]:
        """Optional: what the format holds besides the codes to read a last dim of `n` (a rotation's tensors), for
        the bytes a layer counts (a format without this method holds nothing else)."""
