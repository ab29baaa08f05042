"""Cache containers and their layer classes, one storage policy per module."""

from .base import CompressedCache, CompressedLayer, memory_stats
from .cpac import CPACCache, CPACLayer, CPACOptions
from .evict import EvictOptions, H2OCache, H2OLayer, H2OOptions
from .tiered import KIVICache, KIVILayer, KIVIOptions, TieredQuantCache, TieredQuantLayer, TieredQuantOptions
from .uniform import UniformQuantCache, UniformQuantLayer, UniformQuantOptions

__all__ = [
    "CPACCache",
    "CPACLayer",
    "CPACOptions",
    "CompressedCache",
    "EvictOptions",
    "H2OCache",
    "H2OLayer",
    "H2OOptions",
    "CompressedLayer",
    "memory_stats",
    "UniformQuantCache",
    "UniformQuantLayer",
    "UniformQuantOptions",
    "TieredQuantCache",
    "TieredQuantLayer",
    "TieredQuantOptions",
    "KIVICache",
    "KIVILayer",
    "KIVIOptions",
]
