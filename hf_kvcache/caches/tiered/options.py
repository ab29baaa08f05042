"""The options of the tiered and KIVI caches, their checks, and the per-tier quantization specs a layer derives
from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


from ...options import CacheOptions, check_bool, check_choice, check_int, check_number, check_positive_int
from ...quant.kivi import AXES
from ...calibrate import ROTATION_CANDIDATES, LayerRecipe
from ..archive import ARCHIVE_FORMATS


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
                  "archive_quantizer", "archive_candidates")
# the options the full-attention layers of a model with sliding-window layers may run with differently
# (`TieredQuantOptions.hybrid_full`): widths, groups and tier sizes; the archive format stays the cache's
HYBRID_FULL_FIELDS = tuple(f for f in SLIDING_FIELDS if f not in ("archive_quantizer", "archive_candidates"))
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
                "warm_fraction": 0.0, "target_ratio": 5.0, "archive_candidates": None,
                "fitted_state_from_warm": False,
                "sliding": {**SLIDING_DEFAULT, "archive_group_size": 64}}
# the archive formats calibration chooses from by default (`archive_candidates="auto"`, round 17 of
# docs/rows/ruler_tiered_selection_rule.md)
DEFAULT_CANDIDATES = ("kivi", "subspace")
# `cache_implementation="tiered_retrieval"`: round 13's retrieval setting (docs/rows/ruler_tiered_selection_rule.md),
# kept as it was measured: calibration on the prompt as it comes, and a fitted archive format competing after a fit
# on 2 positions per head dimension; the default since round 17 differs in those two (2048 calibration positions,
# 10 per dimension)
RETRIEVAL = {"archive_candidates": list(DEFAULT_CANDIDATES), "warm_fraction": 0.0, "target_ratio": 5.15,
             "fitted_state_from_warm": True, "calibration_positions": 0, "candidate_fit_per_dim": 2}
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
    - fitted_state_from_warm: where `warm_length` is what the warm tier keeps (the memory target out of reach: short
      contexts), a layer whose archive format holds fitted state (subspace bases, KVQuant codebooks) keeps fewer
      warm positions, as many fewer as it takes to hold no more bytes than with a KIVI archive and `warm_length`
      warm positions (`caches.budget.fitted_warm_floor`); where the memory target sizes the warm tier, it already
      counts that state (the default). False: `warm_length` for every layer
    - warm_fraction: the warm tier also keeps this fraction of the positions seen (of the window, for a sliding
      layer), rounded down to whole groups, when that is more than warm_length: the archive's share, and its error,
      stop growing with the context (0, the default since round 17: a fixed warm tier, sized by target_ratio)
    - target_ratio: the warm tier also keeps as many positions as the cache's memory allows at this ratio vs fp16
      (`caches.budget.RatioBudget`: the bytes every tensor of the cache holds, sliding-window layers included, at
      most fp16 bytes / target_ratio once the context is long enough for it): the newest positions get warm_bits
      as far as that memory goes (None: no memory target; 5.15 by default, chosen in round 17 of
      docs/rows/ruler_tiered_selection_rule.md)
    - min_ratio: the warm tier keeps no more positions than the cache's memory allows at this ratio vs fp16 (the same
      `RatioBudget` as target_ratio, read as a cap on what warm_fraction and target_ratio give full-attention
      layers; never fewer than warm_length): the whole cache stays at least this many times smaller than fp16 once
      the context is long enough for it (None: no cap; at most target_ratio when both are set)
    - warm_bits / archive_bits: code widths of the two quantized tiers (1..8; 1, 2, 4, 8 unpack by table lookup)
    - archive_key_bits: the archive's key width when it differs from its value width (None: archive_bits; not
      with the adaptive archive; the subspace archive spreads it over the key directions as it does archive_bits).
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
    - archive_candidates: formats (names of "kivi", "kvquant", "subspace") that calibration (rotation "auto", with
      queries) may give a layer's archive instead of `archive_quantizer`: each is fitted on the layer's held
      positions and round-tripped at the archive's widths, and a candidate is taken when it lowers the attention
      error of the layer's queries by `calibrate.recipe.ARCHIVE_FORMAT_MARGIN` (relative) against
      `archive_quantizer` (a fitted format is fitted on the first half of the held archive groups, so that the
      other half is coded as later positions are; it competes only when that half holds at least
      `candidate_fit_per_dim` positions per head dimension); the choice is in the
      layer's recipe (`cache.recipes()`), and the chosen format is fitted as usual on what the layer archives.
      Without queries, `archive_quantizer`. None / []: no choice. "auto" (the default): `DEFAULT_CANDIDATES` (KIVI
      or a subspace basis) where rotation is "auto" and archive_quantizer "kivi", else None (and None in a cache
      built without the model config, or for a model without RoPE over the whole head: the subspace candidate's
      pre-RoPE keys need it); set None for a KIVI archive in every layer. Sliding-window layers take it only from
      `sliding`.
      The fused attention reads a subspace archive in place (pre-RoPE keys rebuilt at every step, post-RoPE ones
      folded into the query, see subspace_prerope); a KVQuant archive is dequantized at every step
    - candidate_fit_per_dim: archive_candidates: a fitted format (subspace, KVQuant) competes only where the
      positions its calibration fit holds number at least this many per head dimension (the larger of keys' and
      values'): fitted on fewer, a basis scores well on the calibration's own positions and badly on the rest of
      the stream, and its bytes are not paid back (a 2048-token stream in 32-token chunks calibrates on ~320
      positions and fits on 128, 2 per dimension of a 64-dim head; a 2048-position calibration fits on 960; the
      default 10 was fixed before round 17's runs)
    - archive_fit_positions: a fitted archive format (KVQuant, subspace) waits until the warm tier holds at least
      this many positions and is fitted on all of them (they stay at warm_bits until then; 0: fitted on the first
      archive group and the warm tier after it). A basis or codebook fitted once on a few hundred positions of a
      stream serves the whole stream.
    - archive_rank: subspace archive only: keep the leading `archive_rank` directions of each basis (1..head_dim;
      None: all): fewer codes for extreme ratios, the dropped directions read back as their mean
    - subspace_allocation: subspace archive: spread the archive_bits x rank code bits of a token over subspaces of
      directions by the fitted variances (reverse water-filling: leading directions get more bits, trailing ones
      may get none and are dropped); False: archive_bits for every direction
    - subspace_prerope: subspace archive keys fitted and quantized before RoPE (undone with the model's RoPE, as
      the KVQuant archive does) or, False, as the model hands them over (post-RoPE: the fused attention then scores
      them from their coefficients: about head_dim times fewer multiply-adds a key than rebuilding pre-RoPE keys)
    - adaptive_boundaries / adaptive_formats / adaptive_bits: the adaptive archive's switch positions (increasing),
      and the format names ("kivi", "subspace", "kvquant") and widths (1..8), one more than boundaries
    - key_axis: "channel" (KIVI) or "token" (ablation: keys quantized per token like values)
    - rotation: randomized Hadamard rotation of the head dim before quantizing: "none", "keys", "values", "both",
      or "auto": each layer picks one of those from its own keys, values and queries on its first prefill
      (`hf_kvcache.calibrate`; the queries come from the "hf_kvcache" attention, which `generate` switches to; without
      them a layer takes "none"); "static": values rotated wherever the value head dim is a power of two, keys
      never, chosen without queries, so that `generate`, `attached` and a user's plain loop run the same recipe
    - calibration_queries: how many of the first forward's last queries "auto" calibrates with
    - calibration_positions: where a sequence's first update brings enough positions to calibrate on (a prompt, or
      the first chunk of a chunked prefill such as `generate`'s 512-token chunks), the layer keeps its positions in
      full precision until it holds this many or a shorter update arrives (the prompt's last chunk, a decoding step),
      then calibrates on all of them, as a prompt of that length in one forward would have it do (0: on the first
      chunk, the default until round 14 of docs/rows/ruler_tiered_selection_rule.md chose 2048 on held-out text).
      Token-by-token or short-chunk streams calibrate as before. Costs that many full-precision positions per layer
      while the prefill lasts
    - prefill_warm_positions: while a chunked prefill lasts (the same condition as for calibration_positions),
      the warm tier keeps at least this many of the newest positions past the tail at warm_bits, so that the
      prompt's later chunks attend to warm codes rather than the archive's; when a shorter update arrives the
      warm positions beyond the usual target are re-quantized into the archive at once (0, the default: off; round
      15 of docs/rows/ruler_tiered_selection_rule.md found no retrieval gain on held-out samples). Costs
      (warm_bits - archive_bits) bits per entry of up to that many positions while the prefill lasts; a stream of
      equal chunks that never sends a shorter update keeps them
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
      greedy agreement with DynamicCache after a 700-token prompt from 24 to 2 of 24 tokens, `hf-kvcache
      compare --suite greedy`), unrotated (a rotation lost perplexity there), and a KIVI archive whatever
      `archive_quantizer` says: a subspace basis fitted on the few positions a 64-token warm tier hands
      over (fewer than head_dim 256) misses most directions (Gemma-3-270M, 1024 tokens: subspace +33 %, adaptive
      +4057 % with subspace sliding layers). A sliding layer keeps no sinks either way. Models without sliding
      layers never read it.
    - hybrid_full: options that the full-attention layers of a model with sliding-window layers run with instead of
      the ones above, a JSON object over `HYBRID_FULL_FIELDS` (None, the default: the options above). In such a model
      (Gemma-3-270M: 3 of 18 layers) those few layers carry every read beyond the window. Models without sliding
      layers, and a cache built without the model config (it cannot tell), never read it; sliding layers take
      `sliding` over the options above, not over these.
    """

    tail_length: int = 64
    warm_length: int = 448
    fitted_state_from_warm: bool = True
    warm_fraction: float = 0.0
    target_ratio: float | None = 5.15
    min_ratio: float | None = None
    warm_bits: int = 4
    archive_bits: int = 2
    archive_key_bits: int | None = None
    group_size: int = 32
    archive_group_size: int | None = 64
    value_group_size: int | None = None
    sink_length: int = 4
    archive_quantizer: str = "kivi"
    archive_candidates: list | str | None = "auto"
    candidate_fit_per_dim: int = 10
    archive_outliers: float = 0.01
    archive_rank: int | None = None
    archive_fit_positions: int = 0
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
    calibration_positions: int = 2048
    prefill_warm_positions: int = 0
    archive_error_target: float | None = None
    recipes: list | None = None
    sliding: dict | None = field(default_factory=lambda: dict(SLIDING_DEFAULT))
    hybrid_full: dict | None = None

    def validate(self) -> None:
        check_int("tail_length", self.tail_length, lo=0)
        check_int("warm_length", self.warm_length, lo=0)
        check_bool("fitted_state_from_warm", self.fitted_state_from_warm)
        check_number("warm_fraction", self.warm_fraction, 0.0, 1.0)
        check_number("target_ratio", self.target_ratio, 1.0, lo_open=True, allow_none=True)
        check_number("min_ratio", self.min_ratio, 1.0, lo_open=True, allow_none=True)
        if None not in (self.min_ratio, self.target_ratio) and self.min_ratio > self.target_ratio:
            raise ValueError(f"min_ratio={self.min_ratio} caps the warm tier below what target_ratio="
                             f"{self.target_ratio} fills it to: set min_ratio <= target_ratio, or one of them to None")
        check_int("warm_bits", self.warm_bits, 1, 8)
        check_int("archive_bits", self.archive_bits, 1, 8)
        if self.archive_key_bits is not None:
            check_int("archive_key_bits", self.archive_key_bits, 1, 8)
            if self.archive_quantizer == "adaptive":
                raise ValueError(f"archive_key_bits={self.archive_key_bits} sets the key width of a KIVI, KVQuant or "
                                 "subspace archive; the adaptive archive takes one width per format (adaptive_bits): "
                                 "use archive_quantizer='kivi', 'kvquant' or 'subspace', or archive_key_bits=None")
        check_choice("archive_quantizer", self.archive_quantizer, QUANTIZERS)
        check_number("archive_outliers", self.archive_outliers, 0.0, 0.5, hi_open=True)
        check_int("archive_fit_positions", self.archive_fit_positions, lo=0)
        check_int("candidate_fit_per_dim", self.candidate_fit_per_dim, lo=1)
        self._check_archive_formats()
        _check_quant_knobs(self)
        check_positive_int("archive_group_size", self.archive_group_size, allow_none=True)
        check_positive_int("calibration_queries", self.calibration_queries)
        check_int("calibration_positions", self.calibration_positions, lo=0)
        check_int("prefill_warm_positions", self.prefill_warm_positions, lo=0)
        if self.prefill_warm_positions and self.warm_length == 0:
            raise ValueError(f"prefill_warm_positions={self.prefill_warm_positions} keeps positions in the warm tier, "
                             "which warm_length=0 turns off: set warm_length > 0 or prefill_warm_positions=0")
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
        self._check_overlay("sliding", SLIDING_FIELDS, "sliding-window layers", self.for_sliding)
        self._check_overlay("hybrid_full", HYBRID_FULL_FIELDS, "the full layers of a model with sliding-window layers",
                            self.for_hybrid_full)

    def _check_overlay(self, name: str, fields: tuple[str, ...], layers: str,
                       lay_over: Callable[[], "TieredQuantOptions"]) -> None:
        """Check a per-layer-kind overlay (`sliding`, `hybrid_full`): a JSON object over `fields` whose result
        `lay_over()` validates."""
        over = getattr(self, name)
        if over is None:
            return
        if not isinstance(over, dict):
            raise ValueError(f"{name} must be a JSON object of options for {layers}, e.g. "
                             f'{{"warm_length": 64, "archive_bits": 3}}, or None, got {over!r}')
        unknown = sorted(set(over) - set(fields))
        if unknown:
            raise ValueError(f"{name}: {unknown} cannot be set for {layers} alone; use the keys "
                             f"{list(fields)} (or set the option for every layer)")
        try:
            lay_over()
        except ValueError as exc:
            raise ValueError(f"{name}={over!r}: {exc}") from None

    def for_sliding(self) -> "TieredQuantOptions":
        """The options a sliding-window layer runs with: `sliding` laid over these, and no sinks (nor a subspace
        rank when `sliding` picks an archive without bases)."""
        over = dict(self.sliding or {})
        over.setdefault("archive_candidates", None)
        if over.get("archive_quantizer", self.archive_quantizer) not in ("subspace", "adaptive"):
            over["archive_rank"] = None
        return dataclasses.replace(self, sliding=None, hybrid_full=None, sink_length=0, **over)

    def for_hybrid_full(self) -> "TieredQuantOptions":
        """The options a full-attention layer of a model with sliding-window layers runs with: `hybrid_full` laid
        over these."""
        return dataclasses.replace(self, sliding=None, hybrid_full=None, **(self.hybrid_full or {}))

    def _check_archive_formats(self) -> None:
        check_bool("subspace_prerope", self.subspace_prerope)
        check_bool("subspace_allocation", self.subspace_allocation)
        check_positive_int("archive_rank", self.archive_rank, allow_none=True)
        self._check_archive_candidates()
        subspace = self.archive_quantizer == "subspace" or "subspace" in (self.archive_candidates or ()) or (
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

    def _check_archive_candidates(self) -> None:
        c = self.archive_candidates
        if c == "auto":
            auto = self.rotation == "auto" and self.archive_quantizer == "kivi"
            self.archive_candidates = list(DEFAULT_CANDIDATES) if auto else None
            return
        if c is None:
            return
        if not isinstance(c, list):
            raise ValueError(f"archive_candidates must be a JSON list of archive formats, e.g. ['kivi', 'subspace'], "
                             f"\"auto\" or None, got {c!r}")
        for name in c:
            check_choice("archive_candidates entry", name, ARCHIVE_FORMATS)
        if set(c) - {self.archive_quantizer}:
            if self.archive_quantizer == "adaptive":
                raise ValueError(f"archive_candidates={c} chooses one format per layer; the adaptive archive chooses "
                                 "by position: use archive_quantizer='kivi', 'kvquant' or 'subspace', or "
                                 "archive_candidates=None")
            if self.rotation != "auto":
                raise ValueError(f"archive_candidates={c} is chosen by calibration from the layer's queries: set "
                                 f"rotation='auto' (got {self.rotation!r}), or archive_candidates=None")

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
            archive_error_target=None, sliding=None, hybrid_full=None, archive_candidates=None, target_ratio=None,
            fitted_state_from_warm=False,
        )


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` not above `at_most`: the default value group of a tier (channels per group)."""
    return next(d for d in range(min(n, at_most), 0, -1) if n % d == 0)


def needs_rope(p: TieredQuantOptions, chosen: Iterable[str | None] = ()) -> bool:
    """Whether the archive options (or `chosen`, the archive formats layers' recipes give them; None: the options')
    quantize keys before RoPE (and so need the model's RoPE)."""
    names = p.adaptive_formats if p.archive_quantizer == "adaptive" else [p.archive_quantizer,
                                                                          *(p.archive_candidates or ()), *chosen]
    return "kvquant" in names or ("subspace" in names and p.subspace_prerope)
