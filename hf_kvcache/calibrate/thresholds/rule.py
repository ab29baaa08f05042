"""The adaptation rule: `adapt` moves `Thresholds` by one `Feedback` (`AdaptRule`, `ADR_RULE`, `AdaptState`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .values import Bounds, Feedback, FeedbackLike, Thresholds, _is_int, _is_number


# ---- the rule -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdaptRule:
    """How `adapt` moves thresholds (see the module docstring): `grow` / `shrink` factors of the hot boundary, the
    number of same-direction signals a width collects before it moves (`patience`), and whether failed moves leave
    floors behind (`ratchet`). `ADR_RULE` is the literal rule (both knobs every signal, no memory)."""

    grow: float = 1.2
    shrink: float = 0.9
    patience: int = 3
    ratchet: bool = True

    def __post_init__(self) -> None:
        if not _is_number(self.grow) or not self.grow > 1:
            raise ValueError(f"grow must be a factor > 1 (the ADR's 1.2), got {self.grow!r}")
        if not _is_number(self.shrink) or not 0 < self.shrink < 1:
            raise ValueError(f"shrink must be a factor in (0, 1) (the ADR's 0.9), got {self.shrink!r}")
        if not _is_int(self.patience) or self.patience < 1:
            raise ValueError(f"patience must be a positive integer (1: bits move on every signal), got {self.patience!r}")
        if not isinstance(self.ratchet, bool):
            raise ValueError(f"ratchet must be True or False, got {self.ratchet!r}")


ADR_RULE = AdaptRule(patience=1, ratchet=False)


@dataclass
class AdaptState:
    """What the default rule remembers between samples (pass the same object to every `adapt` call of one run).

    - degraded: degraded samples since the width was last set
    - good: good-with-margin samples since then and since the last degraded one
    - min_bits: the ratchet on the width (None: no floor yet)
    - tail_floor: the ratchet on the boundary at the current width (None: no floor yet)
    - last_tail_move / last_bits_move: the sign of the last move of each knob (0: none yet); the boundary's is
      forgotten when the width changes
    """

    degraded: int = 0
    good: int = 0
    min_bits: int | None = None
    tail_floor: int | None = None
    last_tail_move: int = 0
    last_bits_move: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def adapt(
    thresholds: Thresholds,
    feedback: FeedbackLike,
    *,
    rule: AdaptRule | None = None,
    bounds: Bounds | None = None,
    state: AdaptState | None = None,
) -> Thresholds:
    """The thresholds to run the next sample with, given the feedback of a sample run with `thresholds`.

    `feedback`: a `Feedback` or a bare relative perplexity delta (target 0.03, margin 0.5). `state` is updated in
    place; without one every call starts from a fresh state, so with the default `patience` only the boundary moves
    (pass `rule=ADR_RULE` for the memoryless literal rule: both knobs on every signal). The result is always within `bounds` (default `Bounds()`),
    even when `thresholds` was not."""
    fb = Feedback.coerce(feedback)
    rule = rule if rule is not None else AdaptRule()
    bounds = bounds if bounds is not None else Bounds()
    st = state if state is not None else AdaptState()
    th = bounds.clamp(thresholds)
    s = fb.signal
    if s == 0:
        return th
    if s > 0:
        st.degraded += 1
        st.good = 0  # quality first: a degradation erases the evidence for taking memory away
    else:
        st.good += 1
    tail, bits = th.tail_length, th.archive_bits

    # the boundary moves on every signal
    if s > 0:
        new_tail = bounds.grow_tail(tail, rule.grow)
        # it shrank to a length that degraded, or the floor itself degraded: never below the new length again
        if rule.ratchet and (st.last_tail_move < 0 or tail == st.tail_floor):
            st.tail_floor = new_tail
    else:
        new_tail = bounds.shrink_tail(tail, rule.shrink)
        if rule.ratchet and st.tail_floor is not None:
            new_tail = max(new_tail, min(st.tail_floor, tail))
    if new_tail != tail:
        st.last_tail_move = s

    # the width once the current one has collected `patience` signals in one direction
    new_bits = bits
    if (st.degraded if s > 0 else st.good) >= rule.patience:
        cand = bounds.step_bits(bits, s)
        if s < 0 and rule.ratchet and st.min_bits is not None and cand < st.min_bits:
            cand = bits
        if cand != bits:
            if s > 0 and rule.ratchet:  # the width it leaves failed `patience` times: never again
                st.min_bits = cand
            st.last_bits_move = s
            new_bits = cand
            st.degraded = st.good = 0
            st.tail_floor, st.last_tail_move = None, 0
    return Thresholds(new_tail, new_bits)
