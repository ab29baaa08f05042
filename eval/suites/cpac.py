"""CPAC: the paper's claims ("3.2x compression at +1.8 % perplexity, 0.45 ms compression and 0.12 ms decompression
per block") measured on a real model, and the ratio / perplexity curve of its variants (`--suite cpac`).

Sections (`--sections`, all by default; SmolLM2-135M, Moby Dick tokens 5000:7048 streamed 32 at a time unless told):
- `pressure`: DynamicCache, int8, fp8, int4, then CPAC with the paper's defaults under a fixed pressure of 0.3, 0.6
  and 0.9 (thresholds 0.95 / 0.85 / 0.70), each beside H2O holding the same bytes; then CPAC with a memory budget
  (fraction of the fp16 size of the tokens seen; `--budgets` replaces `BUDGETS`), whose pressure is measured.
- `similarity`: how alike the pages of a head are under each feature kind, and how large a token-wise delta against
  the most similar earlier page is compared with the page itself (keys post-RoPE, keys de-rotated, values).
- `curve`: one streaming run per variant in `CURVE` (`--only` fnmatch patterns pick labels; `--caches` adds other
  caches as reference points).
- `timing`: per-block compress / decompress time, one block (16 tokens of one KV head, keys and values) at a time,
  median over every block of layer `--timing-layer` (`time.perf_counter`), and the batched decompression.

Rows (`section` names the table): pressure / curve rows carry `perplexity`, `delta_pct` (vs DynamicCache),
`bytes`, `ratio`, `seconds` and, for CPAC, `base_pages` / `delta_pages` / `raw_pages`, `pressure`,
`measured_pressure`, `threshold`, `compress_ms_per_block`, `decompress_ms_per_block`; similarity rows `features`,
`cos_mean`, the share of pages at `>=0.95` / `>=0.85` / `>=0.7` and `delta_rel_norm` (`cache` names the tensor);
timing rows `blocks`, `compress_ms`, `decompress_ms`, `decompress_batched_ms`. Every ratio is fp16 bytes of the tokens
seen / bytes held. The attention is `hf_kvcache` (`--attn`; it reports the attention mass CPAC ranks pages by).
"""

from __future__ import annotations

from dataclasses import dataclass

import fnmatch
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from hf_kvcache.caches.cpac import CPACCache, CPACLayer, CPACOptions
from hf_kvcache.caches.h2o import H2OLayer
from hf_kvcache.registry import build_cache, cache_names

from ..assets import load_model, load_text, load_tokens
from ..bench import parse_specs
from ..perplexity import streaming_perplexity
from ..rows import Row, make_row
from . import log_row
from .options import SuiteOptions, budgets_option, option

SECTIONS = ("pressure", "similarity", "curve", "timing")

PRESSURES = (0.3, 0.6, 0.9)
BUDGETS = (3.0, 0.9, 0.6)  # memory_budget fractions whose measured pressure lands near 0.3 / 0.6-0.8 / 0.9

