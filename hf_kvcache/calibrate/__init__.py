"""Calibration: per-layer recipe choice from the layer's own keys, values and queries."""

from .recipe import ROTATION_CANDIDATES, LayerRecipe, attention_error, choose_recipe

__all__ = ["ROTATION_CANDIDATES", "LayerRecipe", "attention_error", "choose_recipe"]
