"""Tiered KIVI caches: a full-precision hot tail, a 4-bit warm tier, a 2-bit archive, and full-precision sinks.

Positions of one layer, oldest first::

    archive (archive_bits) [0, a) | warm (warm_bits) [a, a + w) | tail (full precision) [a + w, n)
    + sinks: a full-precision copy of positions [0, sink_length), laid over whatever tier holds them

New tokens enter the tail. Whenever the tail holds at least `tail_length + group_size` tokens, its oldest whole groups
of `group_size` tokens are quantized (from full precision) into the warm tier; whenever the warm tier holds at least
`warm_length + archive_group_size` tokens, its oldest `archive_group_size` groups are re-quantized at `archive_bits`
into the archive. So the newest `tail_length` tokens are always exact, at least the next `warm_length` are at
`warm_bits`, the rest at `archive_bits`, and every token is quantized once per tier change: appending quantizes only
the groups that move and never touches the tiers already stored (transformers' `QuantizedLayer` re-quantizes its whole
cache at every flush). Group boundaries are at fixed positions (multiples of the group size from position 0), so the
sinks do not shift them: the sink positions are stored in full precision and, inside their quantization group, replaced
by a neighbour's values so that they do not stretch the group's range.

Quantization is KIVI's (`hf_kvcache.quant.kivi`): keys per channel over groups of tokens, values per token over groups
of channels, asymmetric min/max with fp16 scale and zero, codes bit-packed. Options add a randomized Hadamard rotation
of the head dimension before quantizing (undone when dequantizing), clipping, and per-token keys (the ablation of
KIVI's per-channel keys). The defaults are the measured best recipe (`hf-kvcache compare --suite ablations`).

The archive may use another format (`archive_quantizer`): each is one class of `caches.archive` (KIVI, KVQuant's
nuq codes, codes in a fitted subspace basis), and "adaptive" picks one per archive group by position, the archive
then being a `SegmentedTier` of per-format segments.

`KIVICache` is the classic two-tier form: a full-precision residual window and one quantized tier.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..options import CacheOptions, check_bool, check_choice, check_int, check_number, check_positive_int
from ..quant.kivi import AXES, KIVIQuantized, dequantize_kivi
from ..rope import KeyRotation
from ..quant.rotation import hadamard_rotation, is_power_of_two
from ..kernels.segments import FullSegment, QuantSegment
from ..calibrate import ROTATION_CANDIDATES, LayerRecipe, choose_archive_bits, choose_recipe
from ..calibrate.recipe import choose_key_clipping
from ..calibrate.quality import QualityTracker
from ..calibrate.thresholds import AdaptiveThresholds
from .base import CompressedCache, CompressedLayer, memory_stats
from .budget import RatioBudget
from .archive import ARCHIVE_FORMATS, FORMAT_CLASSES, ArchiveFormat, KIVIFormat
from .tiers import LayerTiers, PlainTier, QuantTier, SegmentedTier, format_label, format_of, same_format

QUANTIZERS = (*ARCHIVE_FORMATS, "adaptive")
ROTATIONS = ("auto", "static", *ROTATION_CANDIDATES)
TAIL_DTYPES = ("auto", None, "float32", "float16", "bfloat16")
ROTATION_DTYPES = (None, "bfloat16")
CLIP_TARGETS = ("keys", "values", "both", "auto")
TIERS = ("sink", "archive", "warm", "tail")
# the options a sliding-window layer may run with differently (`TieredQuantOptions.sliding`)
SLIDING_FIELDS = ("tail_length", "warm_length", "warm_fraction", "warm_bits", "archive_bits", "archive_key_bits",
                  "group_size",
                  "archive_group_size", "value_group_size", "rotation", "clip_ratio", "clip_search", "clip_on",
                  "archive_quantizer")
# what sliding-window layers run with by default (measured on Gemma-3-270M, window 512, head_dim 256:
# docs/rows/sliding_*gemma3-270m*)
# no full-precision tail (the newest 0..31 tokens wait in it), 3-bit codes, values clipped (keys clipped too flipped
# a near-tied greedy token: 2 of 24 tokens kept after a 700-token prompt, 24 with values only), no rotation
SLIDING_DEFAULT = {"tail_length": 0, "warm_length": 64, "warm_fraction": 0.0, "warm_bits": 3, "archive_bits": 3,
                   "rotation": "none", "clip_on": "values", "archive_quantizer": "kivi"}
# `cache_implementation="tiered_long"`: a setting that needs no queries (a fixed value rotation, no calibration), so
# a plain `model(ids, past_key_values=cache)` loop stores what `generate` stores; 3-bit archive keys in 128-token
# groups beside 2-bit values; the warm tier sized by a 5x memory target (chosen on held-out spans:
# docs/rows/long_selection_rule.md)
LONG_CONTEXT = {"rotation": "static", "archive_key_bits": 3, "archive_group_size": 128, "warm_length": 64,
                "warm_fraction": 0.0, "target_ratio": 5.0,
                "sliding": {**SLIDING_DEFAULT, "archive_group_size": 64}}
CALIBRATION_GROUPS = 4  # archive groups "auto" round-trips per candidate (the tail waits for them, once)


def _check_quant_knobs(opts: Any) -> None:
    check_choice("key_axis", opts.key_axis, AXES)
    check_positive_int("group_size", opts.group_size)
    check_positive_int("value_group_size", opts.value_group_size, allow_none=True)
    check_int("sink_length", opts.sink_length, lo=0)
    check_choice("rotation", opts.rotation, ROTATIONS)
    check_choice("rotation_dtype", opts.rotation_dtype, ROTATION_DTYPES)
    check_number("clip_ratio", opts.clip_ratio, 0.0, 1.0, lo_open=True)
    opts.clip_ratio = float(opts.clip_ratio)
    check_bool("clip_search", opts.clip_search)
    check_choice("clip_on", opts.clip_on, CLIP_TARGETS)
    check_choice("tail_dtype", opts.tail_dtype, TAIL_DTYPES)


@dataclass
class TieredQuantOptions(CacheOptions):
    """Options of `TieredQuantCache`; every field is JSON-serializable and checked on construction.

    - tail_length: newest tokens always kept in full precision (the tail holds up to `tail_length + group_size - 1`)
    - warm_length: at least this many tokens before the tail stay at warm_bits (a multiple of group_size;
      0: no warm tier, tokens go from the tail straight to the archive)
    - warm_fraction: the warm tier also keeps this fraction of the positions seen (of the window, for a sliding
      layer), rounded down to whole groups, when that is more than warm_length: the archive's share, and its error,
      stop growing with the context (0: a fixed warm tier)
    - target_ratio: the warm tier also keeps as many positions as the cache's memory allows at this ratio vs fp16
      (`caches.budget.RatioBudget`: the bytes every tensor of the cache holds, sliding-window layers included, at
      most fp16 bytes / target_ratio once the context is long enough for it): the newest positions get warm_bits
      as far as that memory goes (None: no memory target)
    - warm_bits / archive_bits: code widths of the two quantized tiers (1..8; 1, 2, 4, 8 unpack by table lookup)
    - archive_key_bits: the KIVI archive's key width when it differs from its value width (None: archive_bits).
      Keys decide which positions a query reads and carry most of a 2-bit archive's attention error; a third key
      bit costs 1 bit per key element and needs neither a key rotation nor key clipping to pay off (docs/results/
      long_context.md)
    - group_size: warm-tier groups: tokens per per-channel key group, channels per value group (at most head_dim);
      also the unit in which tokens leave the tail
    - archive_group_size: the same for the archive (a multiple of group_size; None: group_size)
    - value_group_size: channels per value group in both tiers (None: the largest divisor of the value head_dim up
      to the tier's group size)
    - sink_length: first tokens of the sequence kept in full precision (attention sinks)
    - archive_quantizer: "kivi" (uniform min/max codes) or "kvquant": non-uniform levels fitted per KV head and
      channel on the first positions archived, keys quantized before RoPE (undone with the model's RoPE, put
      back at read), the `archive_outliers` fraction of each token's most extreme entries kept exactly in fp16
    - archive_outliers: that fraction (kvquant only)
      "subspace": codes in an orthogonal basis fitted per layer and KV head (PCA of the first positions archived,
      `hf_kvcache.quant.subspace`): keys per direction over archive groups of tokens (pre-RoPE, see
      subspace_prerope), values per token with one scale per subspace of `value_group_size or group_size`
      directions; the bases (fp16 mean, basis, sigma) are counted in the bytes held.
      "adaptive": the format of each archive group chosen by its position (the context length it is archived at):
      `adaptive_formats[i]` at `adaptive_bits[i]` bits from `adaptive_boundaries[i - 1]` on (by default KIVI-2 below
      2048 positions, subspace-2 up to 8192, KVQuant-3 beyond); groups archived before a switch keep their format
      (the archive is then a `SegmentedTier`); every switch is listed in `memory_stats()["archive_switches"]`
    - archive_rank: subspace archive only: keep the leading `archive_rank` directions of each basis (1..head_dim;
      None: all): fewer codes for extreme ratios, the dropped directions read back as their mean
    - subspace_allocation: subspace archive: spread the archive_bits x rank code bits of a token over subspaces of
      directions by the fitted variances (reverse water-filling: leading directions get more bits, trailing ones
      may get none and are dropped); False: archive_bits for every direction
    - subspace_prerope: subspace archive keys fitted and quantized before RoPE (undone with the model's RoPE, as
      the KVQuant archive does) or, False, as the model hands them over (post-RoPE)
    - adaptive_boundaries / adaptive_formats / adaptive_bits: the adaptive archive's switch positions (increasing),
      and the format names ("kivi", "subspace", "kvquant") and widths (1..8), one more than boundaries
    - key_axis: "channel" (KIVI) or "token" (ablation: keys quantized per token like values)
    - rotation: randomized Hadamard rotation of the head dim before quantizing: "none", "keys", "values", "both",
      or "auto": each layer picks one of those from its own keys, values and queries on its first prefill
      (`hf_kvcache.calibrate`; the queries come from the "hf_kvcache" attention, which `generate` switches to; without
      them a layer takes "none"); "static": values rotated wherever the value head dim is a power of two, keys
      never, chosen without queries, so that `generate`, `attached` and a user's plain loop run the same recipe
    - calibration_queries: how many of the first forward's last queries "auto" calibrates with
    - archive_error_target: with rotation "auto" and a KIVI archive, the same calibration also widens the archive
      of a layer whose round trip at archive_bits gives its queries a relative attention-output error above this
      target: one bit at a time, up to warm_bits, the narrowest width within the target (None, the default: every
      layer at archive_bits). Layers differ widely (measured at 2 bits, clip search on values only: 0.09-0.41 on
      SmolLM2, 0.09-0.49 on Qwen2.5); a target of 0.3 widened 6 of Qwen2.5's 24 layers to 3 bits (+1.67 % instead
      of +2.45 %, but 4.33x instead of 4.53x at 2048 tokens)
    - recipes: per model layer, a recipe to use instead of calibrating (`cache.recipes()` of a calibrated cache, a
      rotation name, or None for that layer); a JSON list
    - rotation_dtype: dtype of the scratch buffer a rotated tier is dequantized into before its un-rotation when
      the layer is read whole (None: float32; "bfloat16": half that buffer, its rounding far below 2-bit
      quantization noise); the Walsh-Hadamard transform itself runs in float32, and the fused attention never
      un-rotates the codes (it rotates the queries)
    - clip_ratio: shrink every group's [min, max] around its midpoint by this factor (1.0: no clipping)
    - clip_search: pick, per group, the clipping ratio with the smallest squared error (quant.kivi.CLIP_GRID)
    - clip_on: which tensors clip_ratio / clip_search apply to: "keys", "values", "both", or "auto" (the
      default): values, and keys where the calibration finds that clipping the per-channel key groups lowers the
      attention error of the layer's queries (with rotation "auto"; without queries, values only). Same bytes either
      way. Clipping every layer's keys took Qwen2.5-Coder-0.5B from +2.45 % to -0.43 % and SmolLM2 from +1.67 % to
      -0.10 % at 2048 tokens, but Gemma-3-270M from +0.98 % to +3.86 %: an MSE-optimal clip of keys cuts the large
      entries that decide q.k. A KVQuant archive clips its nuq groups only where clip_on names them explicitly
      ("keys", "values", "both"), never under "auto"
    - tail_dtype: dtype of the unquantized tail and sinks: "auto" (16 bits: the model's dtype if it is fp16/bf16,
      else float16), None (the model's dtype), or a dtype name
    - sliding: options that sliding-window layers (e.g. Gemma-3's local layers) run with instead of the ones above,
      a JSON object over `SLIDING_FIELDS`; a key it leaves out takes the value above, None or {}: the same options
      as full layers. Such a layer holds only the window (DynamicCache holds window - 1 positions there), so a
      tail and warm tier sized for long contexts would be most of it. The default (`SLIDING_DEFAULT`) keeps no
      full-precision tail beyond the group waiting to leave it, 64 positions at 3 bits in groups of 32 and the
      rest of the window at 3 bits in groups of 64 (clip search on values; clipping keys too cut Gemma-3-270M's
      greedy agreement with DynamicCache after a 700-token prompt from 24 to 2 of 24 tokens, `python -m
      hf_kvcache.eval.greedy`), unrotated (a rotation lost perplexity there), and a KIVI archive whatever
      `archive_quantizer` says: a subspace basis fitted on the few positions a 64-token warm tier hands
      over (fewer than head_dim 256) misses most directions (Gemma-3-270M, 1024 tokens: subspace +33 %, adaptive
      +4057 % with subspace sliding layers). A sliding layer keeps no sinks either way. Models without sliding
      layers never read it.
    """

    tail_length: int = 64
    warm_length: int = 448
    warm_fraction: float = 0.22
    target_ratio: float | None = None
    warm_bits: int = 4
    archive_bits: int = 2
    archive_key_bits: int | None = None
    group_size: int = 32
    archive_group_size: int | None = 64
    value_group_size: int | None = None
    sink_length: int = 4
    archive_quantizer: str = "kivi"
    archive_outliers: float = 0.01
    archive_rank: int | None = None
    subspace_prerope: bool = True
    subspace_allocation: bool = True
    adaptive_boundaries: list = dataclasses.field(default_factory=lambda: [2048, 8192])
    adaptive_formats: list = dataclasses.field(default_factory=lambda: ["kivi", "subspace", "kvquant"])
    adaptive_bits: list = dataclasses.field(default_factory=lambda: [2, 2, 3])
    key_axis: str = "channel"
    rotation: str = "auto"
    rotation_dtype: str | None = "bfloat16"
    clip_ratio: float = 1.0
    clip_search: bool = True
    clip_on: str = "auto"
    tail_dtype: str | None = "auto"
    calibration_queries: int = 64
    archive_error_target: float | None = None
    recipes: list | None = None
    sliding: dict | None = field(default_factory=lambda: dict(SLIDING_DEFAULT))

    def validate(self) -> None:
        check_int("tail_length", self.tail_length, lo=0)
        check_int("warm_length", self.warm_length, lo=0)
        check_number("warm_fraction", self.warm_fraction, 0.0, 1.0)
        check_number("target_ratio", self.target_ratio, 1.0, lo_open=True, allow_none=True)
        check_int("warm_bits", self.warm_bits, 1, 8)
        check_int("archive_bits", self.archive_bits, 1, 8)
        if self.archive_key_bits is not None:
            check_int("archive_key_bits", self.archive_key_bits, 1, 8)
            if self.archive_quantizer != "kivi":
                raise ValueError(f"archive_key_bits={self.archive_key_bits} sets the key width of a KIVI archive; "
                                 f"archive_quantizer={self.archive_quantizer!r} has one width: use archive_quantizer="
                                 "'kivi', or archive_key_bits=None")
        check_choice("archive_quantizer", self.archive_quantizer, QUANTIZERS)
        check_number("archive_outliers", self.archive_outliers, 0.0, 0.5, hi_open=True)
        self._check_archive_formats()
        _check_quant_knobs(self)
        check_positive_int("archive_group_size", self.archive_group_size, allow_none=True)
        check_positive_int("calibration_queries", self.calibration_queries)
        check_number("archive_error_target", self.archive_error_target, 0.0, lo_open=True, allow_none=True)
        if self.recipes is not None:
            if not isinstance(self.recipes, list):
                raise ValueError(f"recipes must be a list with one entry per model layer, got {type(self.recipes).__name__}")
            for r in self.recipes:
                if r is not None:
                    LayerRecipe.from_dict(r)
        if self.warm_length % self.group_size:
            raise ValueError(
                f"warm_length={self.warm_length} must be a multiple of group_size={self.group_size} "
                "(tokens move between tiers in whole groups)"
            )
        if self.archive_group_size is not None and self.archive_group_size % self.group_size:
            raise ValueError(
                f"archive_group_size={self.archive_group_size} must be a multiple of group_size={self.group_size}"
            )
        if self.sliding is not None:
            if not isinstance(self.sliding, dict):
                raise ValueError("sliding must be a JSON object of options for sliding-window layers, e.g. "
                                 f'{{"tail_length": 32, "warm_length": 64}}, or None, got {self.sliding!r}')
            unknown = sorted(set(self.sliding) - set(SLIDING_FIELDS))
            if unknown:
                raise ValueError(f"sliding: {unknown} cannot be set per sliding-window layer; use the keys "
                                 f"{list(SLIDING_FIELDS)} (or set the option for every layer)")
            try:
                self.for_sliding()
            except ValueError as exc:
                raise ValueError(f"sliding={self.sliding!r}: {exc}") from None

    def for_sliding(self) -> "TieredQuantOptions":
        """The options a sliding-window layer runs with: `sliding` laid over these, and no sinks (nor a subspace
        rank when `sliding` picks an archive without bases)."""
        over = dict(self.sliding or {})
        if over.get("archive_quantizer", self.archive_quantizer) not in ("subspace", "adaptive"):
            over["archive_rank"] = None
        return dataclasses.replace(self, sliding=None, sink_length=0, **over)

    def _check_archive_formats(self) -> None:
        check_bool("subspace_prerope", self.subspace_prerope)
        check_bool("subspace_allocation", self.subspace_allocation)
        check_positive_int("archive_rank", self.archive_rank, allow_none=True)
        subspace = self.archive_quantizer == "subspace" or (
            self.archive_quantizer == "adaptive" and isinstance(self.adaptive_formats, list)
            and "subspace" in self.adaptive_formats)
        if self.archive_rank is not None and not subspace:
            raise ValueError(f"archive_rank={self.archive_rank} truncates the subspace archive's bases: set "
                             "archive_quantizer='subspace' (or an adaptive archive with a subspace format), or "
                             "archive_rank=None")
        # checked whatever the quantizer, so that a wrong value never passes unnoticed
        b, f, w = self.adaptive_boundaries, self.adaptive_formats, self.adaptive_bits
        for name, v in (("adaptive_boundaries", b), ("adaptive_formats", f), ("adaptive_bits", w)):
            if not isinstance(v, list):
                raise ValueError(f"{name} must be a JSON list, got {type(v).__name__}")
        if not b or any(not isinstance(x, int) or isinstance(x, bool) or x <= 0 for x in b) or any(
                x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"adaptive_boundaries={b} must be increasing positive positions, e.g. [2048, 8192]")
        if len(f) != len(b) + 1 or len(w) != len(b) + 1:
            raise ValueError(f"adaptive_formats ({len(f)}) and adaptive_bits ({len(w)}) need one entry per range "
                             f"that adaptive_boundaries={b} makes ({len(b) + 1}), e.g. formats "
                             "['kivi', 'subspace', 'kvquant'] and bits [2, 2, 3]")
        for name in f:
            check_choice("adaptive_formats entry", name, ARCHIVE_FORMATS)
        for bits in w:
            check_int("adaptive_bits entry", bits, 1, 8)

    @property
    def archive_group(self) -> int:
        return self.archive_group_size or self.group_size


@dataclass
class KIVIOptions(CacheOptions):
    """Options of `KIVICache`: a full-precision residual window of `residual_length` tokens and one quantized tier
    of `bits`-bit codes in groups of `group_size`. The other fields mean what they mean in `TieredQuantOptions`."""

    residual_length: int = 128
    bits: int = 2
    group_size: int = 32
    value_group_size: int | None = None
    sink_length: int = 0
    key_axis: str = "channel"
    rotation: str = "none"
    rotation_dtype: str | None = None
    clip_ratio: float = 1.0
    clip_search: bool = False
    clip_on: str = "both"
    tail_dtype: str | None = "auto"

    def validate(self) -> None:
        check_int("residual_length", self.residual_length, lo=0)
        check_int("bits", self.bits, 1, 8)
        _check_quant_knobs(self)

    def as_tiered(self) -> TieredQuantOptions:
        return TieredQuantOptions(
            tail_length=self.residual_length, warm_length=0, warm_fraction=0.0, warm_bits=self.bits,
            archive_bits=self.bits,
            group_size=self.group_size, archive_group_size=self.group_size, value_group_size=self.value_group_size,
            sink_length=self.sink_length, key_axis=self.key_axis, rotation=self.rotation,
            rotation_dtype=self.rotation_dtype,
            clip_ratio=self.clip_ratio, clip_search=self.clip_search, clip_on=self.clip_on, tail_dtype=self.tail_dtype,
            archive_error_target=None, sliding=None,
        )


@dataclass
class _TierSpec:
    bits: int
    key_group: int  # tokens per key group (per-channel keys) or channels per key group (per-token keys)
    value_group: int  # channels per value group
    key_bits: int | None = None  # the keys' width when it differs (None: bits)

    @property
    def kbits(self) -> int:
        return self.bits if self.key_bits is None else self.key_bits


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` not above `at_most`: the default value group of a tier (channels per group)."""
    return next(d for d in range(min(n, at_most), 0, -1) if n % d == 0)


def needs_rope(p: TieredQuantOptions) -> bool:
    """Whether the archive options quantize keys before RoPE (and so need the model's RoPE)."""
    names = p.adaptive_formats if p.archive_quantizer == "adaptive" else [p.archive_quantizer]
    return "kvquant" in names or ("subspace" in names and p.subspace_prerope)


class TieredQuantLayer(CompressedLayer):
    """One layer's archive / warm / tail storage plus the sink overlay (see the module docstring).

    `store` keys: `tail_k`, `tail_v`, `sink_k`, `sink_v` (`[batch, heads, tokens, dim]`), and for each quantized tier
    (`warm`, `arch`) `{tier}_kc`, `{tier}_vc` (packed codes, `[batch, heads, tokens, packed dim]`) with their fp16
    `_ks`/`_kz`/`_vs`/`_vz` scales and zeros. Per-channel key scales are `[batch, heads, tokens / group, dim]`: not
    token-aligned, hence the own `crop`. Reordering and selecting beams only index dim 0 of every stored tensor, which
    holds the batch everywhere, so `reorder_cache`, `batch_select_indices` and `batch_repeat_interleave` keep the base
    class's implementation (checked by the tests).
    """

    options: TieredQuantOptions

    def __init__(self, options: TieredQuantOptions | None = None, sliding_window: int | None = None) -> None:
        super().__init__(options if options is not None else TieredQuantOptions())
        self.recipe: LayerRecipe | None = None  # given, or chosen by calibration (rotation="auto")
        self.calibrating = False
        self.query_window = 0
        # while calibrating: the last queries seen (`[batch, heads, <= calibration_queries, head_dim]`), their
        # scaling, and whether the first update already waited for them
        self._calib_queries: torch.Tensor | None = None
        self._calib_scaling = 1.0
        self._calib_waited = False
        # a sliding-window layer: archive groups no future query can see are dropped, and no sinks are kept (the
        # first positions leave the window); `dropped` counts the positions before the first one held
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.dropped = 0
        self.tiers = LayerTiers()
        # the archive formats by name ("warm": the warm tier's KIVI codes); their fitted state (KVQuant codebooks,
        # subspace bases) is fitted on the first positions archived and kept for later sequences; and the model's
        # RoPE the pre-RoPE formats un-rotate keys with (set by the cache from the model config)
        self.formats: dict[str, ArchiveFormat] = {}
        self.rope: KeyRotation | None = None
        self.switches: list[dict] = []  # adaptive archive: {position, from, to} of every format switch
        self._in_flight = 0
        self.quality = QualityTracker()  # error of every block quantized in this sequence (`quality_metrics`)
        self.budget: RatioBudget | None = None  # the cache's memory target (`target_ratio`), set by the cache
        if self.is_sliding:
            check_positive_int("sliding_window", sliding_window)
        self.plan: TieredQuantOptions = self._plan()

    def _plan(self) -> TieredQuantOptions:
        """The tiered options this layer runs with (KIVI maps its own options onto them; a sliding layer takes the
        `sliding` overrides and keeps no sinks: its first positions leave the window)."""
        plan = self._options_as_tiered()
        return plan.for_sliding() if self.is_sliding else plan

    def _options_as_tiered(self) -> TieredQuantOptions:
        return self.options

    def replan(self, options: CacheOptions) -> None:
        """Run with `options` from the next sequence on: at once if the layer holds nothing, else at `reset()` (the
        tiers already stored keep the widths and group sizes they were written with)."""
        self.options = options
        if not self.is_initialized:
            self.plan = self._plan()

    # ---- setup --------------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        p = self.plan
        head_dim, value_dim = key_states.shape[-1], value_states.shape[-1]
        self.specs: dict[str, _TierSpec] = {}
        for tier, bits, group in (("warm", p.warm_bits, p.group_size), ("arch", p.archive_bits, p.archive_group)):
            vg = p.value_group_size or largest_divisor(value_dim, group)
            kg = group if p.key_axis == "channel" else (p.value_group_size or min(group, head_dim))
            if value_dim % vg:
                raise ValueError(f"value_group_size={vg} must divide the value head_dim={value_dim}")
            if p.key_axis == "token" and head_dim % kg:
                raise ValueError(f"per-token key groups of {kg} channels must divide head_dim={head_dim}")
            self.specs[tier] = _TierSpec(bits, kg, vg, p.archive_key_bits if tier == "arch" else None)
        if p.rotation not in ("auto", "static", "none"):
            for flag, dim in ((p.rotation in ("keys", "both"), head_dim), (p.rotation in ("values", "both"), value_dim)):
                if flag and not is_power_of_two(dim):
                    raise ValueError(f"rotation={p.rotation!r} needs a power-of-two head_dim, got {dim}")
        super().lazy_initialization(key_states, value_states)
        if p.tail_dtype == "auto":
            self.tail_dtype = key_states.dtype if key_states.dtype in (torch.float16, torch.bfloat16) else torch.float16
        else:
            self.tail_dtype = getattr(torch, p.tail_dtype) if p.tail_dtype else key_states.dtype
        self.rot_dtype = getattr(torch, p.rotation_dtype) if p.rotation_dtype else torch.float32
        self.formats["warm"] = KIVIFormat(self, self.specs["warm"])
        if needs_rope(p) and self.rope is None:
            raise ValueError(f"archive_quantizer={p.archive_quantizer!r} undoes RoPE with the model's rope_theta: "
                             "build the cache with the model config, TieredQuantCache(config=model.config, ...)")
        for name, dim in (("head_dim", head_dim), ("value head_dim", value_dim)):
            if p.archive_rank is not None and p.archive_rank > dim:
                raise ValueError(f"archive_rank={p.archive_rank} exceeds the {name} {dim}: choose at most {dim}, or "
                                 "None (every direction)")
        if self.recipe is None and p.rotation == "static":
            self.recipe = LayerRecipe("values" if is_power_of_two(value_dim) else "none", source="static")
        elif self.recipe is None and p.rotation != "auto":
            self.recipe = LayerRecipe(p.rotation)
        if self.recipe is not None and self.recipe.archive_bits is not None:  # given, or chosen by calibration
            self.specs["arch"] = dataclasses.replace(self.specs["arch"], bits=self.recipe.archive_bits)
        chooses = len(self._rotation_candidates()) > 1 or self._clip_choice()
        self.calibrating = self.recipe is None and chooses and bool(self._kivi_tiers())
        if self.recipe is None and not self.calibrating:
            self.recipe = LayerRecipe("none")
        self.query_window = p.calibration_queries if self.calibrating else 0
        self._set_rotation(self.recipe.rotation if self.recipe is not None else "none")

    def _rotation_candidates(self) -> tuple[str, ...]:
        """The rotations this layer's head dims allow (a Hadamard rotation needs a power of two)."""
        ok_k, ok_v = is_power_of_two(self.head_dim), is_power_of_two(self.value_dim)
        return tuple(c for c in ROTATION_CANDIDATES
                     if (ok_k or c not in ("keys", "both")) and (ok_v or c not in ("values", "both")))

    def _set_rotation(self, rotation: str) -> None:
        """The Hadamard rotations of keys and values (`quant.rotation.HadamardRotation`: signs and small Sylvester
        factors, no matrix; one object per size and seed, shared by every layer)."""
        rot_k, rot_v = rotation in ("keys", "both"), rotation in ("values", "both")
        self.rot_k = hadamard_rotation(self.head_dim, 0, self.device) if rot_k else None
        self.rot_v = hadamard_rotation(self.value_dim, 1, self.device) if rot_v else None

    # ---- calibration ("auto" rotation) ---------------------------------------------------------------------------
    def observe_queries(self, queries: torch.Tensor, scaling: float) -> None:
        """The last queries of a forward, `[batch, heads, <= calibration_queries, head_dim]` (post-RoPE), from the
        "hf_kvcache" attention while this layer calibrates."""
        if self.calibrating:
            q = queries.detach()
            prev = self._calib_queries
            if prev is not None and prev.shape[:2] == q.shape[:2]:  # consecutive forwards: consecutive positions
                q = torch.cat([prev, q], dim=2)[:, :, -self.plan.calibration_queries :]
            self._calib_queries, self._calib_scaling = q, float(scaling)

    def _calibrate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Pick the rotation from `keys`/`values` (the held positions `[0, T)` the stored queries are the last of)."""
        queries = self._calib_queries
        if queries is None or keys.shape[2] < self.plan.tail_length + self.plan.archive_group:
            self.recipe = LayerRecipe("none", {}, "no-queries")
        else:
            self.recipe = choose_recipe(queries, keys, values, self._calib_scaling, self._roundtrip,
                                        self._rotation_candidates(), self._kivi_tiers())
            self._choose_key_clipping(queries, keys, values)
            self._widen_archive(queries, keys, values)
        self._set_rotation(self.recipe.rotation)
        self.calibrating, self.query_window, self._calib_queries = False, 0, None

    def _clip_choice(self) -> bool:
        """Whether calibration decides the key clipping (`clip_on="auto"` with a clip to apply)."""
        p = self.plan
        return p.clip_on == "auto" and (p.clip_search or p.clip_ratio != 1.0)

    def clips(self, tensor: str) -> bool:
        """Whether `tensor` ("keys" / "values") groups take clip_ratio / clip_search: `clip_on`, or with "auto"
        values always and keys as the recipe says (unclipped until calibrated, or without queries)."""
        on = self.plan.clip_on
        if on == "auto":
            return tensor == "values" or bool(self.recipe is not None and self.recipe.clip_keys)
        return on in (tensor, "both")

    def _choose_key_clipping(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`clip_on="auto"`: clip the key groups when that lowers the mean attention error of this layer's queries
        over its KIVI tiers, under the chosen rotation, by more than `calibrate.recipe.KEY_CLIP_MARGIN` (recorded in
        the recipe with both errors)."""
        if not self._clip_choice():
            return

        def roundtrips(clip: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
            self.recipe.clip_keys = clip  # what `clips("keys")` reads while quantizing
            return [self._roundtrip(keys, values, self.recipe.rotation, t) for t in self._kivi_tiers()]

        clip, errors = choose_key_clipping(queries, keys, values, self._calib_scaling, roundtrips)
        self.recipe.clip_keys = clip
        self.recipe.errors.update(errors)

    def _widen_archive(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`archive_error_target`: give this layer the narrowest KIVI archive width (archive_bits..warm_bits) whose
        round trip under the chosen rotation keeps its queries' attention error within the target."""
        p, base = self.plan, self.specs["arch"]
        if p.archive_error_target is None or "arch" not in self._kivi_tiers():
            return

        def roundtrip_at(width: int) -> tuple[torch.Tensor, torch.Tensor]:
            self.specs["arch"] = dataclasses.replace(base, bits=width)
            return self._roundtrip(keys, values, self.recipe.rotation, "arch")

        bits, errors = choose_archive_bits(queries, keys, values, self._calib_scaling, roundtrip_at, base.bits,
                                           p.warm_bits, p.archive_error_target)
        self.specs["arch"] = dataclasses.replace(base, bits=bits)
        self.recipe.errors.update(errors)
        self.recipe.archive_bits = bits if bits != base.bits else None

    def _kivi_tiers(self) -> tuple[str, ...]:
        """The tiers a rotation applies to (KIVI-quantized ones), each distinct spec once."""
        p = self.plan
        tiers = ("warm",) if p.warm_length else ()
        if p.archive_quantizer == "kivi" and not (tiers and self.specs["warm"] == self.specs["arch"]):
            tiers += ("arch",)
        return tiers

    def _roundtrip(self, keys: torch.Tensor, values: torch.Tensor, rotation: str, tier: str = "arch"):
        """`keys`/`values` of positions `[0, T)` as `tier` ("warm" or "arch") would return them under `rotation`:
        everything but the last `tail_length` (in whole archive groups) quantized at that tier's width, sinks and the
        rest exact."""
        self._set_rotation(rotation)
        g = self.plan.archive_group
        m = (keys.shape[2] - self.plan.tail_length) // g * g
        k_out, v_out = keys.float().clone(), values.float().clone()
        if m > 0:
            q = self._quantize(self._mask_outside(keys[:, :, :m], 0), self._mask_outside(values[:, :, :m], 0), tier)
            k_out[:, :, :m], v_out[:, :, :m] = self._dequantize(q, 0)
            n_sink = min(self.plan.sink_length, m)
            k_out[:, :, :n_sink], v_out[:, :, :n_sink] = keys[:, :, :n_sink].float(), values[:, :, :n_sink].float()
        return k_out, v_out

    def _qargs(self, tier) -> tuple[dict, dict]:
        p, spec = self.plan, (self.specs[tier] if isinstance(tier, str) else tier)
        clip = dict(clip_ratio=p.clip_ratio, clip_search=p.clip_search)
        k_clip = clip if self.clips("keys") else {}
        v_clip = clip if self.clips("values") else {}
        return (
            dict(group_size=spec.key_group, axis=p.key_axis, bits=spec.kbits, **k_clip),
            dict(group_size=spec.value_group, axis="token", bits=spec.bits, **v_clip),
        )

    supports_sliding = True

    def reset(self) -> None:
        """Forget the held tokens; a recipe chosen by calibration and fitted codebooks / bases stay (they belong to
        the model, not the text)."""
        super().reset()
        self.tiers = LayerTiers()
        self.switches = []
        self.quality.reset()
        self.plan = self._plan()
        self.dropped = 0
        self._calib_waited, self._calib_queries = False, None

    # ---- tier bookkeeping ---------------------------------------------------------------------------------------
    def tokens_held(self) -> int:
        return self.tiers.held()

    def batch_size(self) -> int:
        return self.tiers.batch()

    def _map_store(self, fn) -> None:
        self.tiers = self.tiers.map_rows(fn)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.tiers.state()[1]

    def load_tiers(self, tiers: LayerTiers) -> None:
        """Put back tiers read from `state_tensors` / `tiers.state()` (the codec's restore), the formats' fitted
        state (codebooks, bases) and the adaptive archive's switches included."""
        self.tiers = tiers
        self.switches = []
        pos, prev = self._tier_starts()["archive"], None
        for q in self._segments(tiers.archive):
            name, bits = format_of(q)
            if name != "kivi":  # KIVI codes carry everything they need; the fitted formats take their state back
                self._archive_format(name, bits).adopt(q)
            label = format_label(q)
            if prev is not None and prev != label:
                self.switches.append({"position": pos, "from": prev, "to": label})
            pos, prev = pos + q.tokens, label

    @property
    def codebooks(self) -> tuple | None:
        """The KVQuant archive's (keys, values) codebooks, once fitted."""
        f = self.formats.get("kvquant")
        return None if f is None else f.codebooks

    @staticmethod
    def _segments(q) -> list[QuantTier]:
        return [] if q is None else q.segments()

    def held_tensors(self) -> list[torch.Tensor]:
        """The stored tiers (codebooks included) plus the tensors of the Hadamard rotations (signs and Sylvester
        factors) the layer reads them with."""
        extra = [t for r in (getattr(self, n, None) for n in ("rot_k", "rot_v")) if r is not None
                 for t in r.tensors()]
        return [*self.tiers.tensors(), *extra]

    def tier_tokens(self) -> dict[str, int]:
        """Positions each tier serves (a sink position counts as a sink, not in the tier under it)."""
        t = self.tiers
        sink = t.tokens("sink")
        out, lo = {"sink": sink}, 0
        for tier in ("archive", "warm", "tail"):
            hi = lo + t.tokens(tier)
            out[tier] = hi - lo - max(0, min(hi, sink) - lo)
            lo = hi
        return out

    @staticmethod
    def _plain(k: torch.Tensor, v: torch.Tensor) -> PlainTier | None:
        return PlainTier(k, v) if k.shape[2] else None

    # ---- quantize / dequantize ----------------------------------------------------------------------------------
    def _mask_outside(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """`x` holds positions `start..` of every row: give its sink positions the values of the first non-sink
        position (or 0), and each row's left-padding positions the values of its first real position, so that
        neither widens its group's range (the sinks' real values live in the sink tier; padding is never
        attended)."""
        n = x.shape[2]
        n_sink = min(self.plan.sink_length, start + n) - start
        padding = self.row_padding(x.shape[0])
        if n_sink <= 0 and (padding is None or not bool((padding > start).any())):
            return x
        x = x.clone()
        if n_sink > 0:
            x[:, :, :n_sink] = x[:, :, n_sink : n_sink + 1] if n_sink < n else 0
        if padding is not None:
            first_real = (padding - start).clamp(0, n - 1).to(x.device)  # [batch]
            fill = x.gather(2, first_real.view(-1, 1, 1, 1).expand(-1, x.shape[1], 1, x.shape[3]))
            pads = (torch.arange(start, start + n, device=x.device).view(1, 1, n, 1) < padding.to(x.device).view(-1, 1, 1, 1))
            x = torch.where(pads, fill, x)
        return x

    def _archive_format(self, name: str, bits: int) -> ArchiveFormat:
        """The layer's `name` format at `bits` bits (kept, with its fitted state, while its spec stays the same)."""
        spec = dataclasses.replace(self.specs["arch"], bits=bits)
        f = self.formats.get(name)
        if f is None or f.spec != spec:
            f = self.formats[name] = FORMAT_CLASSES[name](self, spec)
        return f

    def _format_at(self, start: int) -> ArchiveFormat:
        """The format of the archive group starting at position `start` (adaptive: chosen by that position)."""
        p = self.plan
        if p.archive_quantizer != "adaptive":
            return self._archive_format(p.archive_quantizer, self.specs["arch"].bits)
        i = sum(start >= b for b in p.adaptive_boundaries)
        return self._archive_format(p.adaptive_formats[i], p.adaptive_bits[i])

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

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor, tier: str, start: int = 0, rotated: bool = False,
                  track: bool = False) -> QuantTier:
        """Quantize positions `start..` for `tier` ("warm": KIVI codes; "arch": the archive format of `start`,
        fitted first if it needs fitting and is not yet): KIVI codes in the rotated basis (`rotated`: the input is
        in it already), or nuq / subspace codes of the pre-RoPE keys and of the values. `track`: add the block's
        error to `quality` (blocks stored, not calibration round trips), measured where the codes live."""
        fmt = self.formats["warm"] if tier == "warm" else self._format_at(start)
        if not fmt.fitted:
            self._fit_archive(fmt, keys, values, start)
        keys, values = fmt.prepare(keys, values, start, rotated)
        q = fmt.encode(keys, values)
        if track:
            self.quality.record("archive" if tier == "arch" else tier, keys, values, q.keys, q.values)
        return q

    def _fit_archive(self, fmt: ArchiveFormat, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Fit `fmt` (KVQuant codebooks, subspace bases) on positions `start..` (the first ones archived, and, when
        it follows them, the warm tier after them); kept for later sequences too."""
        warm, end = self.tiers.warm, start + keys.shape[2]
        if warm is not None and self._tier_starts()["warm"] + self._in_flight == end:
            wk, wv = self._dequantize(warm, end)
            keys, values = torch.cat([keys.float(), wk], 2), torch.cat([values.float(), wv], 2)
        fmt.fit(*fmt.prepare(keys, values, start))

    def _dequantize(self, q, start: int, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 keys and values of (a slice of) a quantized tier that starts at position `start` (KIVI tiers still
        rotated when `rotated`); a `SegmentedTier` segment by segment."""
        if isinstance(q, SegmentedTier):
            parts, pos = [], start
            for seg in q.parts:
                parts.append(self._dequantize(seg, pos, rotated))
                pos += seg.tokens
            return torch.cat([k for k, _ in parts], 2), torch.cat([v for _, v in parts], 2)
        if isinstance(q.keys, KIVIQuantized):
            return self.formats["warm"].decode(q, start, rotated)
        name, bits = format_of(q)
        return self._archive_format(name, bits).decode(q, start, rotated)

    def _tier_starts(self) -> dict[str, int]:
        a = self.dropped
        return {"archive": a, "warm": a + self.tiers.tokens("archive")}

    # ---- storing ------------------------------------------------------------------------------------------------
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        p, t = self.plan, self.tiers
        new = PlainTier(key_states.to(self.tail_dtype), value_states.to(self.tail_dtype))
        held = self.tokens_held()
        if held < p.sink_length:
            m = min(p.sink_length - held, new.tokens)
            sink = new.slice(0, m)  # a copy: a view would keep the whole chunk's storage alive
            t.sink = sink if t.sink is None else t.sink.cat(sink)
        tail = new.slice(0) if t.tail is None else t.tail.cat(new)  # never a view of the model's tensors
        unit = p.group_size if p.warm_length else p.archive_group
        excess = tail.tokens - p.tail_length
        if excess >= unit and self.calibrating:
            before = tail.tokens - new.tokens  # positions the queries seen so far end at
            queries = self._calib_queries
            first_wait = queries is None and not self._calib_waited
            # the first forward's queries reach the layer after this update; then wait until enough positions (at
            # most CALIBRATION_GROUPS archive groups past the tail) can be round-tripped to compare candidates
            short = queries is not None and before < p.tail_length + CALIBRATION_GROUPS * p.archive_group
            if first_wait or short:
                self._calib_waited = True
                t.tail = tail
                return
            self._calibrate(tail.keys[:, :, :before], tail.values[:, :, :before])
        if excess >= unit:
            m = excess // unit * unit
            self._graduate(tail.keys[:, :, :m], tail.values[:, :, :m])
            tail = tail.slice(m)
        t.tail = tail
        self._drop_outside_window()

    def _graduate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Whole groups leaving the tail (oldest first) go to the warm tier, or to the archive without one."""
        p, t = self.plan, self.tiers
        start = self.dropped + t.tokens("archive") + t.tokens("warm")
        keys, values = self._mask_outside(keys, start), self._mask_outside(values, start)
        if p.warm_length == 0:
            for off, n, _ in self._format_runs(start, keys.shape[2]):
                k, v = keys[:, :, off : off + n], values[:, :, off : off + n]
                self._append_archive(self._quantize(k, v, "arch", start + off, track=True), start + off)
            return
        q = self._quantize(keys, values, "warm", track=True)
        t.warm = q if t.warm is None else t.warm.cat(q)
        ga = p.archive_group
        excess = t.warm.tokens - self._warm_target()
        if excess < ga:
            return
        m = excess // ga * ga
        old, t.warm = t.warm.slice(0, m), t.warm.slice(m)
        start = self._tier_starts()["archive"] + t.tokens("archive")
        for off, n, fmt in self._format_runs(start, m):
            self._in_flight = m - off  # positions between the archive's end and the warm tier (`_fit_archive`)
            block = old.slice(off, off + n) if n < m else old
            if fmt.moves(self.specs["warm"]):  # same KIVI codes: moved as they are
                self._append_archive(block, start + off)
                continue
            # re-quantized from the warm values (full precision is gone by now): in the rotated basis for KIVI, as
            # plain keys for the fitted formats (which undo their RoPE)
            rk, rv = self._dequantize(block, start + off, rotated=fmt.rotated)
            q = self._quantize(rk, rv, "arch", start + off, rotated=fmt.rotated, track=True)
            self._append_archive(q, start + off)
        self._in_flight = 0

    def _warm_target(self) -> int:
        """Positions the warm tier keeps now: warm_length, warm_fraction of the positions seen (of the window), or
        what the memory target allows (`budget`, full-attention layers), whichever is most."""
        p = self.plan
        seen = self.cumulative_length if self.sliding_window is None else min(self.cumulative_length, self.sliding_window)
        target = max(p.warm_length, int(p.warm_fraction * seen) // p.group_size * p.group_size)
        if self.budget is not None and not self.is_sliding:
            target = max(target, self.budget.warm_positions(self))
        return target

    def _append_archive(self, q: QuantTier, start: int) -> None:
        """`q` (positions `start..`) after the archive; a change of format is recorded in `switches`."""
        t = self.tiers
        if t.archive is not None:
            before, now = self._segments(t.archive)[-1], q
            if not same_format(before, now):
                self.switches.append({"position": start, "from": format_label(before), "to": format_label(now)})
        t.archive = q if t.archive is None else t.archive.cat(q)

    def _drop_outside_window(self) -> None:
        """Sliding layers: drop the archive's oldest whole groups that no later query can attend (a query at
        position P sees keys after P - sliding_window)."""
        t = self.tiers
        if not self.is_sliding or t.archive is None:
            return
        g = self.plan.archive_group
        first_visible = self.cumulative_length - self.sliding_window + 1
        m = min(t.archive.tokens, max(0, first_visible - self.dropped)) // g * g
        if m:
            t.archive = t.archive.slice(m) if m < t.archive.tokens else None
            self.dropped += m

    # ---- reading ------------------------------------------------------------------------------------------------
    def _dequantize_tiers_into(self, out_k: torch.Tensor, out_v: torch.Tensor) -> int:
        """Dequantize archive then warm into the first positions of `out_k` / `out_v`; returns how many.

        A rotated KIVI tier is dequantized into a contiguous scratch buffer (in `rotation_dtype`) and un-rotated with
        one Walsh-Hadamard transform over all its tokens, written back into `out`; the other formats are decoded
        (RoPE put back)."""
        pos, start = 0, self._tier_starts()["archive"]
        for q in [*self._segments(self.tiers.archive), *self._segments(self.tiers.warm)]:
            n = q.tokens
            start += n
            if not isinstance(q.keys, KIVIQuantized):
                k, v = self._dequantize(q, start - n)
                out_k[:, :, pos : pos + n].copy_(k)
                out_v[:, :, pos : pos + n].copy_(v)
                pos += n
                continue
            for part, out, rot in ((q.keys, out_k, self.rot_k), (q.values, out_v, self.rot_v)):
                if rot is None:
                    dequantize_kivi(part, out=out[:, :, pos : pos + n])
                    continue
                scratch = torch.empty(*out.shape[:2], n, out.shape[3], dtype=self.rot_dtype, device=out.device)
                dequantize_kivi(part, out=scratch)
                out[:, :, pos : pos + n].copy_(rot.unrotate(scratch))
            pos += n
        return pos

    def materialize_into(self, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """Dequantize the held tokens straight into `out_k` / `out_v` (`[batch, kv_heads, held, dim]`)."""
        t = self.tiers
        pos = self._dequantize_tiers_into(out_k, out_v)
        for plain, at in ((t.tail, pos), (t.sink, 0)):
            if plain is not None:
                out_k[:, :, at : at + plain.tokens].copy_(plain.keys)
                out_v[:, :, at : at + plain.tokens].copy_(plain.values)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        out_k, out_v = self._empty(self.tokens_held())
        self.materialize_into(out_k, out_v)
        return out_k, out_v

    def attention_segments(self) -> list | None:
        """archive | warm | tail as segments the fused attention reads in place (no copy), plus the full-precision
        sinks as an overlay of the positions they replace in a quantized tier (while the sinks are still in the tail,
        the tail holds them exactly and no overlay is needed). Rotated tiers carry their rotation: the attention
        rotates the queries instead of un-rotating the keys. None (the layer then hands over dequantized tensors)
        for the per-token-keys ablation and an archive that holds another format than KIVI."""
        t = self.tiers
        quantized = [*self._segments(t.archive), *self._segments(t.warm)]
        if (self.plan.key_axis != "channel" or self.head_dim != self.value_dim
                or any(not isinstance(q.keys, KIVIQuantized) for q in quantized)):
            return None
        segments = []
        for q in quantized:
            if q is not None:
                k, v = q.keys, q.values
                segments.append(QuantSegment(k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, k.bits, v.bits,
                                             k.group_size, v.group_size, self.head_dim, self.rot_k, self.rot_v))
        if t.tail is not None:
            segments.append(FullSegment(t.tail.keys, t.tail.values))
        overlaid = min(t.tokens("sink"), t.tokens("archive") + t.tokens("warm"))
        if overlaid:
            segments.append(FullSegment(t.sink.keys[:, :, :overlaid], t.sink.values[:, :, :overlaid], overlay_at=0))
        return segments

    # ---- batch / beam contract ----------------------------------------------------------------------------------
    def _crop_newest(self, n: int) -> None:
        """Tail tokens are simply dropped. A crop that reaches into a quantized tier reopens the groups it cuts: their
        surviving tokens go back to the tail as their dequantized values (and are quantized again when they
        graduate). Sinks past the new end are dropped too."""
        t = self.tiers
        cut = min(n, t.tokens("tail"))
        if cut:
            t.tail = t.tail.slice(0, t.tail.tokens - cut) if cut < t.tail.tokens else None
            n -= cut
        for name in ("warm", "archive"):
            q = getattr(t, name)
            if n == 0 or q is None:
                continue
            g = self.plan.group_size if name == "warm" else self.plan.archive_group
            count = q.tokens
            reopen = min(-(-n // g) * g, count)
            drop = min(n, reopen)
            start = self._tier_starts()[name] + count - reopen
            opened = q.slice(count - reopen)
            setattr(t, name, q.slice(0, count - reopen) if reopen < count else None)
            n -= drop
            if reopen > drop:  # n is 0 now and the tail is empty: the survivors become the tail
                k, v = self._dequantize(opened, start)
                keep, dt = reopen - drop, self.tail_dtype
                t.tail = PlainTier(k[:, :, :keep].to(dt).contiguous(), v[:, :, :keep].to(dt).contiguous())
        end = self.tokens_held()
        if t.tokens("sink") > end:
            t.sink = t.sink.slice(0, end) if end else None
        archive_end = self._tier_starts()["warm"]  # switches past the archive's new end are undone
        self.switches = [s for s in self.switches if s["position"] < archive_end]

    # ---- accounting ---------------------------------------------------------------------------------------------
    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Bytes held and positions served by each tier of this layer."""
        tokens = self.tier_tokens()
        return {
            name: {"bytes": sum(x.nbytes for x in tier.tensors()) if tier is not None else 0, "tokens": tokens[name]}
            for name, tier in ((n, getattr(self.tiers, n)) for n in TIERS)
        }


class KIVILayer(TieredQuantLayer):
    """Residual window + one quantized tier: the tiered layer without a warm tier."""

    options: KIVIOptions

    def __init__(self, options: KIVIOptions | None = None, sliding_window: int | None = None) -> None:
        super().__init__(options if options is not None else KIVIOptions(), sliding_window)

    def _options_as_tiered(self) -> TieredQuantOptions:
        return self.options.as_tiered()


class TieredQuantCache(AdaptiveThresholds, CompressedCache):
    """Hot tail + 4-bit warm + 2-bit archive (KIVI). `TieredQuantCache(config=model.config, tail_length=64)`.

    Quality: `quality_metrics()` (online proxy), `adapt_thresholds(feedback)` / `save_thresholds` /
    `load_thresholds` (`hf_kvcache.calibrate.thresholds`: the hot boundary and archive width, adapted from measured
    quality between sequences)."""

    options_class = TieredQuantOptions
    layer_class = TieredQuantLayer
    reads_fused = True  # generate binds it to the model and runs the fused attention over its codes

    def __init__(self, config=None, **options: Any) -> None:
        super().__init__(config, **options)
        if config is not None and isinstance(self.options, TieredQuantOptions) and needs_rope(self.options):
            text = config.get_text_config(decoder=True)
            types = getattr(text, "layer_types", None) or [None] * len(self.layers)
            for layer, layer_type in zip(self.layers, types):
                if isinstance(layer, TieredQuantLayer):
                    layer.rope = KeyRotation.from_config(
                        config, layer_type=layer_type, user=f"archive_quantizer={self.options.archive_quantizer!r}",
                        instead="archive_quantizer='kivi'" + (
                            " or subspace_prerope=False" if self.options.archive_quantizer == "subspace" else ""))
        target = getattr(self.options, "target_ratio", None)
        if target is not None:
            budget = RatioBudget(target, self.layers)
            for layer in self.layers:
                if isinstance(layer, TieredQuantLayer):
                    layer.budget = budget
        recipes = getattr(self.options, "recipes", None)
        if recipes is not None:
            if len(recipes) != len(self.layers):
                raise ValueError(f"recipes has {len(recipes)} entries, the model has {len(self.layers)} layers; pass "
                                 "the list cache.recipes() returned for this model")
            for layer, r in zip(self.layers, recipes):
                if r is not None and isinstance(layer, TieredQuantLayer):
                    layer.recipe = LayerRecipe.from_dict(r)

    def quality_metrics(self) -> dict[str, Any]:
        """A cheap online quality proxy (`hf_kvcache.calibrate.quality`): `proxy`, the relative squared error of the
        held keys/values averaged over layers (each tier's error weighted by the positions it serves), and per tier
        the relative error of the blocks quantized into it this sequence (averaged over layers)."""
        layers = [la for la in self.layers if isinstance(la, TieredQuantLayer) and la.is_initialized]
        if not layers:
            return {"proxy": 0.0, "tiers": {}}
        proxy = sum(la.quality.proxy(la.tier_tokens()) for la in layers) / len(layers)
        tiers = {t: sum(la.quality.error_of(t) for la in layers) / len(layers) for t in ("warm", "archive")}
        return {"proxy": proxy, "tiers": tiers}

    def recipes(self) -> list[dict | None]:
        """Per model layer, the recipe it runs with (None: not chosen yet, or not a tiered layer): JSON-ready, and
        what `TieredQuantCache(config, recipes=...)` takes to skip calibration."""
        return [layer.recipe.to_dict() if isinstance(layer, TieredQuantLayer) and layer.recipe else None
                for layer in self.layers]

    def memory_stats(self) -> dict[str, Any]:
        """`memory_stats` plus `tiers`: bytes (summed over layers) and positions served (per layer) of each tier.

        Layers that are not tiered (sliding-window layers kept as transformers makes them) count in `bytes` only.
        """
        stats: dict[str, Any] = memory_stats(self)
        tiers = {tier: {"bytes": 0, "tokens": 0} for tier in TIERS}
        for layer in self.layers:
            if isinstance(layer, TieredQuantLayer):
                for tier, d in layer.tier_stats().items():
                    tiers[tier]["bytes"] += d["bytes"]
                    tiers[tier]["tokens"] = max(tiers[tier]["tokens"], d["tokens"])
        stats["tiers"] = tiers
        stats["archive_switches"] = [{"layer": i, **sw} for i, layer in enumerate(self.layers)
                                     if isinstance(layer, TieredQuantLayer) for sw in layer.switches]
        return stats


class KIVICache(TieredQuantCache):
    """KIVI: `residual_length` newest tokens in full precision, the rest at `bits` (keys per channel)."""

    options_class = KIVIOptions
    layer_class = KIVILayer
    threshold_fields = ("residual_length", "bits")
