"""`QueryRing`: the queries of the last positions a layer's attention reported (`observe_queries`).

Window policies (TOVA, SnapKV) recompute from them the attention of a window of recent queries at every eviction
(`window_attention`). Layers that rank tokens by the attention mass they received (H2O, CPAC) keep them so that
`crop` can take out the mass the cropped queries gave: it recomputes their attention over the held keys
(`QueryRing.attention`) and subtracts it, so a cropped cache goes on as the cache that never saw the cropped tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .attention import window_attention, window_logits

RowFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class QueryRing:
    """The queries `[batch, heads, w, head_dim]` (post-RoPE; `queries`) of the positions `positions [w]` (int64,
    ascending), `valid [batch, w]` (False: a padding query), the attention `scaling`, and `forwards`: (start, end) of
    each forward whose queries the ring holds (a crop inside a forward needs its bounds when the mass decays).

    `stored`: the queries themselves, or (`query_scale` given) their int8 codes, each query vector scaled by its own
    absolute maximum / 127 (`query_scale [batch, heads, w, 1]` fp16): an 8-bit ring for caches that store their
    tokens quantized, where 16-bit queries would hold a large share of the bytes (GQA: more query heads than KV)."""

    stored: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    scaling: float = 1.0
    forwards: tuple[tuple[int, int], ...] = ()
    query_scale: torch.Tensor | None = None

    @classmethod
    def of_forward(cls, queries: torch.Tensor, start: int, end: int, scaling: float, dtype: torch.dtype) -> "QueryRing":
        """The last `w` queries `[batch, heads, w, head_dim]` of a forward of positions `start .. end - 1`, copied
        in `dtype` (a slice would keep the model's whole query tensor alive); `torch.int8`: 8-bit codes, one fp16
        scale per query vector."""
        w = queries.shape[2]
        q, scale = queries.detach(), None
        if dtype == torch.int8:
            scale = (q.float().abs().amax(-1, keepdim=True) / 127).clamp_min(1e-7).half()  # fp16 before the codes
            q = (q.float() / scale.float()).round_().clamp_(-127, 127).to(torch.int8)
        else:
            q = q.to(dtype).clone(memory_format=torch.contiguous_format)
        pos = torch.arange(end - w, end, device=q.device)
        valid = torch.ones(q.shape[0], w, dtype=torch.bool, device=q.device)
        return cls(q, pos, valid, float(scaling), ((start, end),), scale)

    @property
    def queries(self) -> torch.Tensor:
        """`[batch, heads, w, head_dim]`: as stored, or decoded to float32 from the 8-bit codes."""
        return self.stored if self.query_scale is None else self.stored.float() * self.query_scale.float()

    def __len__(self) -> int:
        return self.positions.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [self.stored, self.positions, self.valid] + ([] if self.query_scale is None else [self.query_scale])

    def _per_query(self, fn: RowFn) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`fn` applied to the stored queries and their scales."""
        return fn(self.stored), None if self.query_scale is None else fn(self.query_scale)

    def map_rows(self, fn: RowFn) -> "QueryRing":
        """A batch-dim operation (beam reorder, row selection, repetition) on the per-row tensors."""
        stored, scale = self._per_query(fn)
        return QueryRing(stored, self.positions, fn(self.valid), self.scaling, self.forwards, scale)

    def select(self, keep: torch.Tensor) -> "QueryRing":
        """The queries where `keep [w]` (bool) is True, copied; `forwards` cut to the positions kept."""
        pos = self.positions[keep].clone()
        stored, scale = self._per_query(lambda t: t[:, :, keep].clone())
        ring = QueryRing(stored, pos, self.valid[:, keep].clone(), self.scaling, query_scale=scale)
        if len(pos):
            first, last = int(pos[0]), int(pos[-1]) + 1
            ring.forwards = tuple((s, min(e, last)) for s, e in self.forwards if e > first and s < last)
        return ring

    def last(self, w: int) -> "QueryRing":
        """The newest `w` queries (the ring itself when it holds no more)."""
        if len(self) <= w:
            return self
        keep = torch.zeros(len(self), dtype=torch.bool, device=self.positions.device)
        keep[len(self) - w :] = True
        return self.select(keep)

    def before(self, end: int) -> "QueryRing":
        """The queries of positions `< end` (what is left after a crop to `end` tokens)."""
        return self.select(self.positions < end)

    def extend(self, newer: "QueryRing", length: int) -> "QueryRing":
        """This ring followed by `newer`, keeping the newest `length` queries (just `newer` when the batch changed)."""
        if self.stored.shape[0] != newer.stored.shape[0] or self.stored.dtype != newer.stored.dtype:
            return newer.last(length)
        scale = None if self.query_scale is None else torch.cat([self.query_scale, newer.query_scale], 2)
        ring = QueryRing(
            torch.cat([self.stored, newer.stored], 2), torch.cat([self.positions, newer.positions]),
            torch.cat([self.valid, newer.valid], 1), newer.scaling, self.forwards + newer.forwards, scale,
        )
        return ring.last(length)

    def mark_invisible(self, visible: torch.Tensor, newest: int) -> None:
        """A padding position is no query either: `visible [batch, tokens]` (the keys of the last update) clears
        `valid` of the `newest` queries (those of that update)."""
        w = min(newest, len(self))
        if w:
            self.valid[:, -w:] &= visible[:, -w:].to(self.valid.device)

    def covers(self, start: int, end: int) -> bool:
        """Whether the ring holds the queries of every position `start .. end - 1`."""
        return int(((self.positions >= start) & (self.positions < end)).sum()) == end - start

    def forward_of(self, position: int) -> tuple[int, int] | None:
        """(start, end) of the forward that brought `position`, if the ring knows it."""
        return next(((s, e) for s, e in self.forwards if s <= position < e), None)

    def attention(
        self, keys: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """`[batch, kv_heads, end - start, slots]` float32: the attention the queries of positions `start .. end - 1`
        gave the keys `[batch, kv_heads, slots, head_dim]` (`key_positions` / `key_valid [batch, kv_heads, slots]`),
        each query seeing the valid keys up to its position. Queries kept in the keys' (the model's) dtype give the
        logits in that dtype, as the attention computed them, so that subtracting the result undoes what it added;
        otherwise they are computed in float32."""
        keep = (self.positions >= start) & (self.positions < end)
        queries = self.queries
        return window_attention(window_logits(
            queries[:, :, keep], self.positions[keep], self.valid[:, keep], keys, key_positions, key_valid,
            self.scaling, in_dtype=queries.dtype == keys.dtype,
        ))
