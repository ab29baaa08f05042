"""End-to-end decoding on a filled cache: tokens/s and the peak memory of one decode step, side by side.

    python -m hf_kvcache.eval.fused_bench --context 4096 --steps 64

Variants: DynamicCache; transformers' QuantizedCache (quanto, 2 bits) when optimum-quanto is installed; the tiered
cache read through the dequantize path (`attn_implementation="sdpa"`: the layer expands its past every step); the same
cache read by the fused attention (`attn_implementation="hf_kvcache"`). The context (Moby Dick) is prefilled in chunks,
then `--steps` single-token steps are timed on the following text tokens (tokens/s: steps / their total time, so
the steps that move groups between tiers count). Peak memory of one step: CUDA
max_memory_allocated above what was allocated before, or on CPU the torch profiler's allocation events replayed in
time order. Every variant runs in this one process, one after the other.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from hf_kvcache.registry import build_cache

from .assets import load_model, load_text, load_tokens
from .bench import CacheSpec
from .kernel_bench import cpu_peak_bytes, gpu_peak_bytes
from hf_kvcache.caches.base import memory_stats
from hf_kvcache.kernels.blockwise import scratch_bytes


def variants(tiered_options: dict, peers: bool = True) -> list[tuple[str, str, CacheSpec]]:
    out = [("DynamicCache", "sdpa", CacheSpec("dynamic"))]
    if peers and importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto"):
        out.append(("HF QuantizedCache quanto 2-bit", "sdpa", CacheSpec("hf-quanto", {"nbits": 2, "q_group_size": 32,
                                                                                      "axis_key": 0, "axis_value": 0})))
    out.append(("tiered, dequantize + SDPA", "sdpa", CacheSpec("tiered", tiered_options)))
    out.append(("tiered, fused (hf_kvcache)", "hf_kvcache", CacheSpec("tiered", tiered_options)))
    return out


@torch.inference_mode()
def measure(model, spec: CacheSpec, attn: str, ids: torch.Tensor, context: int, steps: int, chunk: int) -> dict:
    model.set_attn_implementation(attn)
    try:
        cache = spec.build(model)
        for s in range(0, context, chunk):
            model(input_ids=ids[:, s : min(s + chunk, context)], past_key_values=cache, use_cache=True)
        step_ids = ids[:, context:]
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            model(input_ids=step_ids[:, i : i + 1], past_key_values=cache, use_cache=True)
            if ids.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        one_step = lambda: model(input_ids=step_ids[:, steps : steps + 1], past_key_values=cache, use_cache=True)
        peak = gpu_peak_bytes(one_step) if ids.is_cuda else cpu_peak_bytes(one_step)
        stats = memory_stats(cache)
    finally:
        model.set_attn_implementation("sdpa")
    # mean over the steps, so that the steps that move groups between tiers count too
    return {"tokens_per_s": len(times) / sum(times), "median_tokens_per_s": 1.0 / statistics.median(times), "step_peak_bytes": peak, "cache_bytes": stats["bytes"],
            "ratio": stats["ratio"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="moby-dick")
    p.add_argument("--start", type=int, default=5000)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--tiered", default="{}", help="JSON options of the tiered cache")
    p.add_argument("--device", default=None)
    p.add_argument("--no-peers", action="store_true", help="skip transformers' QuantizedCache")
    args = p.parse_args(argv)
    import json

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_model(args.model, dtype=torch.float16 if device == "cuda" else torch.float32)
    model.to(device)
    ids = load_tokens(tok, load_text(args.text), args.start, args.context + args.steps + 1).to(device)
    print(f"model={args.model} device={device} context={args.context} tokens, {args.steps} timed decode steps")
    print(f"{'variant':34s} {'tok/s':>8s} {'step peak MB':>13s} {'cache MB':>9s} {'vs fp16':>8s}")
    rows = []
    for name, attn, spec in variants(json.loads(args.tiered), peers=not args.no_peers):
        r = measure(model, spec, attn, ids, args.context, args.steps, args.chunk)
        rows.append((name, r))
        print(f"{name:34s} {r['tokens_per_s']:8.2f} {r['step_peak_bytes'] / 2**20:13.2f} "
              f"{r['cache_bytes'] / 2**20:9.2f} {r['ratio']:7.2f}x", flush=True)
    by = dict(rows)
    fused, deq = by.get("tiered, fused (hf_kvcache)"), by.get("tiered, dequantize + SDPA")
    if fused and deq:
        print(f"fused / dequantize: tokens/s {fused['tokens_per_s'] / deq['tokens_per_s']:.2f}x, "
              f"step peak memory {fused['step_peak_bytes'] / deq['step_peak_bytes']:.2f}x")
    dyn = by.get("DynamicCache")
    if fused and dyn:
        print(f"fused / DynamicCache: tokens/s {fused['tokens_per_s'] / dyn['tokens_per_s']:.2f}x")
    if not ids.is_cuda:
        print(f"the CPU fused path also holds {scratch_bytes() / 2**20:.2f} MB of reusable scratch (O(block), "
              "allocated once, not per step)")


if __name__ == "__main__":
    main()
