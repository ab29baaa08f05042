"""`--suite calibration`: what `rotation="auto"` chose, layer by layer, and what it cost.

Streams `--tokens` tokens of `--text` from `--start` (2048 from 5000 by default) in `--chunk`-token forwards (32)
through each tiered cache of `--caches` (default `tiered`) the way `generate` runs it (`hf_kvcache.attached`), then
reports the perplexity, the ratio and each layer's recipe with the attention errors of its candidates.

    hf-kvcache compare --suite calibration --model qwen2.5-coder-0.5b --caches tiered --json recipes.json

Rows: one per cache (`perplexity`, `bytes`, `ratio`, and `recipes`: `cache.recipes()`, one entry per model layer,
None for a layer that did not calibrate; reusable as the `recipes` option of a tiered cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import hf_kvcache

from ..assets import load_model, load_text, load_tokens
from ..bench import parse_specs
from ..perplexity import streaming_perplexity
from ..rows import Row, make_row
from .options import SuiteOptions

DEFAULT_TOKENS = 2048
DEFAULT_CHUNK = 32


@dataclass
class CalibrationOptions(SuiteOptions):
    """`--suite calibration`: the common options only (`--caches` names tiered caches)."""


OPTIONS = CalibrationOptions


def run(opts: CalibrationOptions) -> list[Row]:
    """One row per cache of `--caches`, with the recipes its layers chose (see the module docstring).

    Raises:
        ValueError: for a cache that keeps no recipes (not a tiered cache)."""
    tokens, chunk = opts.one_length(DEFAULT_TOKENS), opts.chunk or DEFAULT_CHUNK
    specs = parse_specs(opts.caches or ["tiered"])
    model, tokenizer = load_model(opts.model)
    ids = load_tokens(tokenizer, load_text(opts.text), opts.start, tokens)
    rows = []
    for spec in specs:
        cache = spec.build(model)
        if not hasattr(cache, "recipes"):
            raise ValueError(f"--suite calibration reports the recipes of tiered caches; {spec.label!r} keeps none: "
                             "pass tiered caches (e.g. tiered, 'label=tiered:{...}') to --caches")
        with torch.inference_mode(), hf_kvcache.attached(model, cache):
            result = streaming_perplexity(model, ids, cache, chunk, progress=False)
        recipes = cache.recipes()
        if opts.progress:
            print(f"  .. {spec.label}: ppl {result.perplexity:.3f}, {result.ratio:.2f}x vs fp16", flush=True)
            for i, r in enumerate(recipes):
                if r is not None:
                    errs = " ".join(f"{k}={v:.4f}" for k, v in r["errors"].items())
                    print(f"     layer {i:2d}: {r['rotation']:6s} ({r['source']}) {errs}", flush=True)
        rows.append(make_row("calibration", spec.label, opts.model, tokens, text=opts.text, start=opts.start,
                             chunk=chunk, perplexity=result.perplexity, bytes=result.bytes, ratio=result.ratio,
                             recipes=recipes))
    return rows
