"""Time to the first decode step after a chunked prompt: where the `tiered` default calibrates when the prompt
reaches `calibration_positions` only with its last (short) update.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/first_step_time.py [--model smollm2-135m] [--tokens 2048] \
        [--caches dynamic tiered 'name=tiered:{...}']

Per repetition and cache (by default DynamicCache, then `tiered`): the prompt in 512-token forwards, one decode step,
then 8 more, each timed; a plain loop of `model(...)` calls on one thread. The rows go to stdout.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_kvcache.eval.assets import load_model, load_text, load_tokens
from hf_kvcache.eval.bench import CacheSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--caches", nargs="+", default=["dynamic", "tiered"], help="cache specs, as `compare --caches`")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    ids = load_tokens(tok, load_text("moby-dick"), 5000, args.tokens + 16)
    for _ in range(args.repeats):
        for text in args.caches:
            spec = CacheSpec.parse(text)
            cache = spec.build(model)
            if hasattr(cache, "bind"):
                cache.bind(model)
            model.set_attn_implementation("sdpa" if spec.name == "dynamic" else "hf_kvcache")
            with torch.inference_mode():
                t0 = time.perf_counter()
                for s in range(0, args.tokens, 512):
                    model(input_ids=ids[:, s : min(s + 512, args.tokens)], past_key_values=cache, use_cache=True)
                t1 = time.perf_counter()
                model(input_ids=ids[:, args.tokens : args.tokens + 1], past_key_values=cache, use_cache=True)
                t2 = time.perf_counter()
                for i in range(8):
                    step = ids[:, args.tokens + 1 + i : args.tokens + 2 + i]
                    model(input_ids=step, past_key_values=cache, use_cache=True)
                t3 = time.perf_counter()
            print(f"{spec.label:8s} prefill {t1 - t0:.2f} s  first step {t2 - t1:.2f} s  next 8 steps {t3 - t2:.2f} s",
                  flush=True)


if __name__ == "__main__":
    main()
