"""Option groups several policies share, each a dataclass that declares its fields and checks them.

A policy subclasses the groups whose options it takes (and only those: a policy that does not declare an option
rejects it, with the policies that take it named, `policy.policy_from_options`):

- `RecentWindow`: `recent_length` / `recent_ratio` (a fraction of the budget): the recent window kept.
- `ScoredPolicy`: + `heavy_length` / `heavy_ratio`: the part ranked by the score (the window is what it leaves).
  At most one of the four is given; default: the policy's `default_recent_share` of what the sinks leave.
- `AttentionPolicy`: ranks by attention (received or expected); `value_norm` multiplies each token's priority by
  the norm of its value (the size of what it adds to the output when attended; Expected Attention's weighting).
- `RingPolicy`: reads the attention of a ring of recent queries; `output_error` ranks each token by how far the
  attention output of those queries would move without it, `p / (1 - p) * |v - o|` per query head
  (`attention.removal_error`, CAOTE), instead of by its attention; it replaces `value_norm`.
- `MassPolicy`: accumulates the attention mass each token receives; `decay` in (0, 1] fades it per query,
  `crop_window` (default 32) queries are kept while nothing was evicted so that `crop` can take out what they gave
  (0: none; the next forward after a crop then raises).
- `WithSinks`: `sink_length` (default 4) first real tokens always kept.
- `ObservationWindow`: `window` (default 32) recent queries whose attention (or statistics) the policy reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..options import check_bool, check_int, check_number, check_positive_int
from .base import DEFAULT_CROP_WINDOW, EvictionPolicy, _round

DEFAULT_WINDOW = 32
DEFAULT_SINK_LENGTH = 4


@dataclass(kw_only=True)
class RecentWindow(EvictionPolicy):
    """`recent_length` tokens or `recent_ratio` of the budget kept as the recent window."""

    split_options: ClassVar[tuple[str, ...]] = ("recent_length", "recent_ratio")
    recent_length: int | None = None
    recent_ratio: float | None = None

    def validate(self) -> None:
        super().validate()
        for name in self.split_options:
            value = getattr(self, name)
            if name.endswith("length"):
                check_int(name, value, lo=0, allow_none=True)
            else:
                check_number(name, value, 0.0, 1.0, allow_none=True)
        given = self.split_given()
        if len(given) > 1:
            raise ValueError(
                f"give at most one of {list(self.split_options)} (got {given}): the heavy part is what the sinks and "
                "the recent window leave of the budget"
            )

    def split_given(self) -> list[str]:
        """The split options set (at most one)."""
        return [n for n in self.split_options if getattr(self, n) is not None]

    def recent_tokens(self, budget: int, rest: int) -> int:
        if self.recent_length is not None:
            return self.recent_length
        if self.recent_ratio is not None:
            return _round(self.recent_ratio * budget)
        return super().recent_tokens(budget, rest)


@dataclass(kw_only=True)
class ScoredPolicy(RecentWindow):
    """A recent window plus a part ranked by a score: `heavy_length` tokens or `heavy_ratio` of the budget."""

    needs_scores: ClassVar[bool] = True
    split_options: ClassVar[tuple[str, ...]] = ("recent_length", "recent_ratio", "heavy_length", "heavy_ratio")
    heavy_length: int | None = None
    heavy_ratio: float | None = None

    def recent_tokens(self, budget: int, rest: int) -> int:
        if self.heavy_length is not None:
            return rest - self.heavy_length
        if self.heavy_ratio is not None:
            return rest - _round(self.heavy_ratio * budget)
        return super().recent_tokens(budget, rest)


@dataclass(kw_only=True)
class AttentionPolicy(ScoredPolicy):
    """Ranks by attention; `value_norm` (default `default_value_norm`) weighs it by the norm of each value."""

    ranks_by_attention: ClassVar[bool] = True
    default_value_norm: ClassVar[bool] = False
    value_norm: bool | None = None

    def validate(self) -> None:
        super().validate()
        if self.value_norm is not None:
            check_bool("value_norm", self.value_norm)

    @property
    def value_weighted(self) -> bool:
        if self.by_output_error:
            return False
        return self.default_value_norm if self.value_norm is None else self.value_norm


@dataclass(kw_only=True)
class RingPolicy(AttentionPolicy):
    """Reads the attention of a ring of recent queries; `output_error` ranks by each token's removal error."""

    output_error: bool = False

    def validate(self) -> None:
        super().validate()
        check_bool("output_error", self.output_error)
        if self.output_error and self.value_norm:
            raise ValueError("output_error already weighs each token by its value (how far the output moves without "
                             "it); leave value_norm unset with it")

    @property
    def by_output_error(self) -> bool:
        return self.output_error


@dataclass(kw_only=True)
class MassPolicy(AttentionPolicy):
    """Accumulates the attention mass each token receives; `decay` fades it, `crop_window` queries undo a crop."""

    decay: float | None = None
    crop_window: int | None = None

    def validate(self) -> None:
        super().validate()
        check_number("decay", self.decay, 0.0, 1.0, lo_open=True, allow_none=True, hint=" (the fading per query)")
        check_int("crop_window", self.crop_window, lo=0, allow_none=True,
                  hint=" (queries kept so that crop can undo them)")

    @property
    def uses_mass(self) -> bool:
        return True

    @property
    def mass_decay(self) -> float | None:
        return self.decay if self.decay is not None and self.decay < 1 else None

    @property
    def crop_queries(self) -> int:
        return DEFAULT_CROP_WINDOW if self.crop_window is None else self.crop_window


@dataclass(kw_only=True)
class WithSinks(EvictionPolicy):
    """The first `sink_length` real tokens always kept."""

    sink_length: int = DEFAULT_SINK_LENGTH

    def validate(self) -> None:
        super().validate()
        check_int("sink_length", self.sink_length, lo=0)

    @property
    def sink_count(self) -> int:
        return self.sink_length


@dataclass(kw_only=True)
class ObservationWindow(EvictionPolicy):
    """Reads the last `window` queries."""

    window: int = DEFAULT_WINDOW

    def validate(self) -> None:
        super().validate()
        check_positive_int("window", self.window)

    def query_window(self) -> int:
        return self.window
