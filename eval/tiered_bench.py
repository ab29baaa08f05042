"""Tiered / KIVI benchmarks: the side-by-side table against transformers' QuantizedCache, and the 2-bit ablations.

    python -m hf_kvcache.eval.tiered_bench --suite peers --tokens 2048
    python -m hf_kvcache.eval.tiered_bench --suite ablations --tokens 2048
    python -m hf_kvcache.eval.tiered_bench --caches dynamic tiered 'kivi:{"bits":4}' --tokens 4096

Same measurement as `hf-kvcache bench` (streaming perplexity of Moby Dick through the cache, chunk 32, bytes really
held, ratio vs fp16, decode tokens/s after the stream), but the model is loaded once and every row is printed as soon
as it is measured (the peers re-quantize their whole cache at every flush and take minutes at 4096 tokens).
"""

from __future__ import annotations

import argparse
import sys

import torch

from .assets import load_model, load_text, load_tokens
from .bench import CacheSpec, decode_tokens_per_s, format_table, write_json
from .perplexity import streaming_perplexity

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

SUITES = {"peers": PEERS, "ablations": ABLATIONS}


def run(specs: list[CacheSpec], model_name: str, text: str, start: int, tokens: int, chunk: int, decode_steps: int,
        out=sys.stdout) -> list[dict]:
    torch.manual_seed(0)
    model, tokenizer = load_model(model_name)
    ids = load_tokens(tokenizer, load_text(text), start, tokens + decode_steps)
    stream, extra = ids[:, :tokens], ids[:, tokens:]
    rows: list[dict] = []
    for spec in specs:
        cache = spec.build(model)
        r = streaming_perplexity(model, stream, cache, chunk)
        row = {"cache": spec.label, **r.to_dict()}
        stats = cache.memory_stats() if hasattr(cache, "memory_stats") else {}
        if "tiers" in stats:
            row["tiers"] = stats["tiers"]
        if decode_steps:
            row["decode_tokens_per_s"] = decode_tokens_per_s(model, cache, extra)
        row["delta_pct"] = 100.0 * (row["perplexity"] / rows[0]["perplexity"] - 1.0) if rows else 0.0
        rows.append(row)
        print(
            f"[{len(rows)}/{len(specs)}] {row['cache']}: ppl {row['perplexity']:.3f} ({row['delta_pct']:+.2f}%), "
            f"{row['bytes']:,} bytes, {row['ratio']:.2f}x"
            + (f", decode {row['decode_tokens_per_s']:.1f} tok/s" if decode_steps else ""),
            file=out, flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    import hf_kvcache  # noqa: F401  (registers the cache names)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default=None)
    p.add_argument("--caches", nargs="+", default=None, help="specs as in `hf-kvcache bench` (after the suite's)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="moby-dick")
    p.add_argument("--start", type=int, default=5000)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = (SUITES[args.suite] if args.suite else []) + (args.caches or [])
    if not texts:
        p.error("give --suite and/or --caches")
    specs = [CacheSpec.parse(t) for t in texts]
    rows = run(specs, args.model, args.text, args.start, args.tokens, args.chunk, args.decode_steps)
    print(
        f"\nmodel={args.model} text={args.text} tokens={args.start}:{args.start + args.tokens} chunk={args.chunk} "
        f"threads={args.threads} (delta vs {specs[0].label})"
    )
    print(format_table(rows))
    if any("tiers" in r for r in rows):
        print("\ntiers (bytes / tokens per layer):")
        for r in rows:
            if "tiers" in r:
                parts = [f"{n} {t['bytes']:,} B / {t['tokens']}" for n, t in r["tiers"].items() if t["tokens"]]
                print(f"  {r['cache']}: " + ", ".join(parts))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
