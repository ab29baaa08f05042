"""`--suite prefill-memory`: peak memory of `generate` with a long prompt, per cache: the RSS high-water mark above
the loaded model (Linux).

    hf-kvcache compare --suite prefill-memory --tokens 8192 16384 --caches dynamic dynamic-chunked tiered kivi

Each (cache, prompt length) runs in a fresh process (`eval/isolated.py`): load the model, generate once from a short
prompt (warm-up), return freed heap to the system (`malloc_trim`), reset the kernel's high-water mark
(`/proc/self/clear_refs`), generate `--new-tokens` tokens (8) after a prompt of `--text` from `--start`, and report
`VmHWM - VmRSS before` (`peak_added_bytes`: what the run added at its peak: the cache, the prefill's activations and
anything dequantized on the way) beside the bytes the cache holds. Caches of this library prefill in chunks of their
`prefill_chunk_size` (512; `--chunk` sets it); `dynamic` prefills in one forward, as transformers does by default,
`dynamic-chunked` is DynamicCache with the same chunked prefill. `vs_dynamic` is the peak over `dynamic`'s at the
same length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hf_kvcache.transformers_compat import cache_kwargs

from ..isolated import in_fresh_process, peak_since_kib, reset_peak_kib
from ..rows import Row, make_row
from .options import SuiteOptions, new_tokens_option

DEFAULT_CACHES = ["dynamic", "dynamic-chunked", "tiered", "kivi"]
DEFAULT_TOKENS = [8192, 16384]
CHUNKED = "dynamic-chunked"


@dataclass
class PrefillMemoryOptions(SuiteOptions):
    """`--suite prefill-memory`: `--new-tokens` (8) generated after each prompt."""

    new_tokens: int | None = new_tokens_option()


OPTIONS = PrefillMemoryOptions


def measure_one(model_name: str, spec: str, tokens: int, new: int, text: str, start: int,
                chunk: int | None = None) -> dict:
    """In this process: the peak RSS one `generate` adds (see the module docstring)."""
    import torch

    import hf_kvcache  # noqa: F401
    from hf_kvcache.caches.base import CompressedCache, memory_stats

    from ..assets import load_model, load_text, load_tokens
    from ..bench import CacheSpec

    model, tokenizer = load_model(model_name)
    ids = load_tokens(tokenizer, load_text(text), start, tokens)
    with torch.no_grad():  # warm-up: one-time allocations (kernels, thread pools) must not count
        model.generate(ids[:, :64], max_new_tokens=2, do_sample=False)
    plain = spec in ("dynamic", CHUNKED)
    cache = None if plain else CacheSpec.parse(spec).build(model)
    if chunk is not None and hasattr(cache, "prefill_chunk_size"):
        cache.prefill_chunk_size = chunk
    before = reset_peak_kib()  # the baseline is what is live now
    t0 = time.perf_counter()
    with torch.no_grad():
        kwargs = {} if cache is None else cache_kwargs(cache)
        if spec == CHUNKED:  # DynamicCache with the same chunked prefill our caches use
            kwargs["prefill_chunk_size"] = chunk or CompressedCache.prefill_chunk_size
        out = model.generate(ids, max_new_tokens=new, do_sample=False, **kwargs)
    seconds = time.perf_counter() - t0
    added = peak_since_kib(before)
    stats = memory_stats(cache) if cache is not None else {}  # peers (transformers' caches) too
    return {"peak_added_bytes": added * 1024, "seconds": seconds, "cache_bytes": stats.get("bytes"),
            "new_tokens": int(out.shape[1] - ids.shape[1])}


def run(opts: PrefillMemoryOptions) -> list[Row]:
    """One row per (prompt length, cache), each measured in a fresh process."""
    new = 8 if opts.new_tokens is None else opts.new_tokens
    if new < 1:
        raise ValueError(f"--new-tokens must be >= 1, got {new}")
    rows: list[Row] = []
    for tokens in opts.tokens or DEFAULT_TOKENS:
        for spec in opts.caches or DEFAULT_CACHES:
            result = in_fresh_process(measure_one, model_name=opts.model, spec=spec, tokens=tokens, new=new,
                                      text=opts.text, start=opts.start, chunk=opts.chunk)
            base = next((r["peak_added_bytes"] for r in rows if r["tokens"] == tokens and r["cache"] == "dynamic"),
                        None)
            rows.append(make_row("prefill-memory", spec, opts.model, tokens, text=opts.text, start=opts.start,
                                 chunk=opts.chunk, **result,
                                 vs_dynamic=result["peak_added_bytes"] / base if base else None))
            if opts.progress:
                print(f"  .. {tokens} {spec}: peak +{result['peak_added_bytes'] / 2**20:.1f} MiB, cache "
                      f"{(result['cache_bytes'] or 0) / 2**20:.1f} MiB ({result['seconds']:.0f} s)", flush=True)
    return rows
