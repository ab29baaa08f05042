"""`PagedCache`: quantized KV in pool pages with a page table per row; rows with a common prefix share its pages."""

from __future__ import annotations

from typing import Any

from ..caches.base import CompressedCache
from ..caches.uniform import QuantizedSlidingLayers
from .layer import PagedLayer, PageStats
from .options import PagedOptions


class PagedCache(QuantizedSlidingLayers, CompressedCache):
    """`PagedCache(config=model.config, page_size=64, bits=4, group_size=32, share=True)`, or
    `generate(cache_implementation="paged_quant", cache_config={...})` (transformers keeps
    "paged" for its continuous-batching path).

    With `num_return_sequences=n` (or `num_beams=n`), generate prefills n identical copies of the prompt; their pages
    are equal byte for byte and are stored once, so the cache holds about one quantized prompt plus n tails and n
    copies of what each row generates. Sliding-window layers (Gemma-3) hold their window per token in `sliding_dtype`
    (`QuantizedSlidingLayers`). `memory_stats()` adds `page_refs` (page-table entries, all layers), `pages`
    (distinct pages held) and `free_pages` (slots freed and not yet reused; counted in `bytes`)."""

    options_class = PagedOptions
    layer_class = PagedLayer

    def __init__(self, config: Any = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._attach_sliding_key_codecs(config)

    def sliding_dtype(self) -> str | None:
        dtype = self.options.sliding_dtype
        return ("int4" if self.options.bits <= 4 else "int8") if dtype == "auto" else dtype

    def paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def page_stats(self) -> PageStats:
        """Pages of every compressed layer together."""
        stats = [layer.page_stats() for layer in self.paged_layers()]
        return PageStats(references=sum(s.references for s in stats), pages=sum(s.pages for s in stats),
                         free=sum(s.free for s in stats), record_bytes=max((s.record_bytes for s in stats), default=0))

    def compact(self) -> None:
        """Give back the storage of freed pages (beam search and row selection free pages; their slots are reused
        by later pages but stay allocated, and counted in `bytes`, until this is called)."""
        for layer in self.paged_layers():
            layer.compact()

    def memory_stats(self) -> dict[str, Any]:
        out = super().memory_stats()
        s = self.page_stats()
        out.update(page_refs=s.references, pages=s.pages, free_pages=s.free)
        return out