# (label, options): the ratio / perplexity curve. "p0.9" = fixed pressure 0.9 (threshold 0.70).
DEROT = {"key_space": "derotated"}
KIVI_SCALE = {"delta_scale": ["channel", "token"]}
CURVE = [
    # similarity threshold at the paper's 8-bit deltas (0.95 / 0.85 / 0.70 are the pressure rows)
    ("thr0.50 b8", {"thresholds": [0.5, 0.5, 0.5]}),
    ("thr-1 b8 (all delta)", {"thresholds": [-1, -1, -1]}),
    # delta bits, paper defaults otherwise
    ("p0.9 b6", {"pressure": 0.9, "delta_bits": 6}),
    ("p0.9 b5", {"pressure": 0.9, "delta_bits": 5}),
    ("p0.9 b4", {"pressure": 0.9, "delta_bits": 4}),
    ("p0.9 b3", {"pressure": 0.9, "delta_bits": 3}),
    # similarity variants at 4 bits
    ("p0.9 b4 sim=values", {"pressure": 0.9, "delta_bits": 4, "similarity_on": "values"}),
    ("p0.9 b4 sim=separate", {"pressure": 0.9, "delta_bits": 4, "similarity_on": "separate"}),
    ("p0.9 b4 feat=channel", {"pressure": 0.9, "delta_bits": 4, "features": "channel"}),
    ("derot p0.9 b4", {"pressure": 0.9, "delta_bits": 4, **DEROT}),
    ("derot p0.9 b4 sim=values", {"pressure": 0.9, "delta_bits": 4, "similarity_on": "values", **DEROT}),
    ("derot p0.9 b4 feat=channel", {"pressure": 0.9, "delta_bits": 4, "features": "channel", **DEROT}),
    ("derot thr0.3 b4 feat=page", {"thresholds": [0.3, 0.3, 0.3], "delta_bits": 4, "features": "page", **DEROT}),
    # importance: protection and weighting
    ("derot p0.9 b4 noprotect", {"pressure": 0.9, "delta_bits": 4, "protect_importance": None, **DEROT}),
    ("derot p0.9 b4 protect0.2", {"pressure": 0.9, "delta_bits": 4, "protect_importance": 0.2, **DEROT}),
    ("derot p0.9 b4 noweight", {"pressure": 0.9, "delta_bits": 4, "importance_weighting": False, **DEROT}),
    # scale granularity of the deltas
    ("derot p0.9 b4 scale=token", {"pressure": 0.9, "delta_bits": 4, "delta_scale": "token", **DEROT}),
    ("derot p0.9 b4 scale=channel", {"pressure": 0.9, "delta_bits": 4, "delta_scale": "channel", **DEROT}),
    ("derot p0.9 b4 scale=ch/tok", {"pressure": 0.9, "delta_bits": 4, **KIVI_SCALE, **DEROT}),
    # what the cross-page delta itself is worth: the same pages quantized against zero instead of a base
    ("p0.9 b4 ref=zero", {"pressure": 0.9, "delta_bits": 4, "reference": "zero"}),
    ("derot p0.9 b4 scale=ch/tok ref=keys", {"pressure": 0.9, "delta_bits": 4, "reference": "keys",
                                             **KIVI_SCALE, **DEROT}),
    ("b4 scale=ch/tok ref=zero", {"delta_bits": 4, "reference": "zero", **KIVI_SCALE}),
    ("derot b4 scale=ch/tok ref=zero", {"delta_bits": 4, "reference": "zero", **KIVI_SCALE, **DEROT}),
    ("p0.9 b4 scale=ch/tok", {"pressure": 0.9, "delta_bits": 4, **KIVI_SCALE}),
    ("derot p0.9 b4 scale=channel ref=keys", {"pressure": 0.9, "delta_bits": 4, "delta_scale": "channel",
                                              "reference": "keys", **DEROT}),
    ("derot p0.9 b4 scale=ch/tok ref=keys protect0.8", {"pressure": 0.9, "delta_bits": 4, "reference": "keys",
                                                        "protect_importance": 0.8, **KIVI_SCALE, **DEROT}),
    ("derot p0.9 b4 scale=ch/tok ref=keys noprotect", {"pressure": 0.9, "delta_bits": 4, "reference": "keys",
                                                       "protect_importance": None, **KIVI_SCALE, **DEROT}),
    ("b4 scale=ch/tok ref=zero protect0.8", {"delta_bits": 4, "reference": "zero", "protect_importance": 0.8,
                                             **KIVI_SCALE}),
    ("b4 scale=ch/tok ref=zero noprotect", {"delta_bits": 4, "reference": "zero", "protect_importance": None,
                                            **KIVI_SCALE}),
    # below 4 bits
    ("derot p0.9 b3 scale=ch/tok ref=keys", {"pressure": 0.9, "delta_bits": 3, "reference": "keys",
                                             **KIVI_SCALE, **DEROT}),
    ("b3 scale=ch/tok ref=zero", {"delta_bits": 3, "reference": "zero", **KIVI_SCALE}),
    ("derot p0.9 b3 scale=channel", {"pressure": 0.9, "delta_bits": 3, "delta_scale": "channel", **DEROT}),
    ("derot p0.9 b3 scale=channel ref=keys", {"pressure": 0.9, "delta_bits": 3, "delta_scale": "channel",
                                              "reference": "keys", **DEROT}),
    ("derot p0.9 b3 scale=channel ref=keys protect0.8", {"pressure": 0.9, "delta_bits": 3, "delta_scale": "channel",
                                                         "reference": "keys", "protect_importance": 0.8, **DEROT}),
    ("derot thr-1 b3 scale=channel ref=keys protect0.8", {"thresholds": [-1, -1, -1], "delta_bits": 3,
                                                          "delta_scale": "channel", "reference": "keys",
                                                          "protect_importance": 0.8, **DEROT}),
    ("derot p0.9 b3 scale=channel ref=keys protect0.8 page32", {"pressure": 0.9, "delta_bits": 3, "page_size": 32,
                                                                "delta_scale": "channel", "reference": "keys",
                                                                "protect_importance": 0.8, **DEROT}),
    ("b3 scale=channel ref=zero", {"delta_bits": 3, "delta_scale": "channel", "reference": "zero"}),
    ("derot b3 scale=channel ref=zero", {"delta_bits": 3, "delta_scale": "channel", "reference": "zero", **DEROT}),
    ("derot b3 scale=channel ref=zero asym", {"delta_bits": 3, "delta_scale": "channel", "reference": "zero",
                                              "delta_asymmetric": True, **DEROT}),
    ("b3 scale=channel ref=zero asym", {"delta_bits": 3, "delta_scale": "channel", "reference": "zero",
                                        "delta_asymmetric": True}),
    ("derot p0.9 b3 scale=channel ref=keys asym", {"pressure": 0.9, "delta_bits": 3, "delta_scale": "channel",
                                                   "reference": "keys", "delta_asymmetric": True, **DEROT}),
    ("derot b3 scale=channel ref=zero protect0.8", {"delta_bits": 3, "delta_scale": "channel", "reference": "zero",
                                                    "protect_importance": 0.8, **DEROT}),
    ("b3 scale=channel ref=zero protect0.8", {"delta_bits": 3, "delta_scale": "channel", "reference": "zero",
                                              "protect_importance": 0.8}),
    ("derot p0.9 b2 scale=channel ref=keys", {"pressure": 0.9, "delta_bits": 2, "delta_scale": "channel",
                                              "reference": "keys", **DEROT}),
    ("b2 scale=channel ref=zero", {"delta_bits": 2, "delta_scale": "channel", "reference": "zero"}),
]

