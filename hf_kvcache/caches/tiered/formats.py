"""Which archive format codes which positions of a tiered layer (`ArchiveFormatChoice`, a mixin of
`TieredQuantLayer`): the formats kept with their fitted state, the one a position or a stored tier takes, and what the
next archive group will cost (the memory target's sizing)."""

from __future__ import annotations

import dataclasses
import functools

from ..archive import FORMAT_CLASSES, ArchiveCosts, ArchiveFormat
from ..tiers import QuantTier, TierSpec, format_of, widths


class ArchiveFormatChoice:
    """The format half of `TieredQuantLayer` (see `layer.TieredQuantLayer`): methods only; the formats live in the
    layer's `formats` (by name; "warm": the warm tier's KIVI codes)."""

    @property
    def codebooks(self) -> tuple | None:
        """The KVQuant archive's (keys, values) codebooks, once fitted."""
        f = self.formats.get("kvquant")
        return None if f is None else f.codebooks

    def _archive_format(self, name: str, bits: int, key_bits: int | None = None) -> ArchiveFormat:
        """The layer's `name` format at `bits` bits (keys at `key_bits`; None: the archive spec's key width), kept
        with its fitted state while its spec stays the same."""
        spec = _spec_at(self.specs["arch"], bits, key_bits)
        f = self.formats.get(name)
        if f is None or (f.spec is not spec and f.spec != spec):
            f = self.formats[name] = FORMAT_CLASSES[name](self, spec)
        return f

    def _tier_format(self, q: QuantTier) -> ArchiveFormat:
        """The format that reads the archived tier `q` (by its format's name and its key and value widths: a tier
        whose keys have their own width is read by the format that wrote it, fitted state included)."""
        name, _ = format_of(q)
        key_bits, bits = widths(q)
        return self._archive_format(name, bits, key_bits)

    def _archive_name(self) -> str:
        """The layer's archive format: the one calibration chose (`recipe.archive_format`), else `archive_quantizer`."""
        chosen = None if self.recipe is None else self.recipe.archive_format
        return chosen or self.plan.archive_quantizer

    def _format_at(self, start: int) -> ArchiveFormat:
        """The format of the archive group starting at position `start` (adaptive: chosen by that position)."""
        p, name = self.plan, self._archive_name()
        if name != "adaptive":
            return self._archive_format(name, self.specs["arch"].bits)
        i = sum(start >= b for b in p.adaptive_boundaries)
        return self._archive_format(p.adaptive_formats[i], p.adaptive_bits[i])

    def _next_archive_format(self) -> ArchiveFormat:
        """The format of the next archive group (the one that starts where the archive ends)."""
        return self._format_at(self._tier_starts()["archive"] + self.tiers.tokens("archive"))

    def _waits_to_fit(self) -> bool:
        """Whether the next archive group's format still needs fitting and the warm tier holds fewer positions than
        `archive_fit_positions` to fit it on (the group then waits in the warm tier)."""
        return not self._next_archive_format().fitted and self.tiers.tokens("warm") < self.plan.archive_fit_positions

    def archive_costs(self) -> ArchiveCosts | None:
        """What the next archive group's format holds, once fitted (None: not fitted, or a format the memory target
        sizes from its spec)."""
        return self._next_archive_format().costs()

    def _format_runs(self, start: int, n: int) -> list[tuple[int, int, ArchiveFormat]]:
        """Positions `start..start+n` (whole archive groups) as runs (offset, length, format) of one format each."""
        g, runs = self.plan.archive_group, []
        for off in range(0, n, g):
            f = self._format_at(start + off)
            if runs and runs[-1][2] is f:
                runs[-1] = (runs[-1][0], runs[-1][1] + min(g, n - off), f)
            else:
                runs.append((off, min(g, n - off), f))
        return runs


@functools.lru_cache(maxsize=256)
def _spec_at(arch: TierSpec, bits: int, key_bits: int | None) -> TierSpec:
    """`arch` at `bits` bits, its keys at `key_bits` (None: as `arch` has them), kept: every decode step of every
    layer asks for the formats of its tiers."""
    spec = dataclasses.replace(arch, bits=bits)
    if key_bits is not None and key_bits != spec.kbits:
        spec = dataclasses.replace(spec, key_bits=key_bits)
    return spec
