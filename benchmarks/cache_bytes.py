"""Where a cache's bytes go after a long prompt: one recorded full-cache prefill of real text, replayed into each
cache (`hf_kvcache.eval.replay`), then a short continuation and a few greedy steps, as a query-agnostic RULER sample
runs; prints each cache's ratio vs fp16 after the prefill and at the end, its bytes per tier and per layer, and the
rotation each layer's calibration chose.

    OMP_NUM_THREADS=2 python benchmarks/cache_bytes.py --model gemma3-270m --tokens 8192 \
        tiered 'other=tiered:{"hybrid_full": {"archive_bits": 3}}'
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from hf_kvcache.eval.assets import load_model, load_text, load_tokens
from hf_kvcache.eval.bench import CacheSpec
from hf_kvcache.eval.replay import PrefillReplay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("caches", nargs="+", help="cache specs as `compare --caches` takes them")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--text", default="moby-dick")
    ap.add_argument("--start", type=int, default=40000, help="first token of the text window")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length")
    ap.add_argument("--continuation", type=int, default=48, help="tokens fed after the prompt in one forward")
    ap.add_argument("--steps", type=int, default=16, help="greedy single-token steps after the continuation")
    a = ap.parse_args()
    model, tok = load_model(a.model, attn_implementation="sdpa")
    ids = load_tokens(tok, load_text(a.text), start=a.start, count=a.tokens + a.continuation)
    prompt, more = ids[:, : a.tokens], ids[:, a.tokens :]
    prefill = PrefillReplay(prompt[0].tolist())
    full = DynamicCache(config=model.config)
    with torch.no_grad(), prefill.recording(full):
        model(prompt, past_key_values=full)
    for text in a.caches:
        spec = CacheSpec.parse(text)
        cache = spec.build(model)
        if not prefill.replay(cache):
            raise SystemExit(f"{spec.label}: this cache cannot take a replayed prefill")
        after_prefill = cache.memory_stats()["ratio"]
        with torch.no_grad():
            nxt = model(more, past_key_values=cache).logits[:, -1:].argmax(-1)
            for _ in range(a.steps):
                nxt = model(nxt, past_key_values=cache).logits[:, -1:].argmax(-1)
        s = cache.memory_stats()
        tiers = s.get("tiers", {})
        print(f"{spec.label}: {after_prefill:.3f}x after the prompt, {s['ratio']:.3f}x at the end, {s['bytes']} bytes;"
              f" per tier {({t: d['bytes'] for t, d in tiers.items()})}")
        print("  bytes per layer", [layer.nbytes() for layer in cache.layers])
        if hasattr(cache, "recipes"):
            print("  rotations", [(r or {}).get("rotation") for r in cache.recipes()])


if __name__ == "__main__":
    main()
