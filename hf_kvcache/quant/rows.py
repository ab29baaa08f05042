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


def _prefix_of(held: TokenRows, backing: TokenRows) -> bool:
    """Whether every row field of `held` is the first rows of `backing`'s (same storage, start and strides)."""
    for f in held.row_fields():
        a, b = getattr(held, f), getattr(backing, f)
        if (a.data_ptr() != b.data_ptr() or a.stride() != b.stride() or a.shape[:-2] != b.shape[:-2]
                or a.shape[-1] != b.shape[-1] or a.shape[-2] > b.shape[-2]):
            return False
    return True


@dataclasses.dataclass
class RowBuffer:
    """Appends token rows into spare rows allocated behind them, so that a decode step writes its token's codes in
    place instead of copying every row held (`TokenRows.cat` does). The held rows are views of the first rows of
    `backing`; when the room runs out (or the held rows are no longer its first rows: reordered, cropped to a copy,
    loaded) a new backing is allocated and the rows copied once, with `room(tokens)` spare rows after an append of
    at most `SMALL_APPEND` tokens (a decode step; a prompt's chunks are held exactly, as by `cat`). The spare rows are
    allocated storage, so they count in the bytes a layer holds (`accounting.held_bytes` counts storages).

    Only formats whose fields are all per token (`row_fields` of 1) and tensors on the CPU take spare rows (elsewhere
    `append` is `cat`: the GPU kernels read codes as contiguous tensors)."""

    backing: TokenRows | None = None
    view: TokenRows | None = dataclasses.field(default=None, repr=False)  # the rows `append` returned last
    SMALL_APPEND: ClassVar[int] = 16  # appends of at most this many tokens (decode steps) leave room behind them

    @staticmethod
    def room(tokens: int) -> int:
        """Spare rows allocated behind `tokens` held ones: 1/64 of them (none below 64 tokens), so that the rows are
        copied about once every `tokens / 64` steps and the room adds at most 1/64 to the bytes held."""
        return tokens // 64

    def append(self, held: TokenRows | None, new: TokenRows) -> TokenRows:
        """`new` after `held` (`held` None: `new` itself), as views of the backing's first rows where it takes them."""
        b = self.backing
        if held is not None and held is self.view and self._fits(b, new, held.tokens + new.tokens):
            return self._write(b, held.tokens, new)  # a decode step: the rows returned last, room behind them
        self.view = None
        if held is None:
            self.backing = None
            return new
        fields = held.row_fields()
        if any(per != 1 for per in fields.values()) or held.codes.device.type != "cpu":
            self.backing = None
            return held.cat(new)
        if (any(x is not y for x, y in zip(held.shared(), new.shared(), strict=True))
                or any(getattr(held, f).shape[:-2] != getattr(new, f).shape[:-2] for f in fields)):
            return held.cat(new)  # raises: another fitted state, or shapes that do not join
        n, m = held.tokens, new.tokens
        if not self._fits(b, new, n + m) or not _prefix_of(held, b):
            rows = n + m + (self.room(n + m) if m <= self.SMALL_APPEND else 0)
            b = self.backing = held.map_rows(lambda t: t.new_empty(*t.shape[:-2], rows, t.shape[-1]))
            for f in fields:
                getattr(b, f)[..., :n, :].copy_(getattr(held, f))
        return self._write(b, n, new)

    @staticmethod
    def _fits(b: TokenRows | None, new: TokenRows, tokens: int) -> bool:
        """Whether the backing `b` takes `new`'s rows up to `tokens` rows in all: room for them, writable here (not
        an inference tensor outside inference mode), the same fields, leading dims, row widths and shared state."""
        if b is None or tokens > b.tokens or not RowBuffer._writable(b):
            return False
        fields = b.row_fields()
        if (type(new) is not type(b) or new.row_fields().keys() != fields.keys()
                or any(x is not y for x, y in zip(b.shared(), new.shared(), strict=True))):
            return False
        for f in fields:
            x, y = getattr(b, f), getattr(new, f)
            if x.shape[:-2] != y.shape[:-2] or x.shape[-1] != y.shape[-1] or x.dtype != y.dtype:
                return False
        return True

    def spare(self, held: TokenRows | None, tokens: int) -> TokenRows | None:
        """Views of the spare rows the next `append` of `tokens` rows to `held` writes into, where it writes in place
        (`held` the rows it returned last, room behind them, writable here); None otherwise. An encoder may write its
        codes there (`TokenFormat.quantize_into`): `append` then copies nothing."""
        b = self.backing
        if held is None or held is not self.view or held.tokens + tokens > b.tokens or not self._writable(b):
            return None
        return dataclasses.replace(b, **{f: getattr(b, f).narrow(-2, held.tokens, tokens) for f in b.row_fields()})

    @staticmethod
    def _writable(b: TokenRows) -> bool:
        """Whether the backing's storage can be written here (not an inference tensor outside inference mode)."""
        return torch.is_inference_mode_enabled() or not b.codes.is_inference()

    def _write(self, b: TokenRows, n: int, new: TokenRows) -> TokenRows:
        """`new`'s rows written into rows n.. of `b` (nothing to copy where they are already there: `spare`); the
        first rows up to them as views (kept as `view`)."""
        m = new.tokens
        views = {}
        for f in b.row_fields():
            t, x = getattr(b, f), getattr(new, f)
            rows = t.narrow(-2, n, m)
            if rows.data_ptr() != x.data_ptr() or rows.stride() != x.stride():
                rows.copy_(x)
            views[f] = t.narrow(-2, 0, n + m)
        self.view = dataclasses.replace(b, **views)
        return self.view


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

    def quantize_into(self, x: torch.Tensor, out: TokenRows) -> TokenRows:
        """Optional: `quantize(x)`, written into `out` (`RowBuffer.spare`: rows of a larger storage) and `out`
        returned where the format can, else new tensors (a format without this method always makes new ones)."""
