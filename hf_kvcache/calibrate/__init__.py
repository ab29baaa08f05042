"""Calibration: per-layer recipe choice from the layer's own keys, values and queries."""

from .recipe import ROTATION_CANDIDATES, LayerRecipe, attention_error, choose_archive_bits, choose_recipe

__all__ = ["ROTATION_CANDIDATES", "LayerRecipe", "attention_error", "choose_archive_bits", "choose_recipe"]

from .thresholds import (
    ADR_RULE, AdaptiveThresholds, AdaptRule, AdaptState, AdaptStep, Bounds, Feedback, Thresholds, ThresholdStore, adapt,
    load_thresholds_file, save_thresholds_file, select_thresholds,
)

__all__ += [
    "ADR_RULE", "AdaptiveThresholds", "AdaptRule", "AdaptState", "AdaptStep", "Bounds", "Feedback", "Thresholds",
    "ThresholdStore", "adapt", "load_thresholds_file", "save_thresholds_file", "select_thresholds",
]
