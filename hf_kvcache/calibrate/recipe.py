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


def attention_error(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, approx_keys: torch.Tensor,
                    approx_values: torch.Tensor, scaling: float) -> float:
    """Relative Frobenius error of the attention output of `queries` (the last positions, causal) when the keys
    and values `[B, Hkv, T, D]` are replaced by their approximations."""
    return QueryAttention(queries, keys, values, scaling).mean_error([(approx_keys, approx_values)])


def relative_error(exact: torch.Tensor, approx: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm().clamp_min(1e-12))


class QueryAttention:
    """The causal attention of calibration queries `[B, Hq, L, D]` (the last `L` positions) over a layer's exact keys
    and values `[B, Hkv, T, D]` (`exact`, computed once) and over approximations of them (`mean_error`).

    Candidates often share one half: a rotation of the values alone leaves the keys' round trip as it was, and a
    round trip is often asked for again (the key clipping's unclipped one is the chosen rotation's). So the attention
    weights of each keys tensor and the error of each (keys, values) pair are kept, by tensor identity (the tensors
    are kept with them), within `KEPT_BYTES` of weights; the outputs are the same bits as computed afresh."""

    KEPT_BYTES = 64 << 20

    def __init__(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> None:
        b, hq, self.q_len, _ = queries.shape
        self.groups = hq // keys.shape[1]
        self.q = queries.float().reshape(b, keys.shape[1], self.groups * self.q_len, -1)
        self.scaling = scaling
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(keys) -> (keys, weights)
        self._errors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, float]] = {}
        self._mask: tuple[int, int, torch.Tensor] | None = None
        self.exact = self.output(keys, values)

    def weights(self, keys: torch.Tensor) -> torch.Tensor:
        """Softmax weights `[B, Hkv, groups * L, T]` of the queries over `keys`."""
        kept = self._weights.get(id(keys))
        if kept is not None and kept[0] is keys:
            return kept[1]
        t = keys.shape[2]
        scores = (self.q @ keys.float().transpose(-1, -2)) * self.scaling
        start, mask = self._causal_mask(t, keys.device)
        scores[..., start:].masked_fill_(mask, float("-inf"))
        weights = torch.softmax(scores, -1)
        if weights.nbytes * (len(self._weights) + 1) <= self.KEPT_BYTES:
            self._weights[id(keys)] = (keys, weights)
        return weights

    def _causal_mask(self, t: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """(start, mask): the positions from `start` on that some query must not see, `[groups * L, t - start]` (a
        query at position p sees positions up to p; the queries are the last L of `t`)."""
        if self._mask is None or self._mask[0] != t:
            start = max(t - self.q_len, 0)
            pos = torch.arange(t - self.q_len, t, device=device).repeat(self.groups)
            self._mask = (t, start, torch.arange(start, t, device=device) > pos[:, None])
        return self._mask[1], self._mask[2]

    def output(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention output `[B, Hq, L, Dv]` over `keys` / `values`."""
        out = self.weights(keys) @ values.float()
        return out.reshape(self.q.shape[0], -1, self.q_len, out.shape[-1])

    def error(self, keys: torch.Tensor, values: torch.Tensor) -> float:
        """Relative error of the output over (`keys`, `values`) against `exact`."""
        kept = self._errors.get((id(keys), id(values)))
        if kept is not None and kept[0] is keys and kept[1] is values:
            return kept[2]
        err = relative_error(self.exact, self.output(keys, values))
        if id(keys) in self._weights:  # bounded as the weights are
            self._errors[(id(keys), id(values))] = (keys, values, err)
        return err

    def mean_error(self, approximations: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean relative error of the output when the keys/values are replaced by each (keys', values') of
        `approximations` (one per quantized tier)."""
        return sum(self.error(k, v) for k, v in approximations) / len(approximations)


def choose_recipe(
    attention: QueryAttention,
    roundtrip: Callable[[str, str], tuple[torch.Tensor, torch.Tensor]],
    candidates: tuple[str, ...] = ROTATION_CANDIDATES,
    tiers: tuple[str, ...] = ("warm", "arch"),
    margin: float = ROTATION_MARGIN,
) -> LayerRecipe:
    """The candidate rotation whose round trips of the held keys / values (`roundtrip(rotation, tier) -> (keys',
    values')`, one per quantized tier the layer has) give the smallest mean error of `attention`. A rotation must beat
    "none" by `margin` (relative) to be taken: small differences on a few hundred calibration positions do not carry
    over to the rest of the text (measured on Qwen2.5: rotations chosen on a 1-3 % lead lost perplexity)."""
    errors = {c: attention.mean_error([roundtrip(c, t) for t in tiers]) for c in candidates}
    best = min(candidates, key=lambda c: (round(errors[c], 6), candidates.index(c)))
    if best != "none" and "none" in errors and errors[best] > (1.0 - margin) * errors["none"]:
        best = "none"
    return LayerRecipe(best, errors, "queries")


def choose_archive_bits(
    attention: QueryAttention,
    roundtrip_at: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    bits: int,
    max_bits: int,
    target: float,
) -> tuple[int, dict[str, float]]:
    """The narrowest archive width from `bits` up to `max_bits` whose round trip (`roundtrip_at(width) -> (keys',
    values')`, `[B, Hkv, T, D]`) keeps the error of `attention` within `target`, with the error of every
    width tried (`{"archive-<width>": error}`); `max_bits` when none does."""
    errors: dict[str, float] = {}
    for width in range(bits, max(bits, max_bits) + 1):
        errors[f"archive-{width}"] = attention.mean_error([roundtrip_at(width)])
        if errors[f"archive-{width}"] <= target:
            return width, errors
    return max(bits, max_bits), errors


def choose_key_clipping(
    attention: QueryAttention,
    roundtrips: Callable[[bool], list[tuple[torch.Tensor, torch.Tensor]]],
    margin: float = KEY_CLIP_MARGIN,
) -> tuple[bool, dict[str, float]]:
    """Whether clipping the key groups (`roundtrips(clip) -> [(keys', values')]`, one per quantized tier) lowers the
    mean error of `attention` by more than `margin` (relative), with both errors (`{"keys-unclipped",
    "keys-clipped"}`)."""
    errors = {clip: attention.mean_error(roundtrips(clip)) for clip in (False, True)}
    return errors[True] < (1.0 - margin) * errors[False], {"keys-unclipped": errors[False],
                                                          "keys-clipped": errors[True]}


def choose_archive_format(
    attention: QueryAttention,
    roundtrip: Callable[[str], tuple[torch.Tensor, torch.Tensor]],
    default: str,
    candidates: tuple[str, ...],
    margin: float = ARCHIVE_FORMAT_MARGIN,
) -> tuple[str, dict[str, float]]:
    """The archive format among `default` and `candidates` whose round trip (`roundtrip(name) -> (keys', values')`,
    `[B, Hkv, T, D]`) gives `attention` the smallest error, with every format's error (`{"format-<name>":
    error}`). Another format than `default` must beat it by `margin` (relative)."""
    names = (default, *(c for c in candidates if c != default))
    errors = {name: attention.mean_error([roundtrip(name)]) for name in names}
    best = min(names, key=lambda n: (round(errors[n], 6), names.index(n)))
    if best != default and errors[best] > (1.0 - margin) * errors[default]:
        best = default
    return best, {f"format-{n}": e for n, e in errors.items()}