# the best point of the curve (SmolLM2-135M, Moby Dick 5000:7048): de-rotated keys against base pages, values
# quantized directly, 3 bits with one scale per channel of a page, only the most attended pages kept raw
BEST = "derot p0.9 b3 scale=channel ref=keys protect0.8"


# ---- runs ------------------------------------------------------------------------------------------------------------
Run = Callable[[str, dict, str], Row]


def stream_metrics(model, ids, name: str, options: dict, chunk: int) -> dict:
    """Streaming perplexity of one cache, with CPAC's page counts, pressure and timing when it is a CPAC cache."""
    cache = DynamicCache(config=model.config) if name == "dynamic" else build_cache(name, model.config, **options)
    r = streaming_perplexity(model, ids, cache, chunk)
    out = {"options": options, **r.to_dict()}
    out.pop("tokens")
    if isinstance(cache, CPACCache):
        stats = cache.memory_stats()
        for k in ("base_pages", "delta_pages", "raw_pages", "pressure", "measured_pressure", "threshold"):
            out[k] = stats[k]
        timing = cache.timing_stats()
        out["compress_ms_per_block"] = timing["compress_ms_per_block"]
        out["decompress_ms_per_block"] = timing["decompress_ms_per_block"]
    return out


def h2o_bytes_per_token(model, ids, chunk: int) -> float:
    """Bytes H2O holds per kept token, per layer, KV head and row, measured on a short stream with a small budget."""
    budget = 64
    cache = build_cache("h2o", model.config, budget=budget)
    streaming_perplexity(model, ids[:, :256], cache, chunk)
    layers = [layer for layer in cache.layers if isinstance(layer, H2OLayer) and layer.slots is not None]
    heads = layers[0].num_heads
    return cache.memory_stats()["bytes"] / (budget * len(layers) * heads)


