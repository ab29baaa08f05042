"""CPAC benchmark: the paper's claims ("3.2x compression at +1.8 % perplexity, 0.45 ms compression and 0.12 ms
decompression per block") measured on a real model, and the ratio / perplexity curve of its variants.

    python -m hf_kvcache.eval.cpac_bench                                  # every section
    python -m hf_kvcache.eval.cpac_bench --sections pressure              # paper defaults at pressure 0.3 / 0.6 / 0.9
    python -m hf_kvcache.eval.cpac_bench --sections curve --only 'derot*' # a subset of the curve (fnmatch on labels)
    python -m hf_kvcache.eval.cpac_bench --sections timing

Sections (SmolLM2-135M, Moby Dick tokens 5000:7048, streamed 32 tokens at a time, unless told otherwise):
- `pressure`: DynamicCache, int8, fp8, int4, then CPAC with the paper's defaults under a fixed pressure of 0.3, 0.6
  and 0.9 (thresholds 0.95 / 0.85 / 0.70), each beside H2O holding the same bytes; then CPAC with a memory budget
  (fraction of the fp16 size of the tokens seen), whose pressure is measured.
- `similarity`: how alike the pages of a head are under each feature kind, and how large a token-wise delta against
  the most similar earlier page is compared with the page itself (keys post-RoPE, keys de-rotated, values).
- `curve`: one streaming run per variant in `CURVE` (thresholds, delta bits, similarity variants, scales,
  references, protection); perplexity, measured ratio and page counts for each.
- `timing`: per-block compress / decompress time, one block (16 tokens of one KV head, keys and values) at a time,
  median over every block of a real layer (`time.perf_counter`), and the batched decompression the cache does.
  The streaming runs also report the time the cache spent compressing / decompressing per block.

Every ratio is fp16 bytes of the tokens seen / bytes held by the cache's tensors (sum of `nbytes`). The attention is
`hf_kvcache` (it reports the attention mass CPAC ranks pages by, and computes what sdpa computes for other caches).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from hf_kvcache.caches.cpac import CPACCache, CPACLayer, CPACOptions
from hf_kvcache.caches.h2o import H2OLayer
from hf_kvcache.registry import build_cache, cache_names

from .assets import load_model, load_text, load_tokens
from .perplexity import streaming_perplexity

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
def stream_row(model, ids, name: str, options: dict, label: str, chunk: int) -> dict:
    """Streaming perplexity of one cache, with CPAC's page counts, pressure and timing when it is a CPAC cache."""
    cache = DynamicCache(config=model.config) if name == "dynamic" else build_cache(name, model.config, **options)
    r = streaming_perplexity(model, ids, cache, chunk)
    row = {"label": label, "cache": name, "options": options, **r.to_dict()}
    if isinstance(cache, CPACCache):
        stats = cache.memory_stats()
        for k in ("base_pages", "delta_pages", "raw_pages", "pressure", "measured_pressure", "threshold"):
            row[k] = stats[k]
        timing = cache.timing_stats()
        row["compress_ms_per_block"] = timing["compress_ms_per_block"]
        row["decompress_ms_per_block"] = timing["decompress_ms_per_block"]
    return row


def h2o_bytes_per_token(model, ids, chunk: int) -> float:
    """Bytes H2O holds per kept token, per layer, KV head and row, measured on a short stream with a small budget."""
    budget = 64
    cache = build_cache("h2o", model.config, budget=budget)
    streaming_perplexity(model, ids[:, :256], cache, chunk)
    layers = [layer for layer in cache.layers if isinstance(layer, H2OLayer) and layer.slots is not None]
    heads = layers[0].num_heads
    return cache.memory_stats()["bytes"] / (budget * len(layers) * heads)


def with_delta(rows: list[dict], base_ppl: float) -> list[dict]:
    for row in rows:
        row["delta_pct"] = 100.0 * (row["perplexity"] / base_ppl - 1.0)
    return rows


