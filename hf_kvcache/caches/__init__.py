"""Cache containers and their layer classes, one storage policy per module."""

from .base import CompressedCache, CompressedLayer, memory_stats
from .uniform import UniformQuantCache, UniformQuantLayer, UniformQuantOptions

__all__ = [
    "CompressedCache",
    "CompressedLayer",
    "memory_stats",
    "UniformQuantCache",
    "UniformQuantLayer",
    "UniformQuantOptions",
]
