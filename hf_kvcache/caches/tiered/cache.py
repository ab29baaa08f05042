"""The tiered and KIVI caches: containers of tiered layers (RoPE for pre-RoPE archives, the memory target, recipes)."""

from __future__ import annotations

from typing import Any


from ...calibrate import LayerRecipe
from ...calibrate.thresholds import AdaptiveThresholds
from ...rope import KeyRotation
from ..base import CompressedCache, memory_stats
from ..budget import RatioBudget
from .options import TIERS, TieredQuantOptions, KIVIOptions, needs_rope
from .layer import KIVILayer, TieredQuantLayer


class TieredQuantCache(AdaptiveThresholds, CompressedCache):
    """Hot tail + 4-bit warm + 2-bit archive (KIVI codes, or a subspace basis where calibration finds it better).
    `TieredQuantCache(config=model.config, tail_length=64)`.

    Quality: `quality_metrics()` (online proxy), `adapt_thresholds(feedback)` / `save_thresholds` /
    `load_thresholds` (`hf_kvcache.calibrate.thresholds`: the hot boundary and archive width, adapted from measured
    quality between sequences)."""

    options_class = TieredQuantOptions
    layer_class = TieredQuantLayer
    reads_fused = True  # generate binds it to the model and runs the fused attention over its codes

    def __init__(self, config=None, **options: Any) -> None:
        if self.options_class is TieredQuantOptions:
            options = _default_candidates(config, options)
        super().__init__(config, **options)
        tiered = [la for la in self.layers if isinstance(la, TieredQuantLayer)]
        if any(la.is_sliding for la in tiered):  # the full layers of a hybrid model take `hybrid_full`
            for layer in tiered:
                if not layer.is_sliding:
                    layer.in_hybrid = True
                    layer.replan(self.options)
        recipes = getattr(self.options, "recipes", None)
        if recipes is not None:
            if len(recipes) != len(self.layers):
                raise ValueError(f"recipes has {len(recipes)} entries, the model has {len(self.layers)} layers; pass "
                                 "the list cache.recipes() returned for this model")
            for layer, r in zip(self.layers, recipes):
                if r is not None and isinstance(layer, TieredQuantLayer):
                    layer.recipe = LayerRecipe.from_dict(r)
        chosen = [la.recipe.archive_format for la in self.layers if getattr(la, "recipe", None) is not None]
        if config is not None and isinstance(self.options, TieredQuantOptions) and needs_rope(self.options, chosen):
            instead = "archive_quantizer='kivi'" + (
                " or subspace_prerope=False" if self.options.archive_quantizer == "subspace" else "")
            # one RoPE object per layer type: the kernels reuse one angle table across the layers of a step
            for layer, rope in self._layer_ropes(config, _rope_user(self.options), instead, "undoes RoPE",
                                                 (TieredQuantLayer,)):
                layer.rope = rope
        target, least = getattr(self.options, "target_ratio", None), getattr(self.options, "min_ratio", None)
        budget = None if target is None else RatioBudget(target, self.layers)
        cap = None if least is None else RatioBudget(least, self.layers)
        for layer in self.layers:
            if isinstance(layer, TieredQuantLayer):
                layer.budget, layer.ratio_floor = budget, cap

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


def _default_candidates(config: Any, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with `archive_candidates="auto"` (the default) turned off where the model's RoPE cannot be read
    (no config, or a model without full-head RoPE): a pre-RoPE subspace candidate needs it, so such a cache keeps
    KIVI archives, as with `archive_candidates=None`."""
    if options.get("archive_candidates", "auto") != "auto":
        return options
    if config is not None:
        text = config.get_text_config(decoder=True)
        try:
            for layer_type in set(getattr(text, "layer_types", None) or [None]):
                KeyRotation.from_config(config, layer_type=layer_type)
            return options
        except ValueError:
            pass
    return {**options, "archive_candidates": None}


def _rope_user(options: TieredQuantOptions) -> str:
    """The options that make a tiered cache undo RoPE, as an error message names them."""
    user = f"archive_quantizer={options.archive_quantizer!r}"
    if options.archive_candidates:
        user += f" with archive_candidates={options.archive_candidates!r}"
    return user + (" with the archive formats of recipes" if options.recipes else "")
