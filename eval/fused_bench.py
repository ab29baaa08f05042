"""End-to-end decoding on a filled cache: tokens/s and the peak memory of one decode step, side by side.

    python -m hf_kvcache.eval.fused_bench --context 4096 --steps 64

Variants: DynamicCache; transformers' QuantizedCache (quanto, 2 bits) when optimum-quanto is installed; the tiered
cache read through the dequantize path (`attn_implementation="sdpa"`: the layer expands its past every step); the same
cache read by the fused attention (`attn_implementation="hf_kvcache"`). The context (Moby Dick) is prefilled in chunks,
then `--steps` single-token steps are timed on the following text tokens, the variants taking turns every 8 steps
(tokens/s: steps / their total time, so the steps that move groups between tiers count). Peak memory of one step: CUDA
max_memory_allocated above what was allocated before, or on CPU the torch profiler's allocation events replayed in
time order. Every variant runs in this one process.
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
def measure_interleaved(model, rows: list[tuple[str, str, CacheSpec]], ids: torch.Tensor, context: int, steps: int,
                        chunk: int, round_steps: int = 8) -> dict[str, dict]:
    """Prefill one cache per variant, then time their decode steps in turns of `round_steps` (A B C A B C ...), so
    that a slow spell of the machine hits every variant alike. Tokens/s: steps / their total time (the steps that
    move groups between tiers count). Then one more step per variant under the peak-memory probe."""
    caches = {}
    for name, attn, spec in rows:
        model.set_attn_implementation(attn)
        caches[name] = spec.build(model)
        for s in range(0, context, chunk):
            model(input_ids=ids[:, s : min(s + chunk, context)], past_key_values=caches[name], use_cache=True)
    step_ids = ids[:, context:]
    times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    try:
        for r0 in range(0, steps, round_steps):
            for name, attn, _ in rows:
                model.set_attn_implementation(attn)
                for i in range(r0, min(r0 + round_steps, steps)):
                    t0 = time.perf_counter()
                    model(input_ids=step_ids[:, i : i + 1], past_key_values=caches[name], use_cache=True)
                    if ids.is_cuda:
                        torch.cuda.synchronize()
                    times[name].append(time.perf_counter() - t0)
        out = {}
        for name, attn, _ in rows:
            model.set_attn_implementation(attn)
            cache = caches[name]
            one_step = lambda: model(input_ids=step_ids[:, steps : steps + 1], past_key_values=cache, use_cache=True)
            peak = gpu_peak_bytes(one_step) if ids.is_cuda else cpu_peak_bytes(one_step)
            stats = memory_stats(cache)
            t = times[name]
            out[name] = {"tokens_per_s": len(t) / sum(t), "median_tokens_per_s": 1.0 / statistics.median(t),
                         "step_peak_bytes": peak, "cache_bytes": stats["bytes"], "ratio": stats["ratio"]}
    finally:
        model.set_attn_implementation("sdpa")
    return out


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
    print(f"{'variant':34s} {'tok/s':>8s} {'median':>8s} {'step peak MB':>13s} {'cache MB':>9s} {'vs fp16':>8s}")
    chosen = variants(json.loads(args.tiered), peers=not args.no_peers)
    results = measure_interleaved(model, chosen, ids, args.context, args.steps, args.chunk)
    for name, _, _ in chosen:
        r = results[name]
        print(f"{name:34s} {r['tokens_per_s']:8.2f} {r['median_tokens_per_s']:8.2f} {r['step_peak_bytes'] / 2**20:13.2f} "
              f"{r['cache_bytes'] / 2**20:9.2f} {r['ratio']:7.2f}x", flush=True)
    rows = list(results.items())
    by = dict(rows)
    fused, deq = by.get("tiered, fused (hf_kvcache)"), by.get("tiered, dequantize + SDPA")
    if fused and deq:
        print(f"fused / dequantize: tokens/s {fused['tokens_per_s'] / deq['tokens_per_s']:.2f}x, "
              f"step peak memory {fused['step_peak_bytes'] / deq['step_peak_bytes']:.2f}x")
    dyn = by.get("DynamicCache")
    if fused and dyn:
        print(f"fused / DynamicCache: tokens/s {fused['tokens_per_s'] / dyn['tokens_per_s']:.2f}x "
              f"(medians: {fused['median_tokens_per_s'] / dyn['median_tokens_per_s']:.2f}x)")
    if not ids.is_cuda:
        print(f"the CPU fused path also holds {scratch_bytes() / 2**20:.2f} MB of reusable scratch (O(block), "
              "allocated once, not per step)")


if __name__ == "__main__":
    main()
