"""`--suite reconstruct-cost`: what scoring a context by its reconstruction costs: prefill time and peak memory
relative to a plain prefill.

    hf-kvcache compare --suite reconstruct-cost --model qwen2.5-coder-0.5b --tokens 4096 --chunk 512 --json ROWS

Each variant runs in a fresh process (`eval/isolated.py`, so that the peak resident memory of one does not hide the
other's): it loads the model, runs a 64-token warm-up forward, hands freed heap back and resets the peak counter
(`isolated.reset_peak_kib`: its resident memory then is the baseline), prefills `--tokens` tokens (2048) of Moby
Dick (from character 200000) in one forward and reads the peak resident memory (VmHWM); the row gives the seconds
and the peak over the baseline (`peak_mib`; rows before 2026-11-30 took the process's lifetime peak, `ru_maxrss`,
over the resident memory after the warm-up, which could read slightly below zero). Variants (`--variants`):
`plain` (the full cache, `DynamicCache`, the model's SDPA attention), `evict` (the evicting cache with the `snapkv`
policy, which needs the attention mass: the `"hf_kvcache"` attention), `reconstruct` (the evicting cache with the
`reconstruct` policy: the prefill, then `score_context` in `--chunk`-token forwards (512), then the eviction; its row
splits the seconds into `prefill_seconds` and `score_seconds`). The budget is 25 % of the tokens. Any `--caches`
spec adds a row of its own, measured the same way under `attached`: a cache scored by reconstruction (e.g. an `h2o`
cache with another `reconstruct` setting) is held, scored and evicted, its seconds split as above; an `h2o` spec with
`"lookahead"` is built as the question-aware mode builds it (the context's last 32 tokens standing for the question),
prefilled, then evicted by `evict_with_lookahead` (`score_seconds`: the draft over a copy of the cache, and the
eviction; the peak includes the copy).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from hf_kvcache.transformers_compat import cache_kwargs

from ..bench import CacheSpec, parse_specs
from ..isolated import in_fresh_process, peak_since_kib, reset_peak_kib
from ..rows import Row, make_row
from .options import SuiteOptions, option

VARIANTS = ("plain", "evict", "reconstruct")
DEFAULT_TOKENS = 2048
DEFAULT_CHUNK = 512
QUESTION_TOKENS = 32  # a `lookahead` spec: the context's last tokens stand for the question


@dataclass
class ReconstructCostOptions(SuiteOptions):
    """`--suite reconstruct-cost`: the variants to measure."""

    variants: list[str] = option(list(VARIANTS), "plain evict reconstruct: the prefills to measure", type=str,
                                 nargs="+", choices=VARIANTS)


OPTIONS = ReconstructCostOptions


def variant_spec(variant: str, chunk: int) -> str | None:
    """The cache spec a named variant measures (None: `plain`, a `DynamicCache` on the model's own attention)."""
    policy = {"evict": '"snapkv"', "reconstruct": f'"reconstruct", "chunk": {chunk}'}.get(variant)
    return None if policy is None else f'h2o:{{"budget": 0.25, "policy": {policy}}}'


def measure(model_name: str, tokens: int, spec: str | None) -> dict:
    """One prefill in this process (see the module docstring): `spec` None, the plain one; otherwise the cache it
    builds, attached, its context held and scored where its policy scores by reconstruction. Seconds and peak memory
    over the loaded model."""
    import torch
    from transformers import DynamicCache

    from hf_kvcache.caches.evict.reconstruct import held_for_scoring, reconstruction_prompt_ids, scored_layers
    from hf_kvcache.registry import attached

    from ..assets import load_model, load_text

    model, tokenizer = load_model(model_name)
    ids = tokenizer(load_text("moby-dick")[200_000:], add_special_tokens=False).input_ids[:tokens]
    context = torch.tensor([ids])
    torch.set_grad_enabled(False)
    model(context[:, :64], **cache_kwargs(DynamicCache(config=model.config)), use_cache=True)  # first-call setup
    base = reset_peak_kib()
    out: dict = {}
    t0 = time.perf_counter()
    parsed = None if spec is None else CacheSpec.parse(spec)
    if parsed is None:
        model(context, **cache_kwargs(DynamicCache(config=model.config)), use_cache=True, logits_to_keep=1)
    elif parsed.lookahead:
        out.update(_lookahead_prefill(model, parsed, context, t0))
    else:
        cache = parsed.build(model)
        prompt = reconstruction_prompt_ids(tokenizer)
        with attached(model, cache):
            with held_for_scoring(model, cache, context, prompt):
                model(context, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
                out["prefill_seconds"] = time.perf_counter() - t0
        if scored_layers(cache):
            out["score_seconds"] = time.perf_counter() - t0 - out["prefill_seconds"]
    out["seconds"] = time.perf_counter() - t0
    out["peak_mib"] = peak_since_kib(base) / 1024
    return out


def _lookahead_prefill(model, spec: CacheSpec, context, t0: float) -> dict:
    """A spec with `lookahead` (module docstring): its cache built as the question-aware mode builds it, the last
    `QUESTION_TOKENS` of the context standing for the question; the prefill, then `evict_with_lookahead`. Seconds
    of each since `t0`."""
    from hf_kvcache.caches.evict.lookahead import evict_with_lookahead
    from hf_kvcache.registry import attached

    from .passkey import question_aware_cache

    n = context.shape[1]
    cache, keep = question_aware_cache(model, spec, n - QUESTION_TOKENS, QUESTION_TOKENS)
    with attached(model, cache):
        logits = model(context, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits
        prefill = time.perf_counter() - t0
        evict_with_lookahead(model, cache, logits[:, -1], keep, QUESTION_TOKENS, spec.lookahead)
    return {"prefill_seconds": prefill, "score_seconds": time.perf_counter() - t0 - prefill}


def run(opts: ReconstructCostOptions) -> list[Row]:
    """One row per variant, then one per `--caches` spec, each measured in a fresh process."""
    tokens, chunk = opts.one_length(DEFAULT_TOKENS), opts.chunk or DEFAULT_CHUNK
    unknown = sorted(set(opts.variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; --variants takes some of: {' '.join(VARIANTS)}")
    specs = parse_specs(opts.caches) if opts.caches else []
    runs = [(variant, variant_spec(variant, chunk)) for variant in opts.variants]
    runs += [(spec.label, text) for spec, text in zip(specs, opts.caches or [])]
    rows = []
    for label, text in runs:
        result = in_fresh_process(measure, model_name=opts.model, tokens=tokens, spec=text)
        rows.append(make_row("reconstruct-cost", label, opts.model, tokens, chunk=chunk,
                             threads=os.environ.get("OMP_NUM_THREADS"), **result))
        if opts.progress:
            print(f"  .. {label}: {result['seconds']:.1f} s, peak +{result['peak_mib']:.0f} MiB", flush=True)
    return rows
