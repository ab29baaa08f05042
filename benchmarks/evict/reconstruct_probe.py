"""Where the time of a reconstruction-scored prefill goes: a plain prefill (DynamicCache, SDPA), then the same
context through an `h2o` cache with the KVzip-like setting of `docs/rows/evict_reconstruct_selection_rule.md`
(addendum 2) at 25 %: its prefill, then `score_context` and the eviction, under cProfile (the top 25 functions by
own time are printed). Kept positions of every layer are saved to `OUT` for a bit-for-bit comparison between commits.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/evict/reconstruct_probe.py qwen2.5-coder-0.5b 4096 OUT.pt

Moby Dick from character 200000, one thread, batch 1.
"""

import cProfile
import pstats
import sys
import time

import torch
from transformers import DynamicCache

from hf_kvcache.caches.evict.reconstruct import held_for_scoring, reconstruction_prompt_ids
from hf_kvcache.eval.assets import load_model, load_text
from hf_kvcache.registry import attached, build_cache

POLICY = {"name": "adakv", "floor": 0.0, "policy": {"name": "reconstruct", "chunk": 2048, "scope": "span",
                                                     "layer_budgets": "joint", "sink_length": 4, "reduce": "max"}}


def main(name: str, tokens: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(name)
    ids = tokenizer(load_text("moby-dick")[200_000:], add_special_tokens=False).input_ids[:tokens]
    context = torch.tensor([ids])
    model(context[:, :64], past_key_values=DynamicCache(config=model.config), use_cache=True)  # first-call setup
    t0 = time.perf_counter()
    model(context, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    print(f"plain prefill {time.perf_counter() - t0:.1f} s", flush=True)
    cache = build_cache("h2o", model.config, budget=0.25, policy=POLICY)
    profile = cProfile.Profile()
    with attached(model, cache):
        profile.enable()
        t0 = time.perf_counter()
        with held_for_scoring(model, cache, context, reconstruction_prompt_ids(tokenizer)):
            model(context, past_key_values=cache, use_cache=True, logits_to_keep=1)
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        profile.disable()
    print(f"held prefill {t1 - t0:.1f} s, scoring + eviction {t2 - t1:.1f} s", flush=True)
    torch.save([layer.held_positions() for layer in cache.layers], out)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
