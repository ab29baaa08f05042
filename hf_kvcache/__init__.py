"""hf-kvcache: small key/value caches for Hugging Face transformers.

Importing this package registers the cache names below with `model.generate(cache_implementation=...)`.
"""

from .caches import (
    CPACCache,
    CompressedCache,
    CompressedLayer,
    H2OCache,
    KIVICache,
    TieredQuantCache,
    UniformQuantCache,
    memory_stats,
)
from .caches.tiered import LONG_CONTEXT, RETRIEVAL
from .paged import PagedCache
from .registry import attached, build_cache, cache_names, fixed, install, preset, register_cache
from .attention import register as _register_attention
from .attention import register_fused_kernel as _register_fused_kernel
from .attention import serve_plain_loops

__version__ = "0.1.0"

register_cache("int8", fixed(UniformQuantCache, dtype="int8"))
register_cache("int4", fixed(UniformQuantCache, dtype="int4"))
register_cache("fp8", fixed(UniformQuantCache, dtype="fp8_e4m3"))
register_cache("uniform", UniformQuantCache)
register_cache("tiered", TieredQuantCache)
register_cache("tiered_long", preset(TieredQuantCache, **LONG_CONTEXT))  # query-free, the same in any loop
register_cache("tiered_retrieval", preset(TieredQuantCache, **RETRIEVAL))  # round 13, before it became the default
register_cache("kivi", KIVICache)
register_cache("cpac", CPACCache)
register_cache("h2o", H2OCache)
register_cache("paged_quant", PagedCache)  # "paged" is transformers' (continuous batching)
_register_attention()  # attn_implementation="hf_kvcache"
_register_fused_kernel()  # ... which reads compressed segments directly where a layer exposes them
serve_plain_loops()  # sdpa models in a user's own loop: layers that ask for queries / mass are served too
install()

__all__ = [
    "CPACCache",
    "CompressedCache",
    "CompressedLayer",
    "H2OCache",
    "UniformQuantCache",
    "TieredQuantCache",
    "KIVICache",
    "LONG_CONTEXT",
    "RETRIEVAL",
    "PagedCache",
    "memory_stats",
    "attached",
    "build_cache",
    "cache_names",
    "register_cache",
    "serve_plain_loops",
]
