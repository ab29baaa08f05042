"""Threshold adaptation for the tiered cache (ADR-004): the hot boundary and the archive width follow quality feedback.

Two knobs of `TieredQuantCache` trade memory for quality: the hot boundary `tail_length` (newest tokens kept at full
precision) and `archive_bits` (code width of the oldest tokens). `Thresholds` holds the pair. `adapt` moves it by the
ADR's rule from one quality measurement (`Feedback`: the relative perplexity change of a sample against an
uncompressed cache, and the target it should stay under):

- "degraded" (delta > target): hot boundary x1.2 (rounded up to a multiple of `Bounds.tail_step`) and archive bits +1;
- "good with margin" (delta < target * margin, margin 0.5 by default): boundary x0.9 (rounded down) and bits -1;
- otherwise (the band [target * margin, target]) unchanged. The band itself is the first hysteresis: a sample must
  be clearly better than the target before memory is taken away.

The boundary is rounded *outward* (up when growing, down when shrinking) so that every move really moves: x0.9 of 32
rounded to the nearest multiple of 32 would be 32 again, and the rule would stall. Results are clamped to `Bounds`
(default: tail in [16, 1024], a multiple of 32 or a bound itself; archive bits in {2, 3, 4} - 3-bit codes
pack 8 codes into 3 bytes in `quant.packing` and the fused kernels read them).

Applied literally (`ADR_RULE`), both knobs move on every signal. Per-window perplexity is noisy and the archive width
is coarse (one bit is a third to a half of the archive's bytes), so the literal rule cycles: 2 bits degrade, 3 bits
are good with margin, 2 bits again, ... and never settles. The default `AdaptRule` keeps the rule's directions and
factors and adds three things, each against one cause of cycling:

1. **Boundary first, bits second** (`patience`, 3): the boundary moves on every signal; the width moves only once
   the current width has collected `patience` degraded samples (since it was set), or `patience` good-with-margin
   samples since its last degraded one. The fine knob gets the first chances to fix a degradation or to take back a
   margin; the coarse one moves when the fine one did not suffice. The evidence is asymmetric on purpose (quality
   first): a good sample does not erase earlier degradations, a degraded sample erases the good ones, and samples
   within the band count for nothing.
2. **Ratchet on the width** (`ratchet`): raising the width from `b` means `b` degraded `patience` times with the
   boundary's help; the width never again goes below `b + 1`.
3. **Ratchet on the boundary** (`ratchet`): a degraded sample right after the boundary shrank, or at its floor, makes
   the length it grows to the new floor (shrinking below it is known to degrade). The floor belongs to the current
   width and is forgotten when the width changes (with more bits a shorter boundary may be enough).

Settling: after its first raise the width only goes up, so it changes at most twice per allowed width; between width
changes the boundary floor only rises (by x1.2 at least each time) and the boundary is bounded, so it changes finitely
often too. After the last change every sample is within the target (a degraded one would move the boundary) unless
the upper bounds are reached. Noise can only make it settle on more memory than needed (a noisy sample raises a
floor or collects a strike), never make it cycle: the rule errs on the side of quality. How fast it settles depends
on how far the start is and on the noise: per-window perplexity deltas of real text are what
`python -m hf_kvcache.eval.adapt_convergence` measures (docs/adapt/).

`ThresholdStore` keeps thresholds per (model id, context length) and returns the nearest stored context length (in
log scale) for a model; files are versioned JSON (`save_thresholds_file` / `load_thresholds_file`). `AdaptiveThresholds`
is the mixin a cache class takes to adapt, save and load its own thresholds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Union

FORMAT = "hf-kvcache-thresholds"
VERSION = 1

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


# ---- the store and files --------------------------------------------------------------------------------------------
def _check_key(model_id: Any, context_length: Any) -> None:
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string (e.g. 'smollm2-135m' or a hub id), got {model_id!r}")
    if not _is_int(context_length) or context_length <= 0:
        raise ValueError(f"context_length must be a positive integer (tokens), got {context_length!r}")


class ThresholdStore:
    """Thresholds per (model id, context length). `get` returns, for a model, the entry whose context length is
    nearest in log scale (ties: the longer context, whose thresholds are the safer ones); None for an unknown model."""

    def __init__(self, entries: Mapping[tuple[str, int], Thresholds] | None = None) -> None:
        self._entries: dict[tuple[str, int], Thresholds] = {}
        for (model_id, context_length), th in (entries or {}).items():
            self.put(model_id, context_length, th)

    def put(self, model_id: str, context_length: int, thresholds: Thresholds) -> None:
        _check_key(model_id, context_length)
        if not isinstance(thresholds, Thresholds):
            raise ValueError(f"store Thresholds objects, got {type(thresholds).__name__}")
        self._entries[(model_id, context_length)] = thresholds

    def nearest(self, model_id: str, context_length: int) -> tuple[int, Thresholds] | None:
        """(stored context length, thresholds) of the nearest entry of `model_id`, or None."""
        _check_key(model_id, context_length)
        lengths = self.context_lengths(model_id)
        if not lengths:
            return None
        x = math.log(context_length)
        best = min(lengths, key=lambda c: (round(abs(math.log(c) - x), 9), -c))
        return best, self._entries[(model_id, best)]

    def get(self, model_id: str, context_length: int) -> Thresholds | None:
        found = self.nearest(model_id, context_length)
        return None if found is None else found[1]

    def models(self) -> list[str]:
        return sorted({m for m, _ in self._entries})

    def context_lengths(self, model_id: str) -> list[int]:
        return sorted(c for m, c in self._entries if m == model_id)

    def items(self) -> Iterator[tuple[tuple[str, int], Thresholds]]:
        return iter(sorted(self._entries.items()))

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ThresholdStore) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"ThresholdStore({dict(self.items())!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "store": [
            {"model_id": m, "context_length": c, "thresholds": th.to_dict()} for (m, c), th in self.items()]}

    @classmethod
    def from_dict(cls, d: Any) -> "ThresholdStore":
        found = _from_document(d, "the document")
        if not isinstance(found, ThresholdStore):
            raise ValueError("the document holds one Thresholds, not a store; read it with load_thresholds_file")
        return found

    def save(self, path: str | os.PathLike) -> None:
        _write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ThresholdStore":
        found = load_thresholds_file(path)
        if not isinstance(found, ThresholdStore):
            raise ValueError(f"{os.fspath(path)} holds one Thresholds, not a store (no model ids or context lengths); "
                             "read it with load_thresholds_file, or save a store with ThresholdStore.save")
        return found


def _write_json(path: str | os.PathLike, doc: dict) -> None:
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)  # a reader never sees half a file


def save_thresholds_file(path: str | os.PathLike, obj: Thresholds | ThresholdStore) -> None:
    """Write one `Thresholds` or a `ThresholdStore` as versioned JSON."""
    if isinstance(obj, ThresholdStore):
        _write_json(path, obj.to_dict())
    elif isinstance(obj, Thresholds):
        _write_json(path, {"format": FORMAT, "version": VERSION, "thresholds": obj.to_dict()})
    else:
        raise ValueError(f"save a Thresholds or a ThresholdStore, got {type(obj).__name__}")


def _from_document(doc: Any, where: str) -> Thresholds | ThresholdStore:
    hint = "write it with save_thresholds / ThresholdStore.save"
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        raise ValueError(f"{where} is not an hf-kvcache thresholds file (no \"format\": \"{FORMAT}\"); {hint}")
    version = doc.get("version")
    if not _is_int(version) or version < 1:
        raise ValueError(f"{where} has no valid \"version\" (got {version!r}); {hint}")
    if version > VERSION:
        raise ValueError(f"{where} is version {version}, newer than this hf-kvcache reads ({VERSION}); upgrade "
                         "hf-kvcache")
    kinds = [k for k in ("thresholds", "store") if k in doc]
    if len(kinds) != 1:
        raise ValueError(f"{where} must hold exactly one of \"thresholds\" (one entry) or \"store\" (a list of "
                         f"entries), found {kinds or 'neither'}")
    unknown = sorted(set(doc) - {"format", "version", kinds[0]})
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}")
    try:
        if kinds[0] == "thresholds":
            return Thresholds.from_dict(doc["thresholds"])
        entries = doc["store"]
        if not isinstance(entries, list):
            raise ValueError("\"store\" must be a list of {model_id, context_length, thresholds} objects")
        store = ThresholdStore()
        for i, e in enumerate(entries):
            if not isinstance(e, Mapping) or set(e) != {"model_id", "context_length", "thresholds"}:
                raise ValueError(f"store entry {i} must be an object with exactly model_id, context_length, "
                                 f"thresholds; got {e!r}")
            if (e["model_id"], e["context_length"]) in store._entries:
                raise ValueError(f"store entry {i} repeats model {e['model_id']!r} at context length "
                                 f"{e['context_length']!r}; keep one entry per pair")
            store.put(e["model_id"], e["context_length"], Thresholds.from_dict(e["thresholds"]))
        return store
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def load_thresholds_file(path: str | os.PathLike) -> Thresholds | ThresholdStore:
    """Read a file written by `save_thresholds_file` (one `Thresholds` or a `ThresholdStore`); a bad file raises
    ValueError saying what is wrong."""
    path = os.fspath(path)
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); a thresholds "
                         "file is written by save_thresholds / ThresholdStore.save") from None
    return _from_document(doc, path)


def select_thresholds(found: Thresholds | ThresholdStore, model_id: str | None = None,
                      context_length: int | None = None, where: str = "the store") -> Thresholds:
    """One `Thresholds` out of what a file held: the file's own, or the store's nearest entry for `model_id` /
    `context_length` (each may be left out when the store leaves no choice)."""
    if isinstance(found, Thresholds):
        return found
    models = found.models()
    if model_id is None:
        if len(models) != 1:
            raise ValueError(f"{where} holds models {models}; pass model_id= to choose one")
        model_id = models[0]
    lengths = found.context_lengths(model_id)
    if not lengths:
        raise ValueError(f"{where} has no entry for model {model_id!r}; it holds {models}")
    if context_length is None:
        if len(lengths) != 1:
            raise ValueError(f"{where} holds {model_id!r} at context lengths {lengths}; pass context_length= to take "
                             "the nearest")
        context_length = lengths[0]
    return found.get(model_id, context_length)


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
    """Mixin for a cache whose `options` carry the two thresholds (`TieredQuantCache`; `threshold_fields` names the
    option fields, e.g. `("residual_length", "bits")` for `KIVICache`) and whose layers take `replan(options)`.

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
        options = dataclasses.replace(self.options, **{tail_field: thresholds.tail_length,
                                                       bits_field: thresholds.archive_bits})
        options.validate()  # replace() validated already; kept explicit for option classes without __post_init__
        self.options = options
        for layer in self.layers:
            if hasattr(layer, "replan"):
                layer.replan(options)
        rep = getattr(self, "layer_class_to_replicate", None)  # a cache built without a config makes layers lazily
        if isinstance(rep, functools.partial) and rep.args and type(rep.args[0]) is type(options):
            self.layer_class_to_replicate = functools.partial(rep.func, options, *rep.args[1:], **rep.keywords)
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
