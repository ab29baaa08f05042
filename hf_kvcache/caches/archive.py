"""Archive formats of the tiered cache: one small class per way of quantizing archived positions.

A format turns full-precision keys/values of positions `start..` into a `QuantTier` and back:

* `prepare(keys, values, start, rotated)`: into the space its codes live in (KIVI: the layer's Hadamard-rotated
  basis; KVQuant and subspace: pre-RoPE keys, RoPE undone with the layer's `KeyRotation`) -- also what the quality
  tracker compares the codes with;
* `fit(keys, values)` (prepared, the first positions archived): the fitted state (KVQuant's codebooks, the subspace
  PCA bases), kept for later sequences; `fitted` says whether it is there;
* `encode(keys, values)` (prepared) -> `QuantTier`; `decode(q, start, rotated)` -> float32 keys/values;
* `adopt(q)`: take the fitted state back from a tier the codec restored;
* `costs()`: the bytes its codes hold per position and once per layer, once fitted (the memory target's sizing).

The fitted tensors live inside the codes (`NUQQuantized.codebook`, `SubspaceRows.basis`), so a tier's `tensors()`
counts them (once per layer: every block shares the same objects). Which format a stored tier is in follows from its
type (`format_of`); the adaptive archive keeps consecutive segments of different formats (`caches.tiers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..quant.kivi import dequantize_kivi, quantize_kivi
from ..quant.kvquant import dequantize_nuq, fit_codebook, quantize_nuq
from ..quant.packing import packed_length
from ..quant.subspace import (SubspaceBasis, allocate_bits, dequantize_subspace_rows, fit_subspace,
                              quantize_subspace_rows, subspace_plan)
from .accounting import FP16_BYTES, SCALE_ZERO_BYTES
from .tiers import QuantTier, TierSpec, format_of

if TYPE_CHECKING:  # pragma: no cover
    from ..quant.rotation import HadamardRotation
    from ..rope import KeyRotation


ARCHIVE_FORMATS = ("kivi", "kvquant", "subspace")
__all__ = ["ARCHIVE_FORMATS", "ArchiveCosts", "ArchiveFormat", "FORMAT_CLASSES", "KIVIFormat", "KVQuantFormat",
           "SubspaceFormat", "format_of"]


class FormatHost(Protocol):
    """What a format reads from the layer it codes for (a `TieredQuantLayer`): its options, the model's RoPE (pre-RoPE
    formats), the Hadamard rotations calibration chose (KIVI codes live in that basis), and its clipping choices."""

    plan: Any  # the layer's `TieredQuantOptions`
    head_dim: int
    value_dim: int
    rope: KeyRotation | None
    rot_k: HadamardRotation | None
    rot_v: HadamardRotation | None
    rot_dtype: torch.dtype

    def clips(self, tensor: str) -> bool: ...

    def quant_args(self, tier: "str | TierSpec") -> tuple[dict, dict]: ...


@dataclass(frozen=True)
class ArchiveCosts:
    """Bytes a fitted archive format holds: `position` per position and KV head (keys and values together, scales
    included), `fixed` once per layer whatever its length (the fitted state: bases, codebooks)."""

    position: float
    fixed: int


class ArchiveFormat:
    """Base of the formats (see the module docstring); `spec` carries the bit width and group sizes."""

    name = ""
    needs_fit = False  # a fitted state (codebooks, bases) comes from the first positions archived
    rotated = False  # codes live in the layer's rotated basis (KIVI): prepare/decode may take/give it directly

    def __init__(self, layer: FormatHost, spec: TierSpec) -> None:
        self.layer, self.spec = layer, spec

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def label(self) -> str:
        return f"{self.name}-{self.bits}"

    @property
    def fitted(self) -> bool:
        return True

    def fit(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fit on prepared keys/values of the first positions archived (whole archive groups are used)."""

    def prepare(self, keys: torch.Tensor, values: torch.Tensor, start: int, rotated: bool = False):
        raise NotImplementedError

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> QuantTier:
        raise NotImplementedError

    def decode(self, q: QuantTier, start: int, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def adopt(self, q: QuantTier) -> None:
        """Take the fitted state from a restored tier of this format."""

    def moves(self, warm_spec: Any) -> bool:
        """Whether warm-tier codes can move into this format unchanged (no re-quantization)."""
        return False

    def costs(self) -> ArchiveCosts | None:
        """What this format's codes hold, once fitted (None: not fitted yet, or a format that does not say; the
        budget then sizes it as KIVI codes of its spec)."""
        return None

    def _whole_groups(self, x: torch.Tensor) -> torch.Tensor:
        g = self.layer.plan.archive_group
        n = x.shape[2] // g * g
        if n == 0:
            raise ValueError(f"the {self.name} archive fits on whole archive groups of {g} positions, got {x.shape[2]}")
        return x[:, :, :n]


class KIVIFormat(ArchiveFormat):
    """KIVI's uniform min/max codes (`quant.kivi`), in the layer's rotated basis (also the warm tier's format)."""

    name = "kivi"
    rotated = True

    def prepare(self, keys, values, start, rotated=False):
        la = self.layer
        if la.rot_k is not None and not rotated:
            keys = la.rot_k.rotate(keys)
        if la.rot_v is not None and not rotated:
            values = la.rot_v.rotate(values)
        return keys, values

    def encode(self, keys, values):
        ka, va = self.layer.quant_args(self.spec)
        return QuantTier(quantize_kivi(keys, **ka), quantize_kivi(values, **va))

    def decode(self, q, start, rotated=False):
        la = self.layer
        keys, values = dequantize_kivi(q.keys), dequantize_kivi(q.values)
        if not rotated:  # un-rotated exactly as `materialize_into` does it, so a reopened group reads back what attention saw
            dt = la.rot_dtype
            keys = keys if la.rot_k is None else la.rot_k.unrotate(keys.to(dt))
            values = values if la.rot_v is None else la.rot_v.unrotate(values.to(dt))
        return keys, values

    def roundtrip(self, x: torch.Tensor, rotation: Any, args: dict) -> torch.Tensor:
        """Keys or values `x` `[B, H, T, D]` as `encode` / `decode` give them back when rotated by `rotation` (a
        `quant.rotation` object or None) and coded with `quantize_kivi(x, **args)` (`args`: the layer's
        `quant_args`): the half of a calibration round trip."""
        x = x if rotation is None else rotation.rotate(x)
        out = dequantize_kivi(quantize_kivi(x, **args))
        return out if rotation is None else rotation.unrotate(out.to(self.layer.rot_dtype))

    def moves(self, warm_spec):
        return self.spec == warm_spec

    def costs(self):
        # per-channel key groups: a scale and zero per channel every `key_group` positions; per-token value groups:
        # one per `value_group` channels
        spec, hd, vd = self.spec, self.layer.head_dim, self.layer.value_dim
        keys = packed_length(hd, spec.kbits) + SCALE_ZERO_BYTES * hd / spec.key_group
        values = packed_length(vd, spec.bits) + SCALE_ZERO_BYTES * vd / spec.value_group
        return ArchiveCosts(keys + values, 0)


class _PreRoPEFormat(ArchiveFormat):
    """A fitted format whose keys are quantized before RoPE (undone with the layer's `KeyRotation`, put back at
    read) when `prerope`."""

    prerope = True

    def prepare(self, keys, values, start, rotated=False):
        keys = self.layer.rope.derotate(keys, start) if self.prerope else keys.float()
        return keys, values.float()

    def _keys_back(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        return self.layer.rope.rotate(keys, start) if self.prerope else keys


class KVQuantFormat(_PreRoPEFormat):
    """KVQuant's nuq codes (`quant.kvquant`): levels fitted per KV head and channel, pre-RoPE per-channel keys,
    per-token values, the `archive_outliers` fraction of each token's entries exact in fp16."""

    name = "kvquant"
    needs_fit = True

    def __init__(self, layer, spec):
        super().__init__(layer, spec)
        self.codebooks: tuple | None = None

    @property
    def fitted(self):
        return self.codebooks is not None

    def fit(self, keys, values):
        p = self.layer.plan
        keys, values = self._whole_groups(keys), self._whole_groups(values)
        self.codebooks = (
            fit_codebook(keys, self.spec.kbits, "channel", p.archive_group, p.archive_outliers),
            fit_codebook(values, self.bits, "token", p.value_group_size, p.archive_outliers),
        )

    def encode(self, keys, values):
        la = self.layer
        # the nuq clip search only where clip_on names the tensors: under "auto" it cost Gemma-3-270M (values
        # clipped, outliers 0.005, no warm tier) +3.15 % against -0.41 % unclipped, at 4.31x
        clip = la.plan.clip_search and la.plan.clip_on != "auto"
        return QuantTier(quantize_nuq(keys, self.codebooks[0], clip and la.clips("keys")),
                         quantize_nuq(values, self.codebooks[1], clip and la.clips("values")))

    def decode(self, q, start, rotated=False):
        return self._keys_back(dequantize_nuq(q.keys), start), dequantize_nuq(q.values)

    def adopt(self, q):
        self.codebooks = (q.keys.codebook, q.values.codebook)


class SubspaceFormat(_PreRoPEFormat):
    """Codes in an orthogonal basis fitted per KV head (`quant.subspace`, PCA of the first positions archived):
    keys per direction over archive groups of tokens (axis "channel"; pre-RoPE unless `subspace_prerope=False`),
    values with per-token scales per subspace of `value_group_size or group_size` directions (axis "token").

    Widths: with `subspace_allocation` the width x rank code bits of a token (keys: `archive_key_bits` if set, else
    `archive_bits`; values: `archive_bits`) are spread over subspaces (keys: of `KEY_SUBSPACE` directions) by reverse
    water-filling on the fitted variances (`allocate_bits`): leading directions get more bits, trailing ones may get
    none and are dropped; else every direction gets the width. `archive_rank` keeps only the leading directions (and
    the budget shrinks with them)."""

    name = "subspace"
    needs_fit = True
    KEY_SUBSPACE = 8  # directions per key subspace: the allocation's granularity (keys have per-direction scales)

    def __init__(self, layer, spec):
        super().__init__(layer, spec)
        self.bases: tuple | None = None
        self.widths: tuple | None = None  # (keys, values): (bits per subspace, directions per subspace)
        self.prerope = layer.plan.subspace_prerope

    @property
    def fitted(self):
        return self.bases is not None

    def fit(self, keys, values):
        p = self.layer.plan
        bases, widths = [], []
        for x, group, axis, width in ((keys, self.KEY_SUBSPACE, "channel", self.spec.kbits),
                                      (values, p.value_group_size or p.group_size, "token", self.bits)):
            b = fit_subspace(self._whole_groups(x), p.archive_rank)
            group = min(group, b.rank)
            if p.subspace_allocation:
                bits = allocate_bits(b, width * b.rank, group, axis)
                rank = sum(min(group, b.rank - i * group) for i, w in enumerate(bits) if w)
                bits = bits[: -(-rank // group)]
            else:
                bits, rank = width, b.rank
            b = SubspaceBasis(b.mean, b.basis[:, :, :rank].contiguous(), b.sigma[:, :rank].contiguous(),
                              b.explained[:, :0].clone())  # explained: fit-time information, not held
            bases.append(b)
            widths.append((bits, group))
        self.bases, self.widths = tuple(bases), tuple(widths)

    def encode(self, keys, values):
        g = self.layer.plan.archive_group
        (bk, bv), ((wk, gk), (wv, gv)) = self.bases, self.widths
        qk = quantize_subspace_rows(keys, bk, wk, gk, axis="channel", token_group=g)
        qv = quantize_subspace_rows(values, bv, wv, gv, axis="token", token_group=g)
        qk.nominal_bits, qv.nominal_bits = self.spec.kbits, self.bits
        return QuantTier(qk, qv)

    def decode(self, q, start, rotated=False):
        return self._keys_back(dequantize_subspace_rows(q.keys), start), dequantize_subspace_rows(q.values)

    def costs(self):
        if self.bases is None:
            return None
        g = self.layer.plan.archive_group
        position = 0.0
        for basis, (bits, group), channel in zip(self.bases, self.widths, (True, False)):
            bounds, widths = subspace_plan(basis.rank, group, bits)
            position += sum(packed_length(e - s, b) for (s, e), b in zip(bounds, widths))
            # keys: an fp16 scale and zero per direction and archive group; values: an fp16 scale per subspace
            position += SCALE_ZERO_BYTES * basis.rank / g if channel else FP16_BYTES * len(widths)
        return ArchiveCosts(position, sum(b.nbytes for b in self.bases))

    def adopt(self, q):
        self.bases = (q.keys.basis, q.values.basis)
        self.widths = tuple((r.bits, r.bounds[0][1] - r.bounds[0][0]) for r in (q.keys, q.values))


FORMAT_CLASSES: dict[str, type[ArchiveFormat]] = {"kivi": KIVIFormat, "kvquant": KVQuantFormat,
                                                  "subspace": SubspaceFormat}
