"""`PagePool`: the storage of one stream (keys or values) of a CPAC layer.

  `tail`   [batch, heads, tail_tokens, D]  full_dtype   tokens not compressed yet
  `full`   [n_full, P, D]                  full_dtype   pool of base and raw pages
  `dcodes` [n_delta, packed]               uint8        delta codes (`delta_bits` per element, packed)
  `dscale` [n_delta, groups]               fp16         delta scales
  `dzero`  [n_delta, groups]               fp16         delta zero points (only with delta_asymmetric=True, else None)
  `dbase`  [n_delta]                       int32        row of `full` each delta is taken against (-1: zero)
  `slot`   [batch, heads, pages]           int32        row of the page in `full` or in the delta pool
  `mode`   [batch, heads, pages]           int8         RAW / BASE / DELTA
The pools (`full` and the delta rows) are shared by batch rows: beam reordering and `batch_repeat_interleave` remap
`slot` and never copy a page; rows no (row, head, page) references any more are dropped (`compact`). Pages are
handled in the space they are stored in (keys de-rotated with key_space="derotated": the layer rotates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .delta import DeltaCodec

RAW, BASE, DELTA = 0, 1, 2


def take_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`table[idx]` where entries of `idx` that do not matter may be out of range (they read row 0)."""
    if table.shape[0] == 0:
        return torch.zeros(idx.shape + table.shape[1:], dtype=table.dtype, device=table.device)
    return table[idx.clamp(0, table.shape[0] - 1)]


