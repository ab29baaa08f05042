"""Tiered KIVI caches: a full-precision hot tail, a 4-bit warm tier, a 2-bit archive, and full-precision sinks.

Positions of one layer, oldest first::

    archive (archive_bits) [0, a) | warm (warm_bits) [a, a + w) | tail (full precision) [a + w, n)
    + sinks: a full-precision copy of positions [0, sink_length), laid over whatever tier holds them

New tokens enter the tail. Whenever the tail holds at least `tail_length + group_size` tokens, its oldest whole groups
of `group_size` tokens are quantized (from full precision) into the warm tier; whenever the warm tier holds at least
`warm_length + archive_group_size` tokens, its oldest `archive_group_size` groups are re-quantized at `archive_bits`
into the archive. So the newest `tail_length` tokens are always exact, at least the next `warm_length` are at
`warm_bits`, the rest at `archive_bits`, and every token is quantized once per tier change: appending quantizes only
the groups that move and never touches the tiers already stored (transformers' `QuantizedLayer` re-quantizes its whole
cache at every flush). Group boundaries are at fixed positions (multiples of the group size from position 0), so the
sinks do not shift them: the sink positions are stored in full precision and, inside their quantization group, replaced
by a neighbour's values so that they do not stretch the group's range.

Quantization is KIVI's (`hf_kvcache.quant.kivi`): keys per channel over groups of tokens, values per token over groups
of channels, asymmetric min/max with fp16 scale and zero, codes bit-packed. Options add a randomized Hadamard rotation
of the head dimension before quantizing (undone when dequantizing), clipping, and per-token keys (the ablation of
KIVI's per-channel keys). The defaults are the measured best recipe (`hf-kvcache compare --suite ablations`).

The archive may use another format (`archive_quantizer`): each is one class of `caches.archive` (KIVI, KVQuant's
nuq codes, codes in a fitted subspace basis), and "adaptive" picks one per archive group by position, the archive
then being a `SegmentedTier` of per-format segments.

`KIVICache` is the classic two-tier form: a full-precision residual window and one quantized tier.
"""

from .cache import KIVICache, TieredQuantCache
from .calibration import TierCalibration
from .layer import KIVILayer, TieredQuantLayer
from .options import (
    CALIBRATION_GROUPS,
    CLIP_TARGETS,
    LONG_CONTEXT,
    QUANTIZERS,
    RETRIEVAL,
    ROTATION_DTYPES,
    ROTATIONS,
    SLIDING_DEFAULT,
    SLIDING_FIELDS,
    HYBRID_FULL_FIELDS,
    TAIL_DTYPES,
    TIERS,
    KIVIOptions,
    TieredQuantOptions,
    largest_divisor,
    needs_rope,
)

__all__ = [
    "CALIBRATION_GROUPS", "CLIP_TARGETS", "LONG_CONTEXT", "QUANTIZERS", "RETRIEVAL", "ROTATION_DTYPES", "ROTATIONS",
    "SLIDING_DEFAULT", "SLIDING_FIELDS", "HYBRID_FULL_FIELDS", "TAIL_DTYPES", "TIERS", "KIVICache", "KIVILayer",
    "KIVIOptions",
    "TierCalibration", "TieredQuantCache", "TieredQuantLayer", "TieredQuantOptions", "largest_divisor", "needs_rope",
]
