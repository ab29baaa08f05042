"""Typed storage of the tiered layers: full-precision tiers (`PlainTier`), quantized tiers (`QuantTier`), a quantized
tier made of consecutive segments of different formats (`SegmentedTier`: the adaptive archive) and the four tiers of
one layer (`LayerTiers`: sink, archive, warm, tail).

Every tensor is laid out `[batch, kv_heads, rows, ...]`: batch-dim operations (beam reordering, row selection) map
over all of them with `map_rows`. `LayerTiers.state()` / `LayerTiers.from_state()` turn the tiers into named tensors
plus JSON metadata and back (the lossless codec stores a layer that way).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch

from ..quant.kivi import KIVIQuantized
from ..quant.kvquant import NUQCodebook, NUQQuantized
from ..quant.subspace import SubspaceBasis, SubspaceRows

Quantized = Union[KIVIQuantized, NUQQuantized, SubspaceRows]
RowFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TierSpec:
    """How a quantized tier of a tiered layer is coded: its width and group sizes."""

    bits: int
    key_group: int  # tokens per key group (per-channel keys) or channels per key group (per-token keys)
    value_group: int  # channels per value group
    key_bits: int | None = None  # the keys' width when it differs (None: bits)

    @property
    def kbits(self) -> int:
        return self.bits if self.key_bits is None else self.key_bits


@dataclass
class PlainTier:
    """Full-precision keys `[batch, kv_heads, tokens, head_dim]` and values `[.., value_dim]`."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.keys.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def map_rows(self, fn: RowFn) -> "PlainTier":
        return PlainTier(fn(self.keys), fn(self.values))

    def slice(self, start: int, stop: int | None = None) -> "PlainTier":
        """Tokens `start:stop`, copied (no view keeps the old storage alive)."""
        return PlainTier(self.keys[:, :, start:stop].clone(), self.values[:, :, start:stop].clone())

    def cat(self, other: "PlainTier") -> "PlainTier":
        return PlainTier(torch.cat([self.keys, other.keys], 2), torch.cat([self.values, other.values], 2))


@dataclass
class QuantTier:
    """Quantized keys and values of the same tokens (KIVI codes, or KVQuant's nuq codes with a shared codebook)."""

    keys: Quantized
    values: Quantized

    @property
    def tokens(self) -> int:
        return self.keys.tokens

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys.tensors(), *self.values.tensors()]

    def map_rows(self, fn: RowFn) -> "QuantTier":
        return QuantTier(self.keys.map_rows(fn), self.values.map_rows(fn))

    def slice(self, start: int, stop: int | None = None) -> "QuantTier":
        """Tokens `start:stop` (on group boundaries), copied."""
        return QuantTier(self.keys.slice(start, stop).clone(), self.values.slice(start, stop).clone())

    def cat(self, other: "QuantTier | SegmentedTier") -> "QuantTier | SegmentedTier":
        """`self` followed by `other`: one tier when both have the same format, else a `SegmentedTier`."""
        if isinstance(other, QuantTier) and same_format(self, other):
            return QuantTier(self.keys.cat(other.keys), self.values.cat(other.values))
        return SegmentedTier([self]).cat(other)

    def segments(self) -> list["QuantTier"]:
        return [self]


def format_of(q: QuantTier) -> tuple[str, int]:
    """(format name, bit width) of a quantized tier: "kivi", "kvquant" or "subspace"."""
    k = q.keys
    if isinstance(k, KIVIQuantized):
        return "kivi", k.bits
    if isinstance(k, NUQQuantized):
        return "kvquant", k.codebook.bits
    if isinstance(k, SubspaceRows):
        return "subspace", k.nominal_bits or k.bits[0]
    raise TypeError(f"unknown quantized tier type {type(k).__name__}")


def widths(q: QuantTier) -> tuple[int, int]:
    """(key bits, value bits) of a quantized tier (one width for both unless the archive has its own key width)."""
    _, bits = format_of(q)
    if isinstance(q.values, KIVIQuantized):
        return bits, q.values.bits
    if isinstance(q.values, NUQQuantized):
        return bits, q.values.codebook.bits
    return bits, q.values.nominal_bits or q.values.bits[0]


def same_format(a: QuantTier, b: QuantTier) -> bool:
    """Whether two tiers hold the same format at the same widths (their codes can be concatenated)."""
    return format_of(a) == format_of(b) and widths(a) == widths(b)


def format_label(q: QuantTier) -> str:
    """"kivi-2", "kvquant-3", ...; "kivi-3/2" for 3-bit keys with 2-bit values."""
    name, _ = format_of(q)
    k, v = widths(q)
    return f"{name}-{k}" if k == v else f"{name}-{k}/{v}"


