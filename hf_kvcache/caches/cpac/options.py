"""`CPACOptions`: the options of `CPACCache`, their valid values and their validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...options import CacheOptions, check_bool, check_choice, check_int, check_positive_int
from ..uniform import SLIDING_DTYPES
from .features import FEATURE_KINDS

STREAMS = ("k", "v")
DELTA_BITS = (2, 3, 4, 5, 6, 7, 8)
DELTA_SCALES = ("page", "token", "channel")
SIMILARITY_ON = ("joint", "keys", "values", "separate")
KEY_SPACES = ("rotated", "derotated")
REFERENCES = ("base", "keys", "zero")
FULL_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# similarity_on -> decision groups: (streams that share the decision, streams whose features decide)
_GROUPS = {
    "joint": ((("k", "v"), ("k", "v")),),
    "keys": ((("k", "v"), ("k",)),),
    "values": ((("k", "v"), ("v",)),),
    "separate": ((("k",), ("k",)), (("v",), ("v",))),
}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class CPACOptions(CacheOptions):
    """Options of `CPACCache` (JSON-serializable; bad values raise ValueError naming the valid ones).

    The paper's method: `page_size`, `recent_pages`, `delta_bits` (2..8, packed), `delta_scale` (one fp16 scale per
    "page", "token" or "channel" of a delta page; or [keys, values], e.g. ["channel", "token"]), `thresholds` /
    `pressure_levels`, `memory_budget` (int: bytes; float: fraction of the fp16 size of the tokens seen) or a fixed
    `pressure`, `features` + `n_dct` (see `hf_kvcache.caches.cpac.features`), `protect_importance` (pages whose
    importance reaches it stay raw; None: no protection), `importance_weighting` (the `1 - |imp_a - imp_b|` factor),
    `max_bases` per row and head (None: unlimited), `full_dtype` of raw / base pages and of the recent tail.
    `sliding_dtype` (not in the paper): the uniform format ("int8", "int4", "fp8", ...) of the model's sliding-window
    layers (Gemma-3's local layers), which keep their newest `sliding_window - 1` tokens per token quantized ("auto":
    "int8"; None: the model's dtype, as transformers keeps them). `crop_window` (not in the paper): a layer keeps
    (while attention mass arrives) the attention each of the last `crop_window` queries of the last forward gave each
    page, so that `crop` of up to that many tokens right after their forward takes it out of the page importance
    (default 32; 0: none, and the next forward after a crop raises).

    Variants (not in the paper, to see what matters): `delta_asymmetric` (deltas quantized with a zero point, an fp16
    minimum per scale group, instead of symmetrically); `similarity_on` -- "joint" (keys and values of a page decide
    together, the default), "keys" or "values" (one decides for both), "separate" (keys and values each get their own
    bases and decisions); `key_space` -- "rotated" (keys as RoPE leaves them, the default) or "derotated" (RoPE undone
    before features and deltas, redone on decompression; needs the model config); `reference` -- "base" (deltas
    against base pages, the default), "keys" (values quantized directly, keys against bases chosen by the keys'
    features alone, whatever `similarity_on` says) or "zero" (every page quantized directly: the ablation without any
    cross-page delta).
    """

    page_size: int = 16
    recent_pages: int = 2
    delta_bits: int = 8
    delta_scale: str | list = "page"
    thresholds: tuple = (0.95, 0.85, 0.70)
    pressure_levels: tuple = (0.6, 0.8)
    memory_budget: int | float | None = None
    pressure: float | None = None
    features: str = "summary"
    n_dct: int = 4
    similarity_on: str = "joint"
    key_space: str = "rotated"
    protect_importance: float | None = 0.5
    importance_weighting: bool = True
    max_bases: int | None = None
    reference: str = "base"
    delta_asymmetric: bool = False
    full_dtype: str = "float16"
    crop_window: int = 32
    sliding_dtype: str | None = "auto"

    def validate(self) -> None:
        check_positive_int("page_size", self.page_size)
        check_int("recent_pages", self.recent_pages, lo=0)
        check_choice("delta_bits", self.delta_bits, DELTA_BITS)
        if isinstance(self.delta_scale, (list, tuple)):
            if len(self.delta_scale) != 2:
                raise ValueError(f"delta_scale takes one granularity or [keys, values], got {self.delta_scale!r}")
            for part in self.delta_scale:
                check_choice("delta_scale", part, DELTA_SCALES)
            k_scale, v_scale = self.delta_scale
            self.delta_scale = [k_scale, v_scale] if k_scale != v_scale else k_scale
        else:
            check_choice("delta_scale", self.delta_scale, DELTA_SCALES)
        check_choice("features", self.features, FEATURE_KINDS)
        check_choice("similarity_on", self.similarity_on, SIMILARITY_ON)
        check_choice("key_space", self.key_space, KEY_SPACES)
        check_choice("full_dtype", self.full_dtype, tuple(FULL_DTYPES))
        check_choice("reference", self.reference, REFERENCES)
        if not isinstance(self.n_dct, int) or isinstance(self.n_dct, bool) or self.n_dct < 0:
            raise ValueError(
                f"n_dct must be a non-negative integer (at most page_size - 1 are used), got {self.n_dct!r}"
            )
        if not isinstance(self.thresholds, (list, tuple)) or not isinstance(self.pressure_levels, (list, tuple)):
            raise ValueError("thresholds and pressure_levels must be lists of numbers")
        self.thresholds, self.pressure_levels = tuple(self.thresholds), tuple(self.pressure_levels)
        if len(self.thresholds) != len(self.pressure_levels) + 1:
            raise ValueError(
                f"thresholds needs one more entry than pressure_levels (one per pressure regime), got "
                f"{list(self.thresholds)} and {list(self.pressure_levels)}"
            )
        if not all(_is_number(t) and -1.0 <= t <= 1.0 for t in self.thresholds):
            raise ValueError(f"thresholds must be similarities in [-1, 1], got {list(self.thresholds)}")
        if any(a < b for a, b in zip(self.thresholds, self.thresholds[1:])):
            raise ValueError(f"thresholds must not increase with pressure, got {list(self.thresholds)}")
        if not all(_is_number(p) and p > 0 for p in self.pressure_levels) or any(
            a >= b for a, b in zip(self.pressure_levels, self.pressure_levels[1:])
        ):
            raise ValueError(f"pressure_levels must be positive and increasing, got {list(self.pressure_levels)}")
        mb = self.memory_budget
        if mb is not None and not (_is_number(mb) and mb > 0):
            raise ValueError(
                f"memory_budget must be a positive int (bytes) or float (fraction of the fp16 size of the tokens "
                f"seen), or None, got {mb!r}"
            )
        if self.pressure is not None and not (_is_number(self.pressure) and self.pressure >= 0):
            raise ValueError(f"pressure must be a number >= 0 or None, got {self.pressure!r}")
        if self.pressure is not None and mb is not None:
            raise ValueError("give either memory_budget (pressure is measured) or pressure (fixed), not both")
        pi = self.protect_importance
        if pi is not None and not (_is_number(pi) and 0.0 <= pi <= 1.0):
            raise ValueError(f"protect_importance must be in [0, 1] or None (no protection), got {pi!r}")
        check_bool("delta_asymmetric", self.delta_asymmetric)
        check_bool("importance_weighting", self.importance_weighting)
        check_int("max_bases", self.max_bases, lo=0, allow_none=True)
        check_int("crop_window", self.crop_window, lo=0, hint=" (queries kept so that crop can undo their attention)")
        check_choice("sliding_dtype", self.sliding_dtype, SLIDING_DTYPES)

    @property
    def groups(self) -> tuple:
        """Decision groups: (streams sharing one decision, streams whose features decide). Streams quantized against
        zero have no bases, so their features cannot decide: with reference="keys" the keys decide alone."""
        if self.reference == "zero":
            return ((STREAMS, ()),)
        if self.reference == "keys":
            return ((STREAMS, ("k",)),)
        return _GROUPS[self.similarity_on]

    def scale_of(self, stream: str) -> str:
        """Delta scale granularity of `stream` ("k" or "v")."""
        return self.delta_scale if isinstance(self.delta_scale, str) else self.delta_scale[STREAMS.index(stream)]

    def zero_reference(self, stream: str) -> bool:
        """Whether pages of `stream` are quantized directly (a delta against zero) instead of against a base."""
        return self.reference == "zero" or (self.reference == "keys" and stream == "v")

    @property
    def torch_full_dtype(self) -> torch.dtype:
        return FULL_DTYPES[self.full_dtype]
