"""CPACCache: cross-page adaptive compression (base pages + quantized deltas, memory-pressure adaptive).

The method of "CPAC: Cross-Page Adaptive Compression", built as the paper describes it, with the choices the paper
leaves open made explicit as options:

- Each layer cuts the tokens of every (batch row, KV head) into pages of `page_size` tokens. A page is compressed
  once it is full and older than the `recent_pages` newest full pages; newer tokens (the "tail") stay in
  `full_dtype` (fp16 by default, the precision the compression ratio is measured against).
- A page is compared with the *base pages* of its (layer, batch row, KV head) by the cosine of its features (see
  `hf_kvcache.caches.cpac.features`) times `1 - |imp_a - imp_b|`, importance coming from the attention mass the
  pages received. If the best base is similar enough (threshold set by memory pressure), the page is stored as a
  delta against it, quantized to `delta_bits` with one fp16 scale per page (`delta_scale="page"`, or per token /
  per channel); otherwise it becomes a new base (full precision) or, when `max_bases` bases exist already, stays
  raw (full precision, not used as a base). Pages whose importance reaches `protect_importance` (relative to the
  most attended page of the same row and head) stay raw: never a delta, nor a base.
- Memory pressure = bytes held by all CPAC layers of the cache / `memory_budget` (bytes when an int, a fraction
  of the fp16 size of the tokens seen when a float), or a fixed `pressure` given by the caller. The similarity
  threshold follows it: `thresholds[i]` while pressure < `pressure_levels[i]`, the last threshold above (defaults
  0.95 / 0.85 / 0.70 at < 0.6 / < 0.8 / above).
- `update` returns decompressed keys and values (decompression on demand, every page rebuilt from its base and
  delta), so the cache works with any attention implementation.

Importance. With `attn_implementation="hf_kvcache"` the attention function reports, after each update, the
attention every held key received (`observe_attention`); a page's importance is the mean attention per query that
looked at it, divided by the largest such value among the pages of its row and head. Compression of pages that
became eligible in an update then waits for that report, so they are ranked by attention that includes their own
chunk. With any other attention implementation no mass arrives: the layer notices at its next update (one logged
note per cache), compresses from then on right in `update`, and every page's importance is 0 (uniform fallback:
the weight `1 - |imp_a - imp_b|` is 1 and no page is protected by importance; recent pages still are).

Storage of one layer (`CPACLayer`): a `PagePool` per stream, `pools["k"]` and `pools["v"]` (`pool.py`: the recent
tail, a pool of full pages, a pool of quantized deltas, and each (row, head, page)'s slot and mode), plus `imp_mass`
[batch, heads, all pages] fp32 and `imp_obs` [all pages] fp32 (attention received, queries that saw it), and
`query_mass` [batch, heads, w, pages] fp32: the attention each of the last `w <= crop_window` queries of the last
forward gave each page (the reported mass for one query, recomputed per query for several), from which `crop` takes
what the cropped queries added out of the importance, so the cropped cache goes on as the one that never saw them
(after a crop reaching before the last forward, the storage is cropped and the next forward raises a ValueError).
Pools are
shared by batch rows: beam reordering and `batch_repeat_interleave` remap slots and never copy a page. Every figure
of `memory_stats` is a sum of `nbytes`.

Modules: `options` (CPACOptions), `features` (page features, similarity, thresholds), `delta` (the delta codec),
`pool` (PagePool), `layer` (CPACLayer and the shared memory budget), `cache` (CPACCache).
"""

from .cache import CPACCache
from .delta import decode_delta, encode_delta
from .layer import CPACLayer
from .options import CPACOptions
from .pool import BASE, DELTA, RAW, PagePool

__all__ = ["BASE", "DELTA", "RAW", "CPACCache", "CPACLayer", "CPACOptions", "PagePool", "decode_delta", "encode_delta"]
