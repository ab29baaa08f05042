"""`PagePool`: fixed-size pages of KIVI-quantized keys and values, one layer's, with reference counts and a free list.

A page holds `page_size` consecutive tokens of one batch row, every KV head: keys quantized per channel over groups
of `group_size` tokens, values per token over groups of `group_size` channels (`hf_kvcache.quant.kivi`). A page is
stored as one fixed-size byte record (codes, then the fp16 scales and zeros, viewed as bytes), so the pool is a
single uint8 tensor `data [capacity, record_bytes]`, as transformers' continuous-batching cache keeps one flat
uint8 tensor: two pages are equal exactly when their records are.

Pages are immutable once written. A page referenced by several page-table entries (rows that share a prefix) is
stored once; `refcount [capacity]` counts the references, and a page whose count falls to 0 goes back to the free
list (its slot is reused by the next page written; the storage stays allocated and is counted in the bytes held
until `compact()` gives it back).

Sharing by content (`add(..., share=True)`): every new record is looked up by a 16-byte blake2b digest of its bytes
and, when an equal record (verified byte for byte, so a digest collision never shares different pages) is already
in the pool, the existing page gets one more reference instead of a new slot. This is how the rows `generate`
expands for `num_return_sequences` or beams (identical rows, prefilled together) come to hold one copy of the prompt.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..quant.kivi import KIVIQuantized, dequantize_kivi, quantize_kivi

_FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


@dataclass(frozen=True)
class PageFormat:
    """Shape of one page: `kv_heads`, `page_size` tokens, `head_dim` / `value_dim` channels, `bits` per code,
    `group_size` tokens per key group and channels per value group."""

    kv_heads: int
    page_size: int
    head_dim: int
    value_dim: int
    bits: int
    group_size: int

    def check(self) -> None:
        for name, dim in (("head_dim", self.head_dim), ("value_dim", self.value_dim)):
            if dim % self.group_size:
                raise ValueError(f"group_size={self.group_size} must divide the model's {name}={dim}; pick a divisor "
                                 f"of {dim} (it also sets the tokens per key group, so it must divide page_size)")


@dataclass(frozen=True)
class _Field:
    name: str
    offset: int  # bytes into the record
    shape: tuple[int, ...]  # per page, e.g. (kv_heads, page_size, packed head_dim)
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class QuantPages:
    """`n` pages, quantized: keys and values `KIVIQuantized` with leading dims `[n, kv_heads]`."""

    keys: KIVIQuantized
    values: KIVIQuantized

    @property
    def count(self) -> int:
        return self.keys.codes.shape[0]


def quantize_pages(keys: torch.Tensor, values: torch.Tensor, fmt: PageFormat) -> QuantPages:
    """Quantize whole pages: `keys [n, kv_heads, page_size, head_dim]`, `values [.., value_dim]`."""
    k = quantize_kivi(keys, fmt.bits, fmt.group_size, axis="channel")
    v = quantize_kivi(values, fmt.bits, fmt.group_size, axis="token")
    return QuantPages(k, v)


class PagePool:
    """The pages of one layer (see the module docstring). Ids index `data` rows; `refcount[id]` is the number of
    page-table entries that reference the page (0: free)."""

    def __init__(self, fmt: PageFormat, device: torch.device) -> None:
        fmt.check()
        self.fmt = fmt
        self.device = device
        probe = quantize_pages(torch.zeros(1, fmt.kv_heads, fmt.page_size, fmt.head_dim),
                               torch.zeros(1, fmt.kv_heads, fmt.page_size, fmt.value_dim), fmt)
        fields, offset = [], 0
        for name, t in zip(_FIELDS, (*_tensors(probe.keys), *_tensors(probe.values))):
            f = _Field(name, offset, tuple(t.shape[1:]), t.dtype)
            fields.append(f)
            offset += f.nbytes  # every field is a whole number of 2-byte units or uint8: fp16 fields stay aligned
        self.fields = fields
        self.record_bytes = offset
        self.data = torch.empty(0, offset, dtype=torch.uint8, device=device)
        self.refcount = torch.zeros(0, dtype=torch.int32, device=device)
        self._free: list[int] = []
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}

    # ---- encoding ------------------------------------------------------------------------------------------------
    def encode(self, pages: QuantPages) -> torch.Tensor:
        """`[n, record_bytes]` uint8 records of `pages`."""
        n = pages.count
        tensors = (*_tensors(pages.keys), *_tensors(pages.values))
        parts = [t.reshape(n, -1).contiguous().view(torch.uint8) for t in tensors]
        return torch.cat(parts, 1)

    def decode(self, records: torch.Tensor) -> QuantPages:
        """The pages of `records [n, record_bytes]`."""
        n = records.shape[0]
        t = {f.name: records[:, f.offset : f.offset + f.nbytes].contiguous().view(f.dtype).reshape(n, *f.shape)
             for f in self.fields}
        fmt = self.fmt
        g = fmt.group_size
        keys = KIVIQuantized(t["k_codes"], t["k_scale"], t["k_zero"], fmt.bits, g, "channel", fmt.head_dim)
        values = KIVIQuantized(t["v_codes"], t["v_scale"], t["v_zero"], fmt.bits, g, "token", fmt.value_dim)
        return QuantPages(keys, values)

    def read(self, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized pages `ids [n]`: keys `[n, kv_heads, page_size, head_dim]` and values, in `dtype`."""
        pages = self.decode(self.data.index_select(0, ids.to(self.device, torch.long)))
        return dequantize_kivi(pages.keys, dtype), dequantize_kivi(pages.values, dtype)

    # ---- allocation and references -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    def pages_in_use(self) -> int:
        return self.capacity - len(self._free)

    def free_pages(self) -> int:
        return len(self._free)

    def add(self, records: torch.Tensor, share: bool) -> torch.Tensor:
        """Store `records [n, record_bytes]` as pages with one reference each; returns their ids `[n]` (int64).
        With `share`, a record equal to a page already held (or to an earlier record of this call) takes that page."""
        n = records.shape[0]
        ids = torch.empty(n, dtype=torch.long)
        fresh: list[int] = []  # rows of `records` that need a slot
        slot_of_row: dict[int, int] = {}  # for shared rows: the row (of this call) or page they equal
        pending: dict[bytes, int] = {}
        digests: list[bytes | None] = [None] * n
        host = records.cpu() if share else None
        for i in range(n):
            if not share:
                fresh.append(i)
                continue
            d = hashlib.blake2b(host[i].numpy().tobytes(), digest_size=16).digest()
            digests[i] = d
            page = self._by_digest.get(d)
            if page is not None and torch.equal(self.data[page], records[i]):
                ids[i] = page
                continue
            first = pending.get(d)
            if first is not None and torch.equal(records[first], records[i]):
                slot_of_row[i] = first
                continue
            pending.setdefault(d, i)
            fresh.append(i)
            ids[i] = -1
        slots = self._alloc(len(fresh))
        if fresh:
            rows = torch.tensor(fresh, dtype=torch.long, device=records.device)
            self.data.index_copy_(0, slots.to(self.device), records.index_select(0, rows).to(self.device))
            ids[fresh] = slots
            if share:
                for i, slot in zip(fresh, slots.tolist()):
                    d = digests[i]
                    if d not in self._by_digest:
                        self._by_digest[d] = slot
                        self._digest_of[slot] = d
        for i, first in slot_of_row.items():
            ids[i] = ids[first]
        self.retain(ids)
        return ids

    def copy(self, ids: torch.Tensor) -> torch.Tensor:
        """Private copies of pages `ids [n]` (one reference each, never shared by content): the unshared mode's
        answer to a row duplicated by a batch operation."""
        slots = self._alloc(ids.numel())
        self.data.index_copy_(0, slots.to(self.device), self.data.index_select(0, ids.to(self.device)))
        self.retain(slots)
        return slots

    def retain(self, ids: torch.Tensor) -> None:
        """One more reference to each entry of `ids` (repeats count once each)."""
        if ids.numel():
            ids = ids.reshape(-1).to(self.device, torch.long)
            self.refcount.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def release(self, ids: torch.Tensor) -> None:
        """One reference less to each entry of `ids`; pages left with none go back to the free list."""
        if not ids.numel():
            return
        ids = ids.reshape(-1).to(self.device, torch.long)
        self.refcount.index_add_(0, ids, torch.full_like(ids, -1, dtype=torch.int32))
        touched = torch.unique(ids)
        counts = self.refcount[touched]
        if bool((counts < 0).any()):
            raise RuntimeError("a page was released more often than it was referenced (page-table bookkeeping bug)")
        for page in touched[counts == 0].tolist():
            self._free.append(page)
            d = self._digest_of.pop(page, None)
            if d is not None:
                del self._by_digest[d]

    def _alloc(self, n: int) -> torch.Tensor:
        """`n` free slots (refcount 0), growing `data` by exactly the shortfall."""
        take = min(n, len(self._free))
        slots = [self._free.pop() for _ in range(take)]
        grow = n - take
        if grow:
            start = self.capacity
            self.data = torch.cat([self.data, self.data.new_empty(grow, self.record_bytes)])
            self.refcount = torch.cat([self.refcount, self.refcount.new_zeros(grow)])
            slots.extend(range(start, start + grow))
        return torch.tensor(slots, dtype=torch.long)

    def compact(self, table: torch.Tensor) -> torch.Tensor:
        """Give the free slots' storage back: pages in use move to slots `0..pages_in_use - 1` (in id order) and the
        pool shrinks to them. Returns `table` (any shape of page ids) renumbered."""
        used = (self.refcount > 0).nonzero().flatten()
        remap = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)
        remap[used] = torch.arange(used.numel(), device=self.device)
        self.data = self.data.index_select(0, used)
        self.refcount = self.refcount.index_select(0, used)
        self._free = []
        moved = remap.tolist()
        self._by_digest = {d: moved[page] for d, page in self._by_digest.items()}
        self._digest_of = {page: d for d, page in self._by_digest.items()}
        return remap[table.to(self.device, torch.long)].to(table.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.refcount]


def _tensors(q: KIVIQuantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.codes, q.scale, q.zero
