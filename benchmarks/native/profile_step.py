"""cProfile of single-token decode steps on a filled cache, the model under the attention the cache is read by.

    OMP_NUM_THREADS=1 python benchmarks/native/profile_step.py int8 smollm2-135m [--tokens 2048] [--sort tottime]

The cache spec is one `--caches` word (`dynamic`: transformers' DynamicCache under sdpa; else the cache is bound to the
model and read by the `hf_kvcache` attention, as `generate` runs it). It prefills `--tokens` of Moby Dick in chunks of
512, runs 8 warm-up steps, prints the unprofiled ms of 32 steps, then the profile of 32 more (times under the
profiler are inflated by its per-call cost: compare call counts and the large entries).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from transformers import DynamicCache

from hf_kvcache.eval.assets import load_model, load_text, load_tokens
from hf_kvcache.eval.bench import CacheSpec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache", help="a --caches word, or dynamic")
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumtime, ncalls)")
    p.add_argument("--lines", type=int, default=35)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    ctx = args.tokens
    ids = load_tokens(tok, load_text("moby-dick"), 5000, ctx + 72)
    if args.cache == "dynamic":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache()
    else:
        cache = CacheSpec.parse(args.cache).build(model)
        cache.bind(model)
        model.set_attn_implementation("hf_kvcache")

    def steps(first: int, count: int) -> None:
        for i in range(first, first + count):
            model(input_ids=ids[:, ctx + i : ctx + i + 1], past_key_values=cache, use_cache=True)

    with torch.inference_mode():
        for s in range(0, ctx, 512):
            model(input_ids=ids[:, s : s + 512], past_key_values=cache, use_cache=True)
        steps(0, 8)
        t0 = time.perf_counter()
        steps(8, 32)
        print(f"{args.cache}: {(time.perf_counter() - t0) / 32 * 1e3:.2f} ms a step (unprofiled)")
        profile = cProfile.Profile()
        profile.enable()
        steps(40, 32)
        profile.disable()
    pstats.Stats(profile).sort_stats(args.sort).print_stats(args.lines)


if __name__ == "__main__":
    main()
