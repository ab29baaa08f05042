"""A uniform cache's decode step with its codes appended into spare rows (`quant.rows.RowBuffer`, the default)
against the same cache appending by `TokenRows.cat` (every held row copied each step), and DynamicCache, in one
process, taking turns.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/append_rows.py [--model smollm2-135m] [--tokens 2048] \
        [--caches int8 int4] [--rounds 12] [--steps 16]

Each cache prefills `--tokens` tokens of Moby Dick (from 5000) in 512-token forwards under the fused attention;
then, in rounds, each cache in turn decodes `--steps` teacher-forced tokens. Printed per cache: the median of its
rounds' tokens/s and the median (min, max) over the rounds of its tokens/s over DynamicCache's in the same round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from hf_kvcache.eval.assets import load_model, load_text, load_tokens
from hf_kvcache.eval.bench import CacheSpec

from hf_kvcache.quant.rows import RowBuffer
from hf_kvcache.registry import attached


class CatRows(RowBuffer):
    """Appends by `TokenRows.cat`, as before `RowBuffer`: every held row copied at every step."""

    def append(self, held, new):
        return new if held is None else held.cat(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--caches", nargs="+", default=["int8", "int4"])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model, attn_implementation="hf_kvcache")
    n, steps = args.tokens, args.steps
    ids = load_tokens(tok, load_text("moby-dick"), 5000, n + args.rounds * steps)
    caches = {"DynamicCache": CacheSpec.parse("dynamic").build(model)}
    for spec in args.caches:
        caches[f"{spec}, spare rows"] = CacheSpec.parse(spec).build(model)
        caches[f"{spec}, cat"] = cat = CacheSpec.parse(spec).build(model)
        for layer in cat.layers:
            layer.key_buffer, layer.value_buffer = CatRows(), CatRows()
    with torch.inference_mode():
        for cache in caches.values():
            with attached(model, cache):
                for s in range(0, n, 512):
                    model(ids[:, s : min(n, s + 512)], past_key_values=cache, use_cache=True, logits_to_keep=1)
        speed = {name: [] for name in caches}
        for r in range(args.rounds):
            at = n + r * steps
            for name, cache in caches.items():
                with attached(model, cache):
                    t0 = time.perf_counter()
                    for i in range(at, at + steps):
                        model(ids[:, i : i + 1], past_key_values=cache, use_cache=True)
                    speed[name].append(steps / (time.perf_counter() - t0))
    print(f"{args.model}, {n} tokens, {args.rounds} rounds of {steps} steps")
    for name, tps in speed.items():
        ratios = [a / b for a, b in zip(tps, speed["DynamicCache"])]
        print(f"{name:24s} {statistics.median(tps):6.2f} tok/s   vs DynamicCache {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}, {max(ratios):.3f})")


if __name__ == "__main__":
    main()