def pressure_section(model, ids, chunk: int, run, log) -> list[dict]:
    rows = [run("dynamic", {}, "dynamic (fp32)")]
    base = rows[0]["perplexity"]
    for name in ("int8", "fp8", "int4"):
        rows.append(run(name, {}, name))
        log(with_delta(rows[-1:], base))
    have_h2o = "h2o" in cache_names() and getattr(model.config, "_attn_implementation", None) == "hf_kvcache"
    per_token = h2o_bytes_per_token(model, ids, chunk) if have_h2o else None
    if not have_h2o:
        print("note: no H2O comparison (needs the 'h2o' cache and attn_implementation='hf_kvcache')", flush=True)
    heads = model.config.num_key_value_heads
    layers = model.config.num_hidden_layers
    for p in PRESSURES:
        row = run("cpac", {"pressure": p}, f"cpac pressure={p}")
        rows.append(row)
        log(with_delta(rows[-1:], base))
        if per_token:
            budget = max(1, round(row["bytes"] / (per_token * layers * heads)))
            rows.append(run("h2o", {"budget": budget}, f"h2o same bytes (budget={budget})"))
            log(with_delta(rows[-1:], base))
    for b in BUDGETS:
        rows.append(run("cpac", {"memory_budget": b}, f"cpac memory_budget={b}"))
        log(with_delta(rows[-1:], base))
    return with_delta(rows, base)


def curve_section(run, only: list[str] | None, log, extra: tuple[str, ...] = ()) -> list[dict]:
    rows = [run("dynamic", {}, "dynamic (fp32)")]
    base = rows[0]["perplexity"]
    for name in extra:  # other registered caches, as reference points on the curve
        rows.append(run(name, {}, name))
        log(with_delta(rows[-1:], base))
    for label, options in CURVE:
        if only and not any(fnmatch.fnmatch(label, pat) for pat in only):
            continue
        rows.append(run("cpac", options, label))
        log(with_delta(rows[-1:], base))
    return with_delta(rows, base)


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


SIM_COLS = [
    ("tensor", "{}", "tensor"),
    ("features", "{}", "features"),
    ("cos_mean", "{:.3f}", "best cos (mean)"),
    (">=0.95", "{:.1%}", ">=0.95"),
    (">=0.85", "{:.1%}", ">=0.85"),
    (">=0.7", "{:.1%}", ">=0.70"),
    ("delta_rel_norm", "{:.3f}", "median |page-base|/|page|"),
]


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


# ---- tables ----------------------------------------------------------------------------------------------------------
RUN_COLS = [
    ("label", "{}", "cache"),
    ("perplexity", "{:.3f}", "ppl"),
    ("delta_pct", "{:+.2f}%", "delta"),
    ("ratio", "{:.2f}x", "ratio"),
    ("bytes", "{:,}", "bytes held"),
    ("base_pages", "{}", "base"),
    ("delta_pages", "{}", "delta"),
    ("raw_pages", "{}", "raw"),
    ("pressure", "{:.2f}", "pressure"),
    ("measured_pressure", "{:.2f}", "measured"),
    ("threshold", "{:.2f}", "thr"),
    ("compress_ms_per_block", "{:.3f}", "comp ms/blk"),
    ("decompress_ms_per_block", "{:.4f}", "decomp ms/blk"),
    ("seconds", "{:.0f}", "s"),
]
TIMING_COLS = [
    ("label", "{}", "variant"),
    ("blocks", "{}", "blocks"),
    ("compress_ms", "{:.3f}", "compress ms/block"),
    ("decompress_ms", "{:.3f}", "decompress ms/block (one at a time)"),
    ("decompress_batched_ms", "{:.4f}", "decompress ms/block (whole layer)"),
]


def pareto(rows: list[dict]) -> list[dict]:
    """Rows no other row beats on both ratio (higher) and perplexity (lower), by ratio."""
    front = [
        r for r in rows
        if not any(o["ratio"] >= r["ratio"] and o["perplexity"] < r["perplexity"] and o is not r for o in rows)
    ]
    return sorted(front, key=lambda r: r["ratio"])


