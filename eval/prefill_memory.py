"""Peak memory of `generate` with a long prompt, per cache: the RSS high-water mark above the loaded model.

    python -m hf_kvcache.eval.prefill_memory --tokens 8192 16384 --caches dynamic tiered kivi

Each (cache, prompt length) runs in a fresh process: load the model, generate once from a short prompt (warm-up), return
freed heap to the system (`malloc_trim`), reset the kernel's high-water mark
(`/proc/self/clear_refs`, Linux), generate `--new` tokens after a real-text prompt, and report `VmHWM - VmRSS before`
(bytes the run added at its peak: the cache, the prefill's activations and anything dequantized on the way).
Caches of this library prefill in chunks of their `prefill_chunk_size` (512); `dynamic` prefills in one forward, as
transformers does by default, `dynamic-chunked` is DynamicCache with the same chunked prefill.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys

from .rows import write_json


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no {field}; this measurement needs Linux")


def measure_one(model_name: str, spec: str, tokens: int, new: int, start: int, chunk: int | None = None) -> dict:
    """Run in this process: peak RSS added by one generate (see the module docstring)."""
    import time

    import torch

    import hf_kvcache  # noqa: F401
    from hf_kvcache.caches.base import CompressedCache, memory_stats
    from hf_kvcache.eval import load_model, load_text, load_tokens
    from hf_kvcache.eval.bench import CacheSpec

    model, tokenizer = load_model(model_name)
    ids = load_tokens(tokenizer, load_text("moby-dick"), start, tokens)
    with torch.no_grad():  # warm-up: one-time allocations (kernels, thread pools) must not count
        model.generate(ids[:, :64], max_new_tokens=2, do_sample=False)
    plain = spec in ("dynamic", "dynamic-chunked")
    cache = None if plain else CacheSpec.parse(spec).build(model)
    if chunk is not None and hasattr(cache, "prefill_chunk_size"):
        cache.prefill_chunk_size = chunk
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the baseline RSS is what is live
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    with torch.no_grad():
        kwargs = {} if cache is None else {"past_key_values": cache}
        if spec == "dynamic-chunked":  # DynamicCache with the same chunked prefill our caches use
            kwargs["prefill_chunk_size"] = chunk or CompressedCache.prefill_chunk_size
        out = model.generate(ids, max_new_tokens=new, do_sample=False, **kwargs)
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    stats = memory_stats(cache) if cache is not None else {}  # peers (transformers' caches) too
    return {"cache": spec, "tokens": tokens, "peak_added_bytes": (peak - before) * 1024, "seconds": seconds,
            "cache_bytes": stats.get("bytes"), "new_tokens": int(out.shape[1] - ids.shape[1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_kvcache.eval.prefill_memory", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--caches", nargs="+", default=["dynamic", "dynamic-chunked", "tiered", "kivi"])
    p.add_argument("--new", type=int, default=8, help="tokens generated after the prompt")
    p.add_argument("--start", type=int, default=5000, help="first prompt token in Moby Dick")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill chunk of our caches and dynamic-chunked "
                   "(default: the caches' prefill_chunk_size, 512)")
    p.add_argument("--json", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: measure in this process
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.model, args.caches[0], args.tokens[0], args.new, args.start,
                                     args.prefill_chunk)))
        return 0
    rows = []
    for tokens in args.tokens:
        for spec in args.caches:
            cmd = [sys.executable, "-m", "hf_kvcache.eval.prefill_memory", "--one", "--model", args.model,
                   "--tokens", str(tokens), "--caches", spec, "--new", str(args.new), "--start", str(args.start)]
            cmd += ["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []
            res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            if res.returncode:
                raise ValueError(f"{spec} at {tokens} tokens failed:\n{res.stderr[-2000:]}")
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{tokens:>6} {spec:<12} peak +{r['peak_added_bytes'] / 2**20:8.1f} MiB  cache "
                  f"{(r['cache_bytes'] or 0) / 2**20:7.1f} MiB  {r['seconds']:.0f}s", flush=True)
    print("\n| prompt | cache | peak RSS above the loaded model | vs DynamicCache | bytes the cache holds |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        base = next(b for b in rows if b["tokens"] == r["tokens"] and b["cache"] == "dynamic")["peak_added_bytes"] \
            if any(b["cache"] == "dynamic" and b["tokens"] == r["tokens"] for b in rows) else None
        vs = f"{r['peak_added_bytes'] / base:.2f}x" if base else "-"
        held = f"{r['cache_bytes'] / 2**20:.1f} MiB" if r["cache_bytes"] else "-"
        print(f"| {r['tokens']} | {r['cache']} | {r['peak_added_bytes'] / 2**20:.1f} MiB | {vs} | {held} |")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