@dataclass
class PagePool:
    """The tensors of one stream (see the module docstring) and its delta codec."""

    codec: DeltaCodec
    tail: torch.Tensor
    full: torch.Tensor
    dcodes: torch.Tensor
    dscale: torch.Tensor
    dzero: torch.Tensor | None
    dbase: torch.Tensor
    slot: torch.Tensor
    mode: torch.Tensor

    FIELDS = ("tail", "full", "dcodes", "dscale", "dzero", "dbase", "slot", "mode")
    BATCH_MAJOR = ("tail", "slot", "mode")

    @classmethod
    def empty(cls, codec: DeltaCodec, batch: int, heads: int, dtype: torch.dtype, device) -> "PagePool":
        p, d, g = codec.page_size, codec.dim, codec.groups
        return cls(
            codec,
            tail=torch.zeros(batch, heads, 0, d, dtype=dtype, device=device),
            full=torch.zeros(0, p, d, dtype=dtype, device=device),
            dcodes=torch.zeros(0, codec.packed, dtype=torch.uint8, device=device),
            dscale=torch.zeros(0, g, dtype=torch.float16, device=device),
            dzero=None if codec.symmetric else torch.zeros(0, g, dtype=torch.float16, device=device),
            dbase=torch.zeros(0, dtype=torch.int32, device=device),
            slot=torch.zeros(batch, heads, 0, dtype=torch.int32, device=device),
            mode=torch.zeros(batch, heads, 0, dtype=torch.int8, device=device),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the pool holds, by field name."""
        return {name: t for name in self.FIELDS if (t := getattr(self, name)) is not None}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dim operation (beam reorder, selection, repetition) to what is kept per row, then drop the
        pool rows no row references any more."""
        for name in self.BATCH_MAJOR:
            setattr(self, name, fn(getattr(self, name)))
        self.compact()

    # ---- writing ------------------------------------------------------------------------------------------------
    def add_page(self, page: torch.Tensor, to_delta: torch.Tensor, base_rows: torch.Tensor, mode: torch.Tensor) -> None:
        """Append one page `[batch * heads, P, D]` (fp32): rows not `to_delta` to the pool of full pages, the others as
        deltas against their `base_rows` of that pool (-1: against zero); record slot and `mode`."""
        b, h = self.tail.shape[:2]
        keep = ~to_delta
        slot = torch.empty(b * h, dtype=torch.int32, device=page.device)
        n_keep = int(keep.sum())
        first = self.full.shape[0]
        slot[keep] = torch.arange(first, first + n_keep, dtype=torch.int32, device=page.device)
        if n_keep:
            self.full = torch.cat([self.full, page[keep].to(self.full.dtype)])
        n_delta = b * h - n_keep
        if n_delta:
            codes, scales, zeros = self.codec.encode(page[to_delta] - self.bases(base_rows))
            have = self.dcodes.shape[0]
            slot[to_delta] = torch.arange(have, have + n_delta, dtype=torch.int32, device=page.device)
            self.dcodes = torch.cat([self.dcodes, codes])
            self.dscale = torch.cat([self.dscale, scales])
            if zeros is not None:
                self.dzero = torch.cat([self.dzero, zeros])
            self.dbase = torch.cat([self.dbase, base_rows.to(torch.int32)])
        self.slot = torch.cat([self.slot, slot.reshape(b, h, 1)], dim=2)
        self.mode = torch.cat([self.mode, mode.reshape(b, h, 1)], dim=2)

    def compact(self) -> None:
        """Drop pool rows no (row, head, page) references any more, and renumber slots."""
        n_full, n_delta = self.full.shape[0], self.dcodes.shape[0]
        if n_full + n_delta == 0:
            return
        slot = self.slot.long()
        is_delta = self.mode == DELTA
        used_d = torch.zeros(n_delta, dtype=torch.bool, device=slot.device)
        used_d[slot[is_delta]] = True
        used_f = torch.zeros(n_full, dtype=torch.bool, device=slot.device)
        used_f[slot[~is_delta]] = True
        bases = self.dbase[used_d].long()
        used_f[bases[bases >= 0]] = True
        if bool(used_f.all()) and bool(used_d.all()):
            return
        new_f = torch.cumsum(used_f, 0) - 1
        new_d = torch.cumsum(used_d, 0) - 1
        self.slot = torch.where(is_delta, take_rows(new_d, slot), take_rows(new_f, slot)).to(torch.int32)
        self.full = self.full[used_f]
        self.dbase = torch.where(bases >= 0, take_rows(new_f, bases), -1).to(torch.int32)
        self.dcodes = self.dcodes[used_d]
        self.dscale = self.dscale[used_d]
        if self.dzero is not None:
            self.dzero = self.dzero[used_d]

    def truncate(self, pages: int) -> None:
        """Keep the first `pages` compressed pages of every row and head (the tail is the caller's)."""
        self.slot = self.slot[:, :, :pages].clone()
        self.mode = self.mode[:, :, :pages].clone()

    # ---- reading ------------------------------------------------------------------------------------------------
    def bases(self, base_rows: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 base pages of `base_rows` (rows of the pool, or of `table`); zeros where the row is -1."""
        table = self.full if table is None else table
        base = take_rows(table, base_rows).float()
        return base * (base_rows >= 0).view(-1, 1, 1)

    def deltas(self, rows: slice) -> torch.Tensor:
        """fp32 deltas `[n, P, D]` of the delta pool rows `rows`."""
        zeros = None if self.dzero is None else self.dzero[rows]
        return self.codec.decode(self.dcodes[rows], self.dscale[rows], zeros)

    def pages(self) -> torch.Tensor:
        """Every compressed page rebuilt: fp32 `[batch, heads, pages * P, D]`."""
        b, h, _, d = self.tail.shape
        table = self.full.float()
        if self.dcodes.shape[0]:
            deltas = self.deltas(slice(None))
            table = torch.cat([table, self.bases(self.dbase.long(), table) + deltas])
        slot = self.slot.long()
        idx = torch.where(self.mode == DELTA, slot + self.full.shape[0], slot)
        return table[idx].reshape(b, h, slot.shape[2] * self.codec.page_size, d)

    def page(self, row: int, head: int, page: int) -> torch.Tensor:
        """One compressed page rebuilt alone: fp32 `[P, D]`."""
        slot = int(self.slot[row, head, page])
        if int(self.mode[row, head, page]) == DELTA:
            delta = self.deltas(slice(slot, slot + 1))[0]
            return self.bases(self.dbase[slot : slot + 1].long())[0] + delta
        return self.full[slot].float()