def print_tables(out: dict, args) -> None:
    if "pressure" in out:
        print("\n[pressure] CPAC paper defaults (summary features, 8-bit deltas, page scale) at fixed pressures, "
              "H2O at the same bytes, memory budgets")
        print(table(out["pressure"], RUN_COLS), flush=True)
    if "similarity" in out:
        print(f"\n[similarity] {args.tokens // 16} pages of 16 tokens per layer and KV head; best earlier page by "
              "feature cosine (as if every earlier page were a base); share of pages over each threshold")
        print(table(out["similarity"], SIM_COLS), flush=True)
    if "curve" in out:
        print("\n[curve] variants (p0.9 = fixed pressure 0.9, thrX = threshold X at every pressure)")
        print(table(out["curve"], RUN_COLS), flush=True)
        runs = [r for r in out.get("pressure", []) + out["curve"] if not r["label"].startswith("dynamic")]
        print("\n[curve] Pareto front of every run above (no other run has a higher ratio and a lower perplexity)")
        print(table(pareto(runs), RUN_COLS[:8]), flush=True)
    if "timing" in out:
        print(f"\n[timing] per block = {CPACOptions().page_size} tokens x 1 KV head, keys and values; layer "
              f"{args.timing_layer}, median over its blocks and heads, perf_counter")
        print(table(out["timing"], TIMING_COLS), flush=True)


def table(rows: list[dict], cols) -> str:
    cells = [[h for _, _, h in cols]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else fmt.format(r[k]) for k, fmt, _ in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_kvcache.eval.cpac_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="+", default=["pressure", "similarity", "curve", "timing"],
                        choices=["pressure", "similarity", "curve", "timing"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", default="moby-dick")
    parser.add_argument("--start", type=int, default=5000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--attn", default="hf_kvcache", help="attention implementation (hf_kvcache reports the mass)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared 2-core machine, small ops are much faster unthreaded)")
    parser.add_argument("--only", nargs="*", default=None, help="curve labels to run (fnmatch patterns)")
    parser.add_argument("--timing-layer", type=int, default=15)
    parser.add_argument("--extra-caches", nargs="*", default=[], help="other caches to put on the curve (e.g. int4)")
    parser.add_argument("--json", default=None, help="write every row to this file")
    parser.add_argument("--from-json", default=None, help="print the tables of an earlier --json run, run nothing")
    parser.add_argument("--resume", action="store_true",
                        help="keep the streaming runs already saved in --json (it is rewritten after every run)")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print_tables(json.load(f), args)
        return 0

    import hf_kvcache  # noqa: F401  (registers the caches and the attention)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, attn_implementation=args.attn)
    ids = load_tokens(tokenizer, load_text(args.text), args.start, args.tokens)
    print(f"$ python -m hf_kvcache.eval.cpac_bench {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(f"model={args.model} attn={args.attn} text={args.text} tokens={args.start}:{args.start + args.tokens} "
          f"chunk={args.chunk} torch_threads={torch.get_num_threads()} cpus={os.cpu_count()}", flush=True)

    def log(rows):
        for r in rows:
            print(f"  .. {r['label']}: ppl {r['perplexity']:.3f} ({r.get('delta_pct', 0):+.2f}%) "
                  f"ratio {r['ratio']:.2f}x  {r['seconds']:.0f}s", flush=True)

    saved = {}
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            saved = {(sec, r["label"]): r for sec, rows in json.load(f).items() for r in rows}
    progress: dict[str, list] = {}

    def runner(section: str):
        def run(name: str, options: dict, label: str) -> dict:
            row = saved.get((section, label)) or stream_row(model, ids, name, options, label, args.chunk)
            progress.setdefault(section, []).append(row)
            if args.json:  # a killed run loses at most the run in flight
                with open(args.json, "w") as f:
                    json.dump(progress, f, indent=2, default=str)
            return row

        return run

    out = {}
    if "pressure" in args.sections:
        out["pressure"] = pressure_section(model, ids, args.chunk, runner("pressure"), log)
    if "similarity" in args.sections:
        out["similarity"] = similarity_section(model, ids, args.chunk)
    if "curve" in args.sections:
        out["curve"] = curve_section(runner("curve"), args.only, log, tuple(args.extra_caches))
    if "timing" in args.sections:
        variants = [("paper defaults (8-bit, p0.9)", {"pressure": 0.9}),
                    ("p0.9 b4", {"pressure": 0.9, "delta_bits": 4}),
                    (BEST, dict(CURVE)[BEST])]
        out["timing"] = timing_section(model, ids, args.chunk, args.timing_layer, variants)
    print_tables(out, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