def pressure_section(model, ids, chunk: int, run: Run, budgets: tuple[float, ...]) -> list[Row]:
    rows = [run("dynamic", {}, "dynamic (fp32)")]
    for name in ("int8", "fp8", "int4"):
        rows.append(run(name, {}, name))
    have_h2o = "h2o" in cache_names() and getattr(model.config, "_attn_implementation", None) == "hf_kvcache"
    per_token = h2o_bytes_per_token(model, ids, chunk) if have_h2o else None
    if not have_h2o:
        print("note: no H2O comparison (needs the 'h2o' cache and --attn hf_kvcache)", flush=True)
    heads = model.config.num_key_value_heads
    layers = model.config.num_hidden_layers
    for p in PRESSURES:
        row = run("cpac", {"pressure": p}, f"cpac pressure={p}")
        rows.append(row)
        if per_token:
            budget = max(2, round(row["bytes"] / (per_token * layers * heads)))
            rows.append(run("h2o", {"budget": budget}, f"h2o same bytes (budget={budget})"))
    for b in budgets:
        rows.append(run("cpac", {"memory_budget": b}, f"cpac memory_budget={b}"))
    return rows


def curve_section(run: Run, only: list[str] | None, extra: list[str]) -> list[Row]:
    rows = [run("dynamic", {}, "dynamic (fp32)")]
    for spec in parse_specs(extra) if extra else []:  # other caches, as reference points on the curve
        rows.append(run(spec.name, spec.options, spec.label))
    for label, options in CURVE:
        if only and not any(fnmatch.fnmatch(label, pat) for pat in only):
            continue
        rows.append(run("cpac", options, label))
    return rows


# ---- page similarity on real keys / values ---------------------------------------------------------------------------
def similarity_section(model, ids, chunk: int, page_size: int = 16) -> list[dict]:
    """How alike pages of one (layer, KV head) are, and what a token-wise delta against the most similar earlier page
    leaves: for each tensor (keys as RoPE leaves them, keys de-rotated, values) and feature kind, the share of pages
    whose best cosine to an earlier page reaches 0.95 / 0.85 / 0.70, and the median of |page - base| / |page|."""
    from hf_kvcache.caches.cpac.features import FEATURE_KINDS, page_features
    from hf_kvcache.rope import KeyRotation

    cache = DynamicCache(config=model.config)
    streaming_perplexity(model, ids, cache, chunk)
    keys = torch.stack([layer.keys[0] for layer in cache.layers]).float()  # [layers, heads, T, D]
    values = torch.stack([layer.values[0] for layer in cache.layers]).float()
    n = keys.shape[2] // page_size
    tensors = {
        "keys (post-RoPE)": keys,
        "keys (de-rotated)": KeyRotation.from_config(model.config).derotate(keys, 0),
        "values": values,
    }
    earlier = torch.tril(torch.ones(n, n, dtype=torch.bool), -1)
    rows = []
    for name, x in tensors.items():
        pages = x[:, :, : n * page_size].reshape(*x.shape[:2], n, page_size, x.shape[-1])
        for kind in FEATURE_KINDS:
            f = page_features(pages, 4, kind)
            sim = torch.einsum("lhnf,lhmf->lhnm", f, f).masked_fill(~earlier, float("-inf"))
            best, arg = sim[:, :, 1:].max(-1)
            base = torch.gather(pages, 2, arg[..., None, None].expand(-1, -1, -1, page_size, pages.shape[-1]))
            cur = pages[:, :, 1:]
            rel = ((cur - base).norm(dim=(-2, -1)) / cur.norm(dim=(-2, -1))).median().item()
            rows.append({
                "tensor": name, "features": kind, "cos_mean": best.mean().item(),
                **{f">={t}": (best >= t).float().mean().item() for t in (0.95, 0.85, 0.70)},
                "delta_rel_norm": rel,
            })
    return rows


# ---- per-block timing ------------------------------------------------------------------------------------------------
def _median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def block_timing(keys: torch.Tensor, values: torch.Tensor, options: dict, rotation, repeats: int = 5) -> dict:
    """Per-block times on one KV head's real keys / values `[1, 1, T, D]`: compress (features, similarity against
    the bases so far, delta encoding, storage), one block per call; decompress one block alone; and the batched
    rebuild of every page at once (per block)."""
    opts = CPACOptions(**{**options, "recent_pages": 0})
    p = opts.page_size
    compress, single, batched = [], [], []
    for _ in range(repeats):
        layer = CPACLayer(opts, None, rotation)
        layer._mass_mode = True  # no attention here: compress when told, one page at a time
        for start in range(0, keys.shape[2] - p + 1, p):
            k, v = keys[:, :, start : start + p], values[:, :, start : start + p]
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.cumulative_length += p
            layer.append(k, v)
            t0 = time.perf_counter()
            layer.compress_ready()
            compress.append(time.perf_counter() - t0)
        for page in range(layer.n_pages):
            t0 = time.perf_counter()
            layer.decompress_page("k", 0, 0, page)
            layer.decompress_page("v", 0, 0, page)
            single.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        layer.materialize()
        batched.append((time.perf_counter() - t0) / layer.n_pages)
    counts = layer.page_counts()
    return {
        "blocks": layer.n_pages,
        "compress_ms": _median_ms(compress),
        "decompress_ms": _median_ms(single),
        "decompress_batched_ms": _median_ms(batched),
        **counts,
    }


