"""`AdaptiveThresholds`: the mixin a cache class takes to adapt, save and load its own thresholds."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from .rule import ADR_RULE, AdaptRule, AdaptState, adapt
from .store import ThresholdStore, _check_key, load_thresholds_file, save_thresholds_file, select_thresholds
from .values import Bounds, Feedback, FeedbackLike, Thresholds


# ---- the cache mixin ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdaptStep:
    """One `adapt_thresholds` call: the feedback, its verdict, and the thresholds before and after."""

    feedback: Feedback
    before: Thresholds
    after: Thresholds

    @property
    def verdict(self) -> str:
        return self.feedback.verdict

    def to_dict(self) -> dict[str, Any]:
        return {"feedback": self.feedback.to_dict(), "before": self.before.to_dict(), "after": self.after.to_dict()}


class AdaptiveThresholds:
    """Mixin for a `CompressedCache` whose `options` carry the two thresholds (`TieredQuantCache`; `threshold_fields`
    names the option fields, e.g. `("residual_length", "bits")` for `KIVICache`) and whose layers replan
    (`CompressedCache.replace_options`: the cache hands new options to its layers, this mixin only chooses them).

    New thresholds take effect from the next sequence: a layer that holds tokens keeps its stored tiers as they are
    and switches at `cache.reset()` (an empty layer switches at once)."""

    threshold_fields: tuple[str, str] = ("tail_length", "archive_bits")
    adapt_rule: AdaptRule = AdaptRule()
    adapt_bounds: Bounds | None = None  # None: `Bounds()` with the boundary in steps of the cache's group size

    # state lives in the instance dict, created on first use, so the mixin needs no __init__
    @property
    def adapt_state(self) -> AdaptState:
        return self.__dict__.setdefault("_adapt_state", AdaptState())

    @property
    def history(self) -> list[AdaptStep]:
        """Every adaptation step of this cache, oldest first."""
        return self.__dict__.setdefault("_adapt_history", [])

    def threshold_bounds(self) -> Bounds:
        """`adapt_bounds` when set (on the class or the instance), else the default bounds with the boundary in
        steps of the cache's group size."""
        if self.adapt_bounds is not None:
            return self.adapt_bounds
        return Bounds(tail_step=getattr(self.options, "group_size", None) or Bounds.tail_step)

    def thresholds(self) -> Thresholds:
        tail_field, bits_field = self.threshold_fields
        return Thresholds(getattr(self.options, tail_field), getattr(self.options, bits_field))

    def adapt_thresholds(self, feedback: FeedbackLike) -> Thresholds:
        """Move the thresholds by the quality `feedback` of a sample run with the current ones (`adapt`); returns
        the new thresholds, in effect from the next sequence (`cache.reset()`)."""
        fb = Feedback.coerce(feedback)
        before = self.thresholds()
        after = adapt(before, fb, rule=self.adapt_rule, bounds=self.threshold_bounds(), state=self.adapt_state)
        self.set_thresholds(after, reset_state=False)
        self.history.append(AdaptStep(fb, before, after))
        return after

    def set_thresholds(self, thresholds: Thresholds, reset_state: bool = True) -> None:
        """Run with `thresholds` from the next sequence on (new options, validated, handed to every layer).
        `reset_state`: forget the adaptation memory (a new starting point)."""
        if not isinstance(thresholds, Thresholds):
            raise ValueError(f"set Thresholds, got {type(thresholds).__name__}")
        tail_field, bits_field = self.threshold_fields
        self.replace_options(dataclasses.replace(self.options, **{tail_field: thresholds.tail_length,
                                                                  bits_field: thresholds.archive_bits}))
        if reset_state:
            self.__dict__["_adapt_state"] = AdaptState()

    def save_thresholds(self, path: str | os.PathLike, model_id: str | None = None,
                        context_length: int | None = None) -> Thresholds:
        """Save the current thresholds: alone (no model_id / context_length), or as the (model_id, context_length)
        entry of the store at `path` (created, or updated when it exists). Returns them."""
        th = self.thresholds()
        if model_id is None and context_length is None:
            save_thresholds_file(path, th)
            return th
        if model_id is None or context_length is None:
            raise ValueError("a store entry needs both model_id and context_length; pass neither to save the "
                             "thresholds alone")
        _check_key(model_id, context_length)
        store = ThresholdStore()
        if os.path.exists(path):
            found = load_thresholds_file(path)
            if not isinstance(found, ThresholdStore):
                raise ValueError(f"{os.fspath(path)} holds one Thresholds, not a store; save the entry to another "
                                 "path, or delete the file first")
            store = found
        store.put(model_id, context_length, th)
        store.save(path)
        return th

    def load_thresholds(self, path: str | os.PathLike, model_id: str | None = None,
                        context_length: int | None = None) -> Thresholds:
        """Run with the thresholds of a file from the next sequence on: its only entry, or a store's nearest entry
        for `model_id` and `context_length`. The adaptation memory starts afresh. Returns them."""
        th = select_thresholds(load_thresholds_file(path), model_id, context_length, where=os.fspath(path))
        self.set_thresholds(th)
        return th


__all__ = [
    "ADR_RULE",
    "AdaptRule",
    "AdaptState",
    "AdaptStep",
    "AdaptiveThresholds",
    "Bounds",
    "Feedback",
    "ThresholdStore",
    "Thresholds",
    "adapt",
    "load_thresholds_file",
    "save_thresholds_file",
    "select_thresholds",
]
