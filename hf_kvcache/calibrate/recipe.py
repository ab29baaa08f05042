"""Choosing a layer's quantization recipe from what the layer will really be asked: the attention of its queries.

Plain reconstruction error picks badly: an orthogonal rotation leaves the squared error of keys almost unchanged
while it changes which channels carry it, and queries weigh channels very unequally (measured on captured
SmolLM2 / Qwen2.5 / Gemma-3 attention tensors: a query-free proxy agreed with the best rotation choice for future
queries in 9 of 24 Qwen layers, 64 of the prefill's own queries in 23 of 24). So a layer keeps the last queries of
its first prefill (`observe_queries`, reported by the `"hf_kvcache"` attention), round-trips its keys and values
through each candidate recipe, and keeps the recipe whose attention output is closest to the exact one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

ROTATION_CANDIDATES = ("none", "keys", "values", "both")
SOURCES = ("queries", "no-queries", "given", "static")
ARCHIVE_FORMAT_NAMES = ("kivi", "kvquant", "subspace")  # `caches.archive.ARCHIVE_FORMATS` (checked by the tests)
ROTATION_MARGIN = 0.1
# clip_on="auto": clipping a layer's keys must lower its calibration attention error by this much. Gemma-3-270M's
# full layers showed 13-15 % leads (0.207 -> 0.180, 0.171 -> 0.152) yet lost perplexity (+0.98 % -> +4.52 % at 2048
# tokens): the extreme key entries a clip cuts are the ones later queries look up, which a few hundred calibration
# positions do not show; on Qwen2.5 the leads are 5-33 %, most above 20 %
KEY_CLIP_MARGIN = 0.2
# archive_candidates: a format other than archive_quantizer must lower the layer's calibration attention error by this
# much (relative) to be taken; fixed a priori at the rotation's margin, for the same reason
ARCHIVE_FORMAT_MARGIN = 0.1


@dataclass
class LayerRecipe:
    """What one layer runs with. `errors`: relative attention-output error of each candidate measured at
    calibration (empty when none was measured; `"archive-<bits>"` entries: the archive alone at that width);
    `source`: how it was chosen; `archive_bits`: the layer's archive width when calibration raised it above the
    options' `archive_bits` (None: the options' width); `clip_keys`: whether its key groups take the clip search
    (`clip_on="auto"`: chosen by calibration; None: as `clip_on` says)."""

    rotation: str = "none"
    errors: dict[str, float] = field(default_factory=dict)
    source: str = "given"
    archive_bits: int | None = None
    clip_keys: bool | None = None
    archive_format: str | None = None

    def __post_init__(self) -> None:
        if self.rotation not in ROTATION_CANDIDATES:
            raise ValueError(f"rotation={self.rotation!r} is not valid; choose one of {list(ROTATION_CANDIDATES)}")
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} is not valid; choose one of {list(SOURCES)}")
        if self.archive_bits is not None and (
                isinstance(self.archive_bits, bool) or not isinstance(self.archive_bits, int)
                or not 1 <= self.archive_bits <= 8):
            raise ValueError(f"archive_bits={self.archive_bits!r} is not valid; give an int in 1..8, or None (the "
                             "options' archive_bits)")
        if self.clip_keys is not None and not isinstance(self.clip_keys, bool):
            raise ValueError(f"clip_keys={self.clip_keys!r} is not valid; give true, false or None (as clip_on says)")
        if self.archive_format is not None and self.archive_format not in ARCHIVE_FORMAT_NAMES:
            raise ValueError(f"archive_format={self.archive_format!r} is not valid; choose one of "
                             f"{list(ARCHIVE_FORMAT_NAMES)}, or None (the options' archive_quantizer)")

    def to_dict(self) -> dict:
        d = {"rotation": self.rotation, "errors": dict(self.errors), "source": self.source}
        for name in ("archive_bits", "clip_keys", "archive_format"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: dict | str) -> "LayerRecipe":
        if isinstance(d, str):
            return cls(rotation=d)
        unknown = sorted(set(d) - {"rotation", "errors", "source", "archive_bits", "clip_keys", "archive_format"})
        if unknown:
            raise ValueError(f"unknown recipe field(s) {unknown}; a recipe has rotation, errors, source, archive_bits, "
                             "clip_keys, archive_format")
        return cls(**d)


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of the last `L` positions: `queries [B, Hq, L, D]` over `keys/values [B, Hkv, T, D]`."""
    b, hq, q_len, _ = queries.shape
    hkv, t = keys.shape[1], keys.shape[2]
    q = queries.float().reshape(b, hkv, (hq // hkv) * q_len, -1)
    scores = (q @ keys.float().transpose(-1, -2)) * scaling
    pos = torch.arange(t - q_len, t, device=keys.device).repeat(hq // hkv)
    scores.masked_fill_(torch.arange(t, device=keys.device) > pos[:, None], float("-inf"))
    out = torch.softmax(scores, -1) @ values.float()
    return out.reshape(b, hq, q_len, -1)


def attention_error(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, approx_keys: torch.Tensor,
                    approx_values: torch.Tensor, scaling: float) -> float:
    """Relative Frobenius error of the attention output of `queries` (the last positions, causal) when the keys
    and values `[B, Hkv, T, D]` are replaced by their approximations."""
    return relative_error(attend(queries, keys, values, scaling), attend(queries, approx_keys, approx_values, scaling))


def relative_error(exact: torch.Tensor, approx: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm().clamp_min(1e-12))


def mean_error(exact: torch.Tensor, queries: torch.Tensor, scaling: float,
               approximations: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean relative error of the attention output of `queries` (`exact`: `attend` over the exact keys/values) when
    the keys/values are replaced by each (keys', values') of `approximations` (one per quantized tier)."""
    return sum(relative_error(exact, attend(queries, k, v, scaling)) for k, v in approximations) / len(approximations)


def choose_recipe(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    roundtrip: Callable[[torch.Tensor, torch.Tensor, str, str], tuple[torch.Tensor, torch.Tensor]],
    candidates: tuple[str, ...] = ROTATION_CANDIDATES,
    tiers: tuple[str, ...] = ("warm", "arch"),
    margin: float = ROTATION_MARGIN,
) -> LayerRecipe:
    """The candidate rotation whose round trips (`roundtrip(keys, values, rotation, tier) -> (keys', values')`, one
    per quantized tier the layer has) give the smallest mean attention error for `queries`. A rotation must beat
    "none" by `margin` (relative) to be taken: small differences on a few hundred calibration positions do not carry
    over to the rest of the text (measured on Qwen2.5: rotations chosen on a 1-3 % lead lost perplexity)."""
    exact = attend(queries, keys, values, scaling)  # once: only the approximations change between candidates
    errors = {c: mean_error(exact, queries, scaling, [roundtrip(keys, values, c, t) for t in tiers])
              for c in candidates}
    best = min(candidates, key=lambda c: (round(errors[c], 6), candidates.index(c)))
    if best != "none" and "none" in errors and errors[best] > (1.0 - margin) * errors["none"]:
        best = "none"
    return LayerRecipe(best, errors, "queries")


def choose_archive_bits(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    roundtrip_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    bits: int,
    max_bits: int,
    target: float,
) -> tuple[int, dict[str, float]]:
    """The narrowest archive width from `bits` up to `max_bits` whose round trip (`roundtrip_at(width) -> (keys',
    values')`, `[B, Hkv, T, D]`) keeps the attention error of `queries` within `target`, with the error of every
    width tried (`{"archive-<width>": error}`); `max_bits` when none does."""
    exact = attend(queries, keys, values, scaling)
    errors: dict[str, float] = {}
    for width in range(bits, max(bits, max_bits) + 1):
        errors[f"archive-{width}"] = mean_error(exact, queries, scaling, [roundtrip_at(width)])
        if errors[f"archive-{width}"] <= target:
            return width, errors
    return max(bits, max_bits), errors


def choose_key_clipping(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    roundtrips: Callable[[bool], list[tuple[torch.Tensor, torch.Tensor]]],
    margin: float = KEY_CLIP_MARGIN,
) -> tuple[bool, dict[str, float]]:
    """Whether clipping the key groups (`roundtrips(clip) -> [(keys', values')]`, one per quantized tier) lowers the
    mean attention error of `queries` by more than `margin` (relative), with both errors (`{"keys-unclipped",
    "keys-clipped"}`)."""
    exact = attend(queries, keys, values, scaling)
    errors = {clip: mean_error(exact, queries, scaling, roundtrips(clip)) for clip in (False, True)}
    return errors[True] < (1.0 - margin) * errors[False], {"keys-unclipped": errors[False],
                                                          "keys-clipped": errors[True]}


def choose_archive_format(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    roundtrip: Callable[[str], tuple[torch.Tensor, torch.Tensor]],
    default: str,
    candidates: tuple[str, ...],
    margin: float = ARCHIVE_FORMAT_MARGIN,
) -> tuple[str, dict[str, float]]:
    """The archive format among `default` and `candidates` whose round trip (`roundtrip(name) -> (keys', values')`,
    `[B, Hkv, T, D]`) gives `queries` the smallest attention error, with every format's error (`{"format-<name>":
    error}`). Another format than `default` must beat it by `margin` (relative)."""
    exact = attend(queries, keys, values, scaling)
    names = (default, *(c for c in candidates if c != default))
    errors = {name: mean_error(exact, queries, scaling, [roundtrip(name)]) for name in names}
    best = min(names, key=lambda n: (round(errors[n], 6), names.index(n)))
    if best != default and errors[best] > (1.0 - margin) * errors[default]:
        best = default
    return best, {f"format-{n}": e for n, e in errors.items()}
