"""`PagedLayer`: one model layer's keys and values in pool pages (`pool.PagePool`) named by a page table per row
(`table.PageTable`), plus each row's unquantized tail of at most `page_size - 1` tokens.

Write path: new tokens join the tail; whenever the tail holds whole pages they are quantized (all rows at once),
encoded as records and added to the pool, which shares equal pages (`share=True`). Full pages never change again:
the tail is the only part of a row that is written, and it is private to the row, so a row that diverges from the
rows it shares a prefix with writes only its own tail and then its own new pages (copy-on-write without copies).

Batch operations (`reorder_cache`, `batch_select_indices`, `batch_repeat_interleave`) select rows of the table and
of the tail: a row that appears twice references the same pages twice (reference counts go up, nothing is copied;
with `share=False` each extra reference gets a private copy of the page). Pages no row references any more return to
the pool's free list.

Read path: the distinct pages of the table are dequantized once each and gathered into every row that references
them, followed by the tail.

Crop (assisted decoding): tokens cut from the tail are dropped; a crop reaching into full pages releases those pages
and puts their dequantized tokens back into the tail (they are quantized again when the tail fills a page).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..caches.base import CompressedLayer
from .options import PagedOptions
from .pool import PageFormat, PagePool, quantize_pages
from .table import PageTable


class PagedLayer(CompressedLayer):
    """Held per layer: `pool` (`PagePool`: `data [capacity, record_bytes]` uint8, `refcount [capacity]` int32),
    `table` (`PageTable`: `ids [batch, pages]` int32) and the tails `tail_keys [batch, kv_heads, tail, head_dim]` /
    `tail_values [.., value_dim]` in `tail_dtype` (0 <= tail < page_size); tokens held = pages * page_size + tail."""

    options: PagedOptions

    def __init__(self, options: PagedOptions | None = None) -> None:
        super().__init__(options or PagedOptions())
        self._clear()

    def _clear(self) -> None:
        self.pool: PagePool | None = None
        self.table: PageTable | None = None
        self.tail_keys: torch.Tensor | None = None  # [batch, kv_heads, tail, head_dim] in tail_dtype
        self.tail_values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self.options
        PageFormat(key_states.shape[1], o.page_size, key_states.shape[-1], value_states.shape[-1], o.bits,
                   o.group_size).check()  # before the layer counts as initialized: a bad group size leaves it fresh
        super().lazy_initialization(key_states, value_states)
        if o.tail_dtype == "auto":
            self.tail_dtype = key_states.dtype if key_states.dtype in (torch.float16, torch.bfloat16) else torch.float16
        else:
            self.tail_dtype = getattr(torch, o.tail_dtype) if o.tail_dtype else key_states.dtype
        fmt = PageFormat(self.num_heads, o.page_size, self.head_dim, self.value_dim, o.bits, o.group_size)
        self.pool = PagePool(fmt, key_states.device)
        b = key_states.shape[0]
        self.table = PageTable(b, key_states.device)
        self.tail_keys = key_states.new_empty(b, self.num_heads, 0, self.head_dim, dtype=self.tail_dtype)
        self.tail_values = value_states.new_empty(b, self.num_heads, 0, self.value_dim, dtype=self.tail_dtype)

    def reset(self) -> None:
        super().reset()
        self._clear()

    # ---- sizes ---------------------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.options.page_size

    def tokens_held(self) -> int:
        if self.table is None:
            return 0
        return self.table.pages * self.page_size + self.tail_keys.shape[2]

    def batch_size(self) -> int:
        return 0 if self.table is None else self.table.batch

    # ---- write ---------------------------------------------------------------------------------------------------
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != self.batch_size():
            raise ValueError(f"this layer holds {self.batch_size()} rows, the new tokens have {key_states.shape[0]}; "
                             "use batch_repeat_interleave / batch_select_indices to change the batch, or reset()")
        tk = torch.cat([self.tail_keys, key_states.to(self.tail_dtype)], 2)
        tv = torch.cat([self.tail_values, value_states.to(self.tail_dtype)], 2)
        full = tk.shape[2] // self.page_size
        if full:
            n = full * self.page_size
            self._add_pages(tk[:, :, :n], tv[:, :, :n])
            tk, tv = tk[:, :, n:].clone(), tv[:, :, n:].clone()
        self.tail_keys, self.tail_values = tk, tv

    def _add_pages(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize `keys [batch, kv_heads, full * page_size, head_dim]` (and values) as `full` pages per row."""
        b, h, n, _ = keys.shape
        p = self.page_size
        full = n // p
        keys = self._mask_padding(keys.float(), self.table.pages * p)
        # [batch, heads, full, P, dim] -> [batch * full, heads, P, dim]: one page per leading index, row-major
        as_pages = lambda x: x.unflatten(2, (full, p)).transpose(1, 2).reshape(b * full, h, p, x.shape[-1])
        pages = quantize_pages(as_pages(keys), as_pages(values.float()), self.pool.fmt)
        ids = self.pool.add(self.pool.encode(pages), share=self.options.share)
        self.table.append(ids.view(b, full))

    def _mask_padding(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """`keys` (positions `start..`) with each row's left-padding positions set to its first real token, so that
        padding never widens a per-channel key group's range (values are per token: padding has its own scales)."""
        pad = self.row_padding(keys.shape[0])
        if pad is None:
            return keys
        n = keys.shape[2]
        for row, p in enumerate(pad.tolist()):
            first = p - start  # index of the row's first real token in `keys`
            if 0 < first < n:
                keys[row, :, :first] = keys[row, :, first : first + 1]
        return keys

    # ---- read ----------------------------------------------------------------------------------------------------
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._empty(self.tokens_held())
        self.materialize_into(keys, values)
        return keys, values

    def materialize_into(self, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        pages, p = self.table.pages, self.page_size
        n = pages * p
        if pages:
            distinct, where = torch.unique(self.table.long(), return_inverse=True)  # where: [batch, pages]
            keys, values = self.pool.read(distinct, out_k.dtype)  # [distinct, heads, P, dim]
            for row in range(self.table.batch):
                # [pages, heads, P, dim] -> [heads, pages, P, dim], written into [heads, pages * P, dim]
                out_k[row, :, :n].unflatten(1, (pages, p)).copy_(keys[where[row]].transpose(0, 1))
                out_v[row, :, :n].unflatten(1, (pages, p)).copy_(values[where[row]].transpose(0, 1))
        out_k[:, :, n:].copy_(self.tail_keys)
        out_v[:, :, n:].copy_(self.tail_values)

    # ---- batch operations ----------------------------------------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._take_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._take_rows(torch.arange(self.batch_size())[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._take_rows(torch.arange(self.batch_size()).repeat_interleave(repeats))

    def _take_rows(self, rows: torch.Tensor) -> None:
        """Keep rows `rows [new_batch]` (any order, repeats allowed) of everything held per row."""
        if self.table is None:
            return
        rows = rows.to(torch.long).reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.batch_size()):
            raise ValueError(f"row indices must lie in 0..{self.batch_size() - 1}, got {rows.tolist()}")
        padding = self.row_padding(self.batch_size())
        old = self.table.take_rows(rows)
        if not self.options.share:
            self._unshare()
        else:
            self.pool.retain(self.table.ids)
        self.pool.release(old)
        dev = self.tail_keys.device
        self.tail_keys = self.tail_keys.index_select(0, rows.to(dev))
        self.tail_values = self.tail_values.index_select(0, rows.to(dev))
        self.padding = None if padding is None else padding.index_select(0, rows.to(padding.device))

    def _unshare(self) -> None:
        """Unshared mode after a row selection: the first reference to each page keeps it (one more reference),
        every further one gets a private copy."""
        flat = self.table.long().reshape(-1)
        seen: set[int] = set()
        repeat = torch.zeros(flat.numel(), dtype=torch.bool)
        for i, page in enumerate(flat.tolist()):
            repeat[i] = page in seen
            seen.add(page)
        self.pool.retain(flat[~repeat])
        if bool(repeat.any()):
            flat = flat.clone()
            flat[repeat] = self.pool.copy(flat[repeat])
            self.table.ids = flat.view_as(self.table.ids).to(self.table.ids)

    def compact(self) -> None:
        """Shrink the pool to the pages in use (after batch operations or crops freed some)."""
        if self.table is not None:
            self.table.ids = self.pool.compact(self.table.ids)

    # ---- crop ----------------------------------------------------------------------------------------------------
    def _crop_newest(self, n: int) -> None:
        tail = self.tail_keys.shape[2]
        if n > tail:  # reopen the pages the crop reaches into: their tokens go back to the tail, dequantized
            reopen = -(-(n - tail) // self.page_size)
            dropped = self.table.drop_last(reopen)
            b, h = dropped.shape[0], self.num_heads
            keys, values = self.pool.read(dropped.reshape(-1).long(), self.tail_dtype)  # [b * reopen, h, P, dim]
            as_rows = lambda x: x.view(b, reopen, h, self.page_size, x.shape[-1]).transpose(1, 2).reshape(
                b, h, reopen * self.page_size, x.shape[-1])
            self.tail_keys = torch.cat([as_rows(keys), self.tail_keys], 2)
            self.tail_values = torch.cat([as_rows(values), self.tail_values], 2)
            self.pool.release(dropped)
        keep = self.tail_keys.shape[2] - n
        self.tail_keys = self.tail_keys[:, :, :keep].clone()
        self.tail_values = self.tail_values[:, :, :keep].clone()

    # ---- accounting ----------------------------------------------------------------------------------------------
    def held_tensors(self) -> list[torch.Tensor]:
        if self.table is None:
            return []
        return [*self.pool.tensors(), *self.table.tensors(), self.tail_keys, self.tail_values]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.table is None:
            return {}
        return {"pages": self.pool.data, "refcount": self.pool.refcount, "page_table": self.table.ids,
                "tail_keys": self.tail_keys, "tail_values": self.tail_values}

    def page_stats(self) -> "PageStats":
        if self.table is None:
            return PageStats(0, 0, 0, 0)
        return PageStats(references=self.table.ids.numel(), pages=self.pool.pages_in_use(),
                         free=self.pool.free_pages(), record_bytes=self.pool.record_bytes)


@dataclass(frozen=True)
class PageStats:
    """One layer's pages: page-table entries (`references`), distinct pages they name (`pages`), free slots of the
    pool (`free`) and bytes per page (`record_bytes`)."""

    references: int
    pages: int
    free: int
    record_bytes: int
