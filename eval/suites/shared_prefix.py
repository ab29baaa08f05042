"""`--suite shared-prefix`: bytes held by n samples of one long prompt (`generate(num_return_sequences=n)`), with
and without shared pages.

    hf-kvcache compare --suite shared-prefix --start 0 --tokens 4096 --samples 8 --decode-steps 32

generate expands the prompt to n identical rows before the prefill; the paged cache (`paged_quant`) stores their
equal pages once. Every cache runs the same sampling (same seed); `bytes` is every tensor the cache holds after
generate returns (`memory_stats()`), `fp16_bytes` what an fp16 `DynamicCache` holds for the same rows and tokens
(2 bytes per key and value element), `ratio` = fp16_bytes / bytes, `vs_first` = bytes / the first cache's bytes.
`pages` / `page_refs`: distinct pages held and page-table entries (paged cache only); `distinct_samples` and
`samples_sha` (a digest of the generated tokens: equal digests, equal samples) show that sharing changed no sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import hashlib
import time

import torch

from hf_kvcache.transformers_compat import CACHE_KWARG

from ..assets import load_model, load_text, load_tokens
from ..bench import parse_specs
from ..rows import Row, make_row
from . import log_row
from .options import SuiteOptions, decode_steps_option, option, seed_option

DEFAULT_CACHES = ['paged (unshared)=paged_quant:{"share": false}', 'paged (shared)=paged_quant:{"share": true}',
                  "tiered"]


@dataclass
class SharedPrefixOptions(SuiteOptions):
    """`--suite shared-prefix`: sampled continuations of one prompt that share its cache."""

    samples: int = option(8, "num_return_sequences of the one prompt")
    seed: int = seed_option()
    decode_steps: int | None = decode_steps_option()


OPTIONS = SharedPrefixOptions


def run(opts: SharedPrefixOptions) -> list[Row]:
    prompt_tokens, new_tokens = opts.one_length(4096), opts.decode_steps or 32
    if opts.samples < 1:
        raise ValueError(f"--samples must be at least 1, got {opts.samples}")
    specs = parse_specs(opts.caches or DEFAULT_CACHES)
    model, tok = load_model(opts.model)
    ids = load_tokens(tok, load_text(opts.text), opts.start, prompt_tokens)
    rows: list[Row] = []
    for spec in specs:
        if spec.name == "dynamic":
            raise ValueError("--suite shared-prefix compares caches of ours; the fp16 DynamicCache figure is in "
                             "every row (fp16_bytes)")
        torch.manual_seed(opts.seed)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, do_sample=True, num_return_sequences=opts.samples, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=tok.eos_token_id,
                                 cache_implementation=spec.name, cache_config=dict(spec.options),
                                 return_dict_in_generate=True)
        seconds = time.perf_counter() - start
        stats = getattr(out, CACHE_KWARG).memory_stats()
        generated = out.sequences[:, prompt_tokens:]
        first = rows[0]["bytes"] if rows else stats["bytes"]
        rows.append(make_row(
            "shared-prefix", spec.label, opts.model, prompt_tokens, samples=opts.samples, new_tokens=new_tokens,
            bytes=int(stats["bytes"]), fp16_bytes=int(stats["fp16_bytes"]), ratio=stats["fp16_bytes"] / stats["bytes"],
            vs_first=stats["bytes"] / first, pages=stats.get("pages"), page_refs=stats.get("page_refs"),
            distinct_samples=len({tuple(r) for r in generated.tolist()}),
            samples_sha=hashlib.blake2b(generated.numpy().tobytes(), digest_size=6).hexdigest(),
            seconds=round(seconds, 1)))
        del out
        if opts.progress:
            log_row(rows[-1], ("bytes", "ratio", "seconds"))
    return rows
