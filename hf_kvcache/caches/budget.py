"""The tiered cache's memory target: how many positions its warm tier may keep so that the whole cache stays at
`target_ratio` times smaller than fp16.

Positions cost a fixed number of bytes in each tier (full precision in the tail and the sinks, KIVI codes plus their
fp16 scales and zeros in the warm tier and in the archive), so the bytes a layer holds at length N follow from how
many positions its warm tier keeps. `RatioBudget` gives every full-attention layer the same share of the cache's
allowance, `fp16 bytes / target_ratio`, after what the sliding-window layers hold (they keep a window at their own
widths and are not sized by the budget), and turns a layer's share into warm positions: the newest positions get the
warm tier's width as far as the memory target allows, the rest the archive's. Short contexts cannot reach the target
(the tail alone is a large share of them); the warm tier then keeps `warm_length`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .accounting import FP16_BYTES, held_bytes
from .archive import KIVIFormat

if TYPE_CHECKING:  # pragma: no cover
    from .tiered import TieredQuantLayer


@dataclass(frozen=True)
class PositionCosts:
    """Bytes one position of one KV head costs in each tier of a layer (keys and values together)."""

    exact: float  # tail and sinks
    warm: float
    archive: float
    fixed: float = 0.0  # the archive format's fitted state (bases), per batch row and KV head, whatever the length


def position_costs(layer: "TieredQuantLayer") -> PositionCosts:
    """The per-position bytes of `layer`'s tiers, as their formats say (`ArchiveFormat.costs`: KIVI codes from their
    specs, a subspace archive's allocated widths and bases once fitted); an archive format that does not say yet is
    sized as KIVI codes of the archive's spec."""
    archive = layer.archive_costs() or KIVIFormat(layer, layer.specs["arch"]).costs()
    return PositionCosts((layer.head_dim + layer.value_dim) * layer.tail_dtype.itemsize,
                         layer.formats["warm"].costs().position, archive.position,
                         archive.fixed / (layer.batch_size() * layer.num_heads))


def fitted_warm_floor(layer: "TieredQuantLayer") -> int:
    """The warm positions `layer` keeps at least (`fitted_state_from_warm`): `warm_length`, less the positions whose
    move to the archive pays for the archive format's fitted state, so that the layer holds no more bytes than with
    a KIVI archive of the archive's spec and `warm_length` warm positions (whole groups, room left for the archive
    group that waits in the warm tier, 0 at the least); just `warm_length` while the format is unfitted or holds no
    fitted state."""
    p, c = layer.plan, position_costs(layer)  # an unfitted format is costed as KIVI codes: no fixed bytes
    if not c.fixed or c.warm <= c.archive:
        return p.warm_length
    kivi = KIVIFormat(layer, layer.specs["arch"]).costs().position
    coded = max(0, layer.cumulative_length - p.tail_length - p.sink_length)  # positions in the warm tier or archive
    spare = (c.warm - kivi) * p.warm_length + (kivi - c.archive) * coded - c.fixed
    room = spare / (c.warm - c.archive)
    if room >= p.warm_length:
        return p.warm_length
    room -= p.archive_group - p.group_size  # a partly filled archive group waits in the warm tier
    return max(0, int(room) // p.group_size * p.group_size)


@dataclass
class RatioBudget:
    """Sizes the warm tier of every full-attention tiered layer of `layers` (a cache's layer list) so that the cache
    holds at most its fp16-equivalent bytes / `target`."""

    target: float
    layers: list

    def _fp16(self, layer, seen: int) -> float:
        tokens = seen if layer.sliding_window is None else min(seen, layer.sliding_window - 1)
        return FP16_BYTES * layer.batch_size() * layer.num_heads * tokens * (layer.head_dim + layer.value_dim)

    def warm_positions(self, layer: "TieredQuantLayer") -> int:
        """The warm positions `layer` may keep now (0 when even an empty warm tier exceeds its share), whole groups,
        with room for the archive group that waits in the warm tier until it is complete."""
        seen = layer.cumulative_length
        full = [la for la in self.layers if getattr(la, "is_initialized", False) and la.sliding_window is None]
        others = [la for la in self.layers if getattr(la, "is_initialized", False) and la.sliding_window is not None]
        if layer not in full:
            return 0
        fp16_full = sum(self._fp16(la, seen) for la in full)
        allowance = (sum(self._fp16(la, seen) for la in full + others) / self.target
                     - sum(held_bytes(la.stored_tensors()) for la in others))
        share = allowance * self._fp16(layer, seen) / fp16_full / (layer.batch_size() * layer.num_heads)
        p, c = layer.plan, position_costs(layer)
        tail = p.tail_length + p.group_size - 1  # the most the tail holds between graduations
        if c.warm <= c.archive:
            return seen
        held = c.fixed + c.exact * (tail + p.sink_length) + c.archive * max(0, seen - tail)
        room = (share - held) / (c.warm - c.archive)
        room -= p.archive_group - p.group_size  # a partly filled archive group waits in the warm tier
        return max(0, int(room) // p.group_size * p.group_size)
