"""Streaming perplexity, bytes held, ratio vs fp16 and decode speed of caches side by side (`bench.run_benchmark`).

Suites: `perplexity` (the caches of `--caches`), `peers` (the tiered cache and KIVI beside transformers'
QuantizedCache at 2 and 4 bits) and `ablations` (the tiered defaults with one thing changed per row); `--caches` adds
caches after a preset's. Rows: `perplexity`, `delta_pct` (vs the first cache), `bytes`, `fp16_bytes`, `ratio`,
`seconds`, `tokens_per_s` (streaming), `decode_tokens_per_s` (after the stream, unless --decode-steps 0), and where
the cache reports them `proxy`, `tiers` (bytes and tokens per tier) and `archive_switches`. `--loop plain` drives the
model as a user's own loop does (`model(ids, past_key_values=cache)`, no `attached`), `--loop unserved` as that loop
does with nothing reported to the cache; the default is `attached`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..bench import LOOPS, parse_specs, run_benchmark
from ..rows import Row, make_row
from .options import SuiteOptions, decode_steps_option, loop_option, model_dtype_option

PEERS = [
    "dynamic",
    "tiered",
    "kivi-2 r64=kivi:{\"bits\": 2, \"residual_length\": 64}",
    "hf-quanto-2 g32 r64=hf-quanto:{\"nbits\": 2, \"q_group_size\": 32, \"residual_length\": 64}",
    "hf-hqq-2 g32 r64=hf-hqq:{\"nbits\": 2, \"q_group_size\": 32, \"residual_length\": 64}",
    "kivi-4 r64=kivi:{\"bits\": 4, \"residual_length\": 64}",
    "hf-quanto-4 g32 r64=hf-quanto:{\"nbits\": 4, \"q_group_size\": 32, \"residual_length\": 64}",
    "hf-hqq-4 g32 r64=hf-hqq:{\"nbits\": 4, \"q_group_size\": 32, \"residual_length\": 64}",
]

# Each ablation changes one thing of the tiered defaults (the "tiered" row).
ABLATIONS = [
    "dynamic",
    "tiered",
    "per-token keys=tiered:{\"key_axis\": \"token\"}",
    "archive groups 32=tiered:{\"archive_group_size\": 32}",
    "archive groups 128=tiered:{\"archive_group_size\": 128}",
    "value groups 32=tiered:{\"value_group_size\": 32}",
    "no sinks=tiered:{\"sink_length\": 0}",
    "sinks 16=tiered:{\"sink_length\": 16}",
    "no hadamard=tiered:{\"rotation\": \"none\"}",
    "hadamard keys only=tiered:{\"rotation\": \"keys\"}",
    "hadamard values only=tiered:{\"rotation\": \"values\"}",
    "no clipping=tiered:{\"clip_search\": false}",
    "clip search keys too=tiered:{\"clip_on\": \"both\"}",
    "fixed clip 0.9 values=tiered:{\"clip_search\": false, \"clip_ratio\": 0.9}",
    "fp32 tail=tiered:{\"tail_dtype\": null}",
    "fp32 un-rotation=tiered:{\"rotation_dtype\": null}",
    "no warm tier=tiered:{\"warm_length\": 0}",
]

PRESETS: dict[str, list[str]] = {"perplexity": [], "peers": PEERS, "ablations": ABLATIONS}
DEFAULT_TOKENS = {"perplexity": 1024, "peers": 2048, "ablations": 2048}


def cache_texts(opts: SuiteOptions) -> list[str]:
    """The preset's cache specs, then those of --caches."""
    texts = PRESETS[opts.suite] + (opts.caches or [])
    if not texts:
        raise ValueError("give at least one cache: --caches dynamic int4 ...  (or a preset: --suite peers)")
    return texts


@dataclass
class PerplexityOptions(SuiteOptions):
    """`--suite perplexity | peers | ablations`: streaming perplexity, then decode steps timed."""

    decode_steps: int | None = decode_steps_option()
    loop: str = loop_option()
    model_dtype: str = model_dtype_option()


OPTIONS = PerplexityOptions


def run(opts: PerplexityOptions) -> list[Row]:
    """One row per cache; the first cache is the baseline of `delta_pct`."""
    if opts.loop not in LOOPS:
        raise ValueError(f"loop must be one of {list(LOOPS)}, got {opts.loop!r}")
    specs = parse_specs(cache_texts(opts))
    tokens = opts.one_length(DEFAULT_TOKENS[opts.suite])
    steps = 16 if opts.decode_steps is None else opts.decode_steps
    rows = run_benchmark(specs, opts.model, opts.text, opts.start, tokens, opts.chunk or 32, steps,
                         progress=opts.progress, loop=opts.loop, dtype=getattr(torch, opts.model_dtype))
    extra = {} if opts.model_dtype == "float32" else {"model_dtype": opts.model_dtype}
    return [make_row(opts.suite, r.pop("cache"), opts.model, r.pop("tokens"), **r, **extra) for r in rows]
