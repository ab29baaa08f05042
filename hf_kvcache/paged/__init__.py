"""Paged storage with shared prefixes: quantized KV in fixed-size pages of a pool (`pool`), a page table per row
(`table`), reference-counted pages shared by rows with a common prefix (`layer`, `cache`)."""

from .cache import PagedCache
from .layer import PagedLayer, PageStats
from .options import PagedOptions
from .pool import PageFormat, PagePool, QuantPages, quantize_pages
from .table import PageTable

__all__ = ["PagedCache", "PagedLayer", "PageStats", "PagedOptions", "PageFormat", "PagePool", "QuantPages",
           "quantize_pages", "PageTable"]
