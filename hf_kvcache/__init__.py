"""hf-kvcache: small key/value caches for Hugging Face transformers.

Importing this package registers the cache names below with `model.generate(cache_implementation=...)`.
"""

from .caches import CompressedCache, CompressedLayer, UniformQuantCache, memory_stats
from .registry import build_cache, cache_names, fixed, install, register_cache

__version__ = "0.1.0"

register_cache("int8", fixed(UniformQuantCache, dtype="int8"))
register_cache("int4", fixed(UniformQuantCache, dtype="int4"))
register_cache("fp8", fixed(UniformQuantCache, dtype="fp8_e4m3"))
register_cache("uniform", UniformQuantCache)
install()

__all__ = [
    "CompressedCache",
    "CompressedLayer",
    "UniformQuantCache",
    "memory_stats",
    "build_cache",
    "cache_names",
    "register_cache",
]
