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
`hf-kvcache compare --suite adapt` measures (docs/adapt/).

`ThresholdStore` keeps thresholds per (model id, context length) and returns the nearest stored context length (in
log scale) for a model; files are versioned JSON (`save_thresholds_file` / `load_thresholds_file`). `AdaptiveThresholds`
is the mixin a cache class takes to adapt, save and load its own thresholds.
"""

from .cache import AdaptiveThresholds, AdaptStep
from .rule import ADR_RULE, AdaptRule, AdaptState, adapt
from .store import ThresholdStore, load_thresholds_file, save_thresholds_file, select_thresholds
from .values import DEGRADED, GOOD, HOLD, Bounds, Feedback, Thresholds

__all__ = [
    "ADR_RULE", "DEGRADED", "GOOD", "HOLD", "AdaptiveThresholds", "AdaptRule", "AdaptState", "AdaptStep", "Bounds",
    "Feedback", "Thresholds", "ThresholdStore", "adapt", "load_thresholds_file", "save_thresholds_file",
    "select_thresholds",
]
