"""The thresholds the adaptation moves (`Thresholds`), their `Bounds`, and the quality `Feedback` that moves them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Union

DEGRADED, GOOD, HOLD = "degraded", "good-with-margin", "within-target"
_SIGNALS = {DEGRADED: 1, GOOD: -1, HOLD: 0}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ---- thresholds and their bounds ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Thresholds:
    """The tiered cache's two adaptive knobs: `tail_length` (the hot boundary: newest tokens kept at full precision)
    and `archive_bits` (code width of the archive tier). Values the cache accepts: tail_length >= 0, bits in 1..8;
    `Bounds` narrows them for adaptation."""

    tail_length: int = 64
    archive_bits: int = 2

    def __post_init__(self) -> None:
        if not _is_int(self.tail_length) or self.tail_length < 0:
            raise ValueError(f"tail_length must be a non-negative integer (tokens kept at full precision), "
                             f"got {self.tail_length!r}")
        if not _is_int(self.archive_bits) or not 1 <= self.archive_bits <= 8:
            raise ValueError(f"archive_bits must be an integer in 1..8 (e.g. 2, 3 or 4), got {self.archive_bits!r}")

    def to_dict(self) -> dict[str, int]:
        return {"tail_length": self.tail_length, "archive_bits": self.archive_bits}

    @classmethod
    def from_dict(cls, d: Any) -> "Thresholds":
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(d, Mapping):
            raise ValueError(f"thresholds must be a JSON object with keys {names}, got {type(d).__name__}")
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown threshold field(s) {unknown}; thresholds have exactly {names}")
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"thresholds lack {missing}; write both, e.g. "
                             '{"tail_length": 64, "archive_bits": 2}')
        return cls(**d)


@dataclass(frozen=True)
class Bounds:
    """Where adaptation may take thresholds: `min_tail <= tail_length <= max_tail`, the tail a multiple of `tail_step`
    (the cache's group size: tokens leave the tail in whole groups) or a bound itself, and `archive_bits` one of
    `bits` (ascending)."""

    min_tail: int = 16
    max_tail: int = 1024
    tail_step: int = 32
    bits: tuple[int, ...] = (2, 3, 4)

    def __post_init__(self) -> None:
        if not (_is_int(self.min_tail) and _is_int(self.max_tail) and 0 <= self.min_tail <= self.max_tail):
            raise ValueError(f"need integers 0 <= min_tail <= max_tail, got min_tail={self.min_tail!r}, "
                             f"max_tail={self.max_tail!r}")
        if not _is_int(self.tail_step) or self.tail_step <= 0:
            raise ValueError(f"tail_step must be a positive integer (the cache's group_size), got {self.tail_step!r}")
        bits = tuple(self.bits) if isinstance(self.bits, (list, tuple)) else None
        if not bits or any(not _is_int(b) or not 1 <= b <= 8 for b in bits) or list(bits) != sorted(set(bits)):
            raise ValueError(f"bits must be distinct ascending integers in 1..8, e.g. (2, 3, 4); got {self.bits!r}")
        object.__setattr__(self, "bits", bits)

    def clamp_tail(self, tail: int) -> int:
        """`tail` in [min_tail, max_tail], rounded up to a multiple of `tail_step` (the safe side) unless it is a
        bound."""
        if tail <= self.min_tail:
            return self.min_tail
        return min(-(-tail // self.tail_step) * self.tail_step, self.max_tail)

    def clamp_bits(self, bits: int) -> int:
        """`bits` if allowed, else the nearest allowed width above it (the safe side), else the widest."""
        return next((b for b in self.bits if b >= bits), self.bits[-1])

    def clamp(self, th: Thresholds) -> Thresholds:
        return Thresholds(self.clamp_tail(th.tail_length), self.clamp_bits(th.archive_bits))

    def contains(self, th: Thresholds) -> bool:
        t = th.tail_length
        return (self.min_tail <= t <= self.max_tail and (t % self.tail_step == 0 or t in (self.min_tail, self.max_tail))
                and th.archive_bits in self.bits)

    def grow_tail(self, tail: int, factor: float) -> int:
        """`tail * factor` rounded up to a multiple of `tail_step`, at least one step more, clamped."""
        s = self.tail_step
        new = math.ceil(tail * factor / s - 1e-9) * s
        if new <= tail:
            new = (tail // s + 1) * s
        return self.clamp_tail(new)

    def shrink_tail(self, tail: int, factor: float) -> int:
        """`tail * factor` rounded down to a multiple of `tail_step`, at least one step less, clamped."""
        s = self.tail_step
        new = math.floor(tail * factor / s + 1e-9) * s
        if new >= tail:
            new = (tail - 1) // s * s
        return self.clamp_tail(new)

    def step_bits(self, bits: int, direction: int) -> int:
        """The next allowed width above (`direction` > 0) or below `bits`; `bits` itself at the end of the range."""
        if direction > 0:
            return next((b for b in self.bits if b > bits), bits)
        return next((b for b in reversed(self.bits) if b < bits), bits)


# ---- feedback -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Feedback:
    """One quality measurement of a sample run with the current thresholds.

    - delta: relative perplexity change against an uncompressed cache on the same tokens, `ppl / ppl_ref - 1`
      (a fraction: 0.03 is +3 %; negative when the compressed run scored better)
    - target: the largest acceptable delta (default 0.03)
    - margin: "good with margin" means `delta < target * margin` (default 0.5: under half the target)
    """

    delta: float
    target: float = 0.03
    margin: float = 0.5

    def __post_init__(self) -> None:
        if not _is_number(self.delta) or not math.isfinite(self.delta):
            raise ValueError(f"delta must be a finite number (ppl / ppl_ref - 1, e.g. 0.012 for +1.2 %), "
                             f"got {self.delta!r}; a NaN or inf perplexity means the measurement itself failed")
        if not _is_number(self.target) or not self.target > 0:
            raise ValueError(f"target must be a positive fraction (0.03 for 3 %), got {self.target!r}")
        if not _is_number(self.margin) or not 0 <= self.margin < 1:
            raise ValueError(f"margin must be a number in [0, 1) (0.5: good when under half the target), "
                             f"got {self.margin!r}")
        object.__setattr__(self, "delta", float(self.delta))

    @classmethod
    def from_perplexity(cls, perplexity: float, reference: float, **kw: Any) -> "Feedback":
        """Feedback from a compressed run's perplexity and the uncompressed reference on the same tokens."""
        if not _is_number(reference) or not reference > 0:
            raise ValueError(f"reference perplexity must be positive, got {reference!r}")
        return cls(perplexity / reference - 1.0, **kw)

    @classmethod
    def coerce(cls, feedback: "Feedback | float") -> "Feedback":
        """A `Feedback` as is; a bare number as the delta with the default target and margin."""
        if isinstance(feedback, Feedback):
            return feedback
        if _is_number(feedback):
            return cls(float(feedback))
        raise ValueError(f"feedback must be a Feedback or a relative perplexity delta (a float such as 0.012), "
                         f"got {type(feedback).__name__}")

    @property
    def verdict(self) -> str:
        """"degraded", "good-with-margin" or "within-target"."""
        if self.delta > self.target:
            return DEGRADED
        if self.delta < self.target * self.margin:
            return GOOD
        return HOLD

    @property
    def signal(self) -> int:
        """+1 degraded (more memory), -1 good with margin (less memory), 0 within target."""
        return _SIGNALS[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        return {"delta": self.delta, "target": self.target, "margin": self.margin, "verdict": self.verdict}


FeedbackLike = Union[Feedback, float]
