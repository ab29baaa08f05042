"""Where a decode-attention call spends its time on a GPU: torch.profiler over a few calls of `decode_attention` for
each cache (random bf16 keys / values, the same fill as `hf-kvcache gpu-check`), host syncs reported by
`torch.cuda.set_sync_debug_mode`, and the kernel launched alone beside the whole call.

    python benchmarks/gpu/profile_decode.py --out DIR [--tokens 4096 32768] [--caches int4 tiered kivi] [--python]

Writes `profile_decode.txt` (tables) into DIR. On a CPU it runs the torch path (a check of the script only).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch


def _wall_us(fn, iters: int, cuda: bool) -> tuple[float, float]:
    """(host microseconds per call without waiting, microseconds per call including the GPU), medians."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    host, full = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        full.append((t2 - t0) * 1e6)
    host.sort(), full.sort()
    return host[len(host) // 2], full[len(full) // 2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--caches", nargs="+", default=["int4", "tiered", "kivi"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--python", action="store_true", help="also cProfile 200 calls (host time by Python function)")
    args = p.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from hf_kvcache.eval.gpu_sections import fill_cache
    from hf_kvcache.kernels.decode_attention import decode_attention
    from hf_kvcache.kernels.segments import FullSegment

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    kv_heads, group, d, b = 8, 4, args.head_dim, args.batch
    for tokens in args.tokens:
        g = torch.Generator(device=device).manual_seed(tokens)
        k = torch.randn(b, kv_heads, tokens, d, generator=g, device=device, dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(b, kv_heads * group, 1, d, generator=g, device=device, dtype=dtype)
        new_k = torch.randn(b, kv_heads, 1, d, generator=g, device=device, dtype=dtype)
        new_v = torch.randn_like(new_k)
        for name in args.caches:
            cache, layer = fill_cache(name, k, v)
            segments = [*layer.attention_segments(), FullSegment(new_k, new_v)]
            call = lambda: decode_attention(q, segments)  # noqa: E731
            host_us, full_us = _wall_us(call, args.iters, cuda)
            say(f"## {name}, {tokens} tokens, batch {b}, head dim {d}: host {host_us:.0f} us/call, "
                f"with GPU {full_us:.0f} us/call; segments {[type(s).__name__ for s in segments]}")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    call()
                torch.cuda.set_sync_debug_mode(0)
                syncs = [str(w.message).splitlines()[0][:160] for w in caught]
                say(f"host syncs in one call: {len(syncs)} {syncs[:5]}")
            if args.python:
                import cProfile
                import io
                import pstats

                prof_py = cProfile.Profile()
                prof_py.enable()
                for _ in range(200):
                    call()
                prof_py.disable()
                text = io.StringIO()
                pstats.Stats(prof_py, stream=text).sort_stats("tottime").print_stats(25)
                say("Python functions over 200 calls, by own time:")
                say(text.getvalue())
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts, with_stack=False) as prof:
                for _ in range(5):
                    call()
                if cuda:
                    torch.cuda.synchronize()
            say("ops over 5 calls, by self CPU time:")
            say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
            if cuda:
                say("by CUDA time:")
                say(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15,
                                              max_name_column_width=60))
            del cache, layer, segments
        del k, v
        if cuda:
            torch.cuda.empty_cache()
    (args.out / "profile_decode.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
