"""The evicting cache's former module: `H2OCache` and its parts now live in `hf_kvcache.caches.evict`."""

from .evict import EvictOptions, H2OCache, H2OLayer, H2OOptions

__all__ = ["EvictOptions", "H2OCache", "H2OLayer", "H2OOptions"]