@dataclass
class SegmentedTier:
    """Consecutive quantized segments of different formats, oldest first (the adaptive archive: positions archived
    before a format switch keep their format). Behaves as one tier: slicing crosses segments (on group boundaries),
    `cat` extends the last segment when the format is the same and starts a new one otherwise."""

    parts: list[QuantTier]

    @property
    def tokens(self) -> int:
        return sum(q.tokens for q in self.parts)

    def segments(self) -> list[QuantTier]:
        return list(self.parts)

    def tensors(self) -> list[torch.Tensor]:
        return [x for q in self.parts for x in q.tensors()]

    def map_rows(self, fn: RowFn) -> "SegmentedTier":
        return SegmentedTier([q.map_rows(fn) for q in self.parts])

    def slice(self, start: int, stop: int | None = None) -> "QuantTier | SegmentedTier":
        stop = self.tokens if stop is None else stop
        out, lo = [], 0
        for q in self.parts:
            hi = lo + q.tokens
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                out.append(q.slice(a - lo, b - lo))
            lo = hi
        if not out:
            raise ValueError(f"empty slice {start}:{stop} of a {self.tokens}-token tier")
        return out[0] if len(out) == 1 else SegmentedTier(out)

    def cat(self, other: "QuantTier | SegmentedTier") -> "SegmentedTier":
        parts = list(self.parts)
        for q in other.segments():
            if same_format(parts[-1], q):
                parts[-1] = QuantTier(parts[-1].keys.cat(q.keys), parts[-1].values.cat(q.values))
            else:
                parts.append(q)
        return SegmentedTier(parts)


Tier = Union[PlainTier, QuantTier, SegmentedTier]
TIER_NAMES = ("sink", "archive", "warm", "tail")  # sink overlays the first positions; then oldest to newest
_TYPES = {c.__name__: c for c in (PlainTier, QuantTier, SegmentedTier, KIVIQuantized, NUQQuantized, NUQCodebook,
                                  SubspaceRows, SubspaceBasis)}


@dataclass
class LayerTiers:
    """The tiers of one layer; an empty tier is None."""

    sink: PlainTier | None = None
    archive: QuantTier | SegmentedTier | None = None
    warm: QuantTier | None = None
    tail: PlainTier | None = None

    def tokens(self, tier: str) -> int:
        t = getattr(self, tier)
        return 0 if t is None else t.tokens

    def held(self) -> int:
        """Positions held (the sinks lie over positions another tier holds)."""
        return self.tokens("archive") + self.tokens("warm") + self.tokens("tail")

    def present(self) -> list[Tier]:
        return [t for t in (getattr(self, n) for n in TIER_NAMES) if t is not None]

    def tensors(self) -> list[torch.Tensor]:
        return [x for t in self.present() for x in t.tensors()]

    def batch(self) -> int:
        tiers = self.present()
        return tiers[0].tensors()[0].shape[0] if tiers else 0

    def map_rows(self, fn: RowFn) -> "LayerTiers":
        return LayerTiers(**{n: None if t is None else t.map_rows(fn) for n, t in self._items()})

    def _items(self):
        return ((n, getattr(self, n)) for n in TIER_NAMES)

    # ---- serialization ------------------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(JSON metadata, named tensors) of every tier."""
        meta, tensors = {}, {}
        for name, tier in self._items():
            if tier is not None:
                meta[name] = _flatten(tier, name, tensors)
        return meta, tensors

    @classmethod
    def from_state(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device) -> "LayerTiers":
        out = cls()
        for name, m in meta.items():
            if name not in TIER_NAMES:
                raise ValueError(f"corrupt tiered layer state: unknown tier {name!r}")
            setattr(out, name, _unflatten(m, name, tensors, device))
        return out


def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    meta: dict[str, Any] = {"type": type(obj).__name__}
    for f in dataclasses.fields(obj):
        v, key = getattr(obj, f.name), f"{prefix}.{f.name}"
        if isinstance(v, torch.Tensor):
            tensors[key] = v.detach().cpu().contiguous()
        elif dataclasses.is_dataclass(v):
            meta[f.name] = _flatten(v, key, tensors)
        elif isinstance(v, list) and v and all(dataclasses.is_dataclass(x) for x in v):  # SegmentedTier.parts
            meta[f.name] = [_flatten(x, f"{key}.{i}", tensors) for i, x in enumerate(v)]
        else:
            meta[f.name] = v
    return meta


def _unflatten(meta: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
    cls = _TYPES.get(meta.get("type"))
    if cls is None:
        raise ValueError(f"corrupt tiered layer state: unknown type {meta.get('type')!r} at {prefix}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if key in tensors:
            kwargs[f.name] = tensors[key].to(device)
        elif isinstance(meta.get(f.name), dict):
            kwargs[f.name] = _unflatten(meta[f.name], key, tensors, device)
        elif isinstance(meta.get(f.name), list) and meta[f.name] and all(
                isinstance(x, dict) and "type" in x for x in meta[f.name]):
            kwargs[f.name] = [_unflatten(x, f"{key}.{i}", tensors, device) for i, x in enumerate(meta[f.name])]
        elif f.name in meta:
            kwargs[f.name] = meta[f.name]
        else:
            raise ValueError(f"corrupt tiered layer state: {key} missing")
    return cls(**kwargs)