def timing_section(model, ids, chunk: int, layer_idx: int, variants: list[tuple[str, dict]]) -> list[dict]:
    cache = DynamicCache(config=model.config)
    streaming_perplexity(model, ids, cache, chunk)
    keys, values = cache.layers[layer_idx].keys, cache.layers[layer_idx].values
    rows = []
    for label, options in variants:
        probe = CPACCache(config=model.config, **options)
        rotation = probe._rotation
        per_head = [
            block_timing(keys[:, h : h + 1], values[:, h : h + 1], options, rotation) for h in range(keys.shape[1])
        ]
        row = {"label": label, "options": options, "layer": layer_idx}
        for k in ("compress_ms", "decompress_ms", "decompress_batched_ms"):
            row[k] = statistics.median(r[k] for r in per_head)
        row["blocks"] = sum(r["blocks"] for r in per_head)
        rows.append(row)
    return rows


@dataclass
class CpacOptions(SuiteOptions):
    """`--suite cpac`: CPAC's claims, section by section."""

    budgets: list[float] | None = budgets_option()
    sections: list[str] | None = option(None, "pressure similarity curve timing (default: all)", type=str, nargs="+")
    only: list[str] | None = option(None, "curve labels to run (fnmatch patterns)", type=str, nargs="+")
    timing_layer: int = option(15, "layer whose blocks the timing section times")
    attn: str = option("hf_kvcache", "attention implementation (hf_kvcache reports the mass)")


OPTIONS = CpacOptions


def run(opts: CpacOptions) -> list[Row]:
    """Rows of every section asked for, in `SECTIONS` order."""
    sections = opts.sections or list(SECTIONS)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown cpac section(s) {unknown}; pick among: {', '.join(SECTIONS)}")
    tokens = opts.one_length(2048)
    chunk = opts.chunk or 32
    budgets = tuple(opts.budgets) if opts.budgets else BUDGETS
    torch.manual_seed(0)
    model, tokenizer = load_model(opts.model, attn_implementation=opts.attn)
    if "timing" in sections and not 0 <= opts.timing_layer < model.config.num_hidden_layers:
        raise ValueError(f"--timing-layer {opts.timing_layer} is not a layer of {opts.model} "
                         f"(0..{model.config.num_hidden_layers - 1})")
    ids = load_tokens(tokenizer, load_text(opts.text), opts.start, tokens)

    def stamp(section: str, label: str, **metrics) -> Row:
        return make_row("cpac", label, opts.model, tokens, section=section, **metrics)

    def runner(section: str) -> Run:
        def run_one(name: str, options: dict, label: str) -> Row:
            row = stamp(section, label, **stream_metrics(model, ids, name, options, chunk))
            if opts.progress:
                log_row(row)
            return row

        return run_one

    rows: list[Row] = []
    if "pressure" in sections:
        rows += with_delta(pressure_section(model, ids, chunk, runner("pressure"), budgets))
    if "similarity" in sections:
        rows += [stamp("similarity", r.pop("tensor"), **r) for r in similarity_section(model, ids, chunk)]
    if "curve" in sections:
        rows += with_delta(curve_section(runner("curve"), opts.only, opts.caches or []))
    if "timing" in sections:
        variants = [("paper defaults (8-bit, p0.9)", {"pressure": 0.9}),
                    ("p0.9 b4", {"pressure": 0.9, "delta_bits": 4}),
                    (BEST, dict(CURVE)[BEST])]
        rows += [stamp("timing", r.pop("label"), **r)
                 for r in timing_section(model, ids, chunk, opts.timing_layer, variants)]
    return rows


def with_delta(rows: list[Row]) -> list[Row]:
    """`delta_pct` of each row against the first (DynamicCache) of its section."""
    for row in rows:
        row["delta_pct"] = 100.0 * (row["perplexity"] / rows[0]["perplexity"] - 1.0)
    return rows
