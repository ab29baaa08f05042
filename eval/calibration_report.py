"""What `rotation="auto"` chose, layer by layer, and what it cost: streams real text through a tiered cache the way
`generate` runs it (`hf_kvcache.attached`), then prints the perplexity, the ratio and each layer's recipe with the
attention errors of its candidates.

    python -m hf_kvcache.eval.calibration_report --model qwen2.5-coder-0.5b --tokens 2048 --json recipes.json
"""

from __future__ import annotations

import argparse
import json

import torch

import hf_kvcache

from .assets import load_model, load_text, load_tokens
from .rows import write_json
from .perplexity import streaming_perplexity


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="moby-dick")
    p.add_argument("--start", type=int, default=5000)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--cache-config", default="{}", help="TieredQuantCache options as JSON")
    p.add_argument("--json", default=None, help="write cache.recipes() here (reusable as recipes=...)")
    args = p.parse_args(argv)
    model, tokenizer = load_model(args.model)
    ids = load_tokens(tokenizer, load_text(args.text), args.start, args.tokens)
    cache = hf_kvcache.build_cache("tiered", model.config, **json.loads(args.cache_config))
    with torch.inference_mode(), hf_kvcache.attached(model, cache):
        result = streaming_perplexity(model, ids, cache, args.chunk, progress=False)
    print(f"model={args.model} text={args.text} tokens={args.start}:{args.start + args.tokens} chunk={args.chunk}: "
          f"ppl {result.perplexity:.3f}, {result.bytes:,} bytes held, {result.ratio:.2f}x vs fp16")
    recipes = cache.recipes()
    for i, r in enumerate(recipes):
        if r is not None:
            errs = " ".join(f"{k}={v:.4f}" for k, v in r["errors"].items())
            print(f"layer {i:2d}: {r['rotation']:6s} ({r['source']}) {errs}")
    write_json(args.json, recipes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
