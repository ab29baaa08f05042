"""Decode-attention benchmark: fused attention over 2-bit KIVI codes vs SDPA over an fp16 cache vs
dequantize-then-SDPA, for several cached lengths and batch sizes; effective bandwidth = bytes read / time.

    python -m hf_kvcache.eval.kernel_bench                      # CUDA if present, else the CPU torch path
    python -m hf_kvcache.eval.kernel_bench --tokens 1024 4096 --batch 1 4 --device cpu

Timing: CUDA events (GPU) or perf_counter (CPU), median of `--iters` runs after warm-up. Peak memory: the CUDA
allocator's max_memory_allocated above the inputs, or on CPU the torch profiler's allocation events replayed in time
order (`cpu_peak_bytes`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from hf_kvcache.kernels.decode_attention import decode_attention
from hf_kvcache.kernels.kivi_pack import kivi_quantize_keys, kivi_quantize_values
from hf_kvcache.kernels.segments import QuantSegment


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated by torch on the CPU while `fn` runs (profiler memory events, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def gpu_peak_bytes(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make_case(batch: int, tokens: int, kv_heads: int, group: int, head_dim: int, bits: int, device: str,
              dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=g).to(device, dtype)
    v = torch.randn(batch, kv_heads, tokens, head_dim, generator=g).to(device, dtype)
    kc, ks, kz = kivi_quantize_keys(k, bits, 32)
    vc, vs, vz = kivi_quantize_values(v, bits, 32)
    seg = QuantSegment(kc, ks, kz, vc, vs, vz, bits, bits, 32, 32, head_dim)
    q = torch.randn(batch, kv_heads * group, 1, head_dim, generator=g).to(device, dtype)
    return q, k, v, seg


def run(tokens_list, batches, kv_heads=8, group=4, head_dim=128, bits=2, iters=10, device=None):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device == "cuda" else torch.float32
    peak_fn = gpu_peak_bytes if device == "cuda" else cpu_peak_bytes
    rows = []
    for batch in batches:
        for tokens in tokens_list:
            q, k, v, seg = make_case(batch, tokens, kv_heads, group, head_dim, bits, device, dtype)
            k16, v16 = k.half() if device == "cuda" else k, v.half() if device == "cuda" else v
            del k, v

            def fused():
                return decode_attention(q, [seg])[0]

            def sdpa():
                return F.scaled_dot_product_attention(q, k16, v16, enable_gqa=True)

            def dequant_sdpa():
                kd, vd = seg.dequantize(q.dtype)
                return F.scaled_dot_product_attention(q, kd, vd, enable_gqa=True)

            row = {"batch": batch, "tokens": tokens, "bits": bits}
            for name, fn, nbytes in (("fused", fused, seg.nbytes()), ("sdpa_fp16", sdpa, k16.nbytes + v16.nbytes),
                                     ("dequant_sdpa", dequant_sdpa, seg.nbytes())):
                ms = time_ms(fn, iters, device)
                row[f"{name}_ms"] = ms
                row[f"{name}_GBps"] = nbytes / ms / 1e6
                row[f"{name}_peak_MB"] = peak_fn(fn) / 2**20
            row["speedup_vs_sdpa"] = row["sdpa_fp16_ms"] / row["fused_ms"]
            row["speedup_vs_dequant"] = row["dequant_sdpa_ms"] / row["fused_ms"]
            rows.append(row)
            print(format_row(row), flush=True)
            del q, k16, v16, seg
    return rows


HEADER = (f"{'batch':>5} {'tokens':>7} | {'fused ms':>9} {'GB/s':>7} {'peak MB':>8} | {'sdpa16 ms':>9} {'GB/s':>7} "
          f"{'peak MB':>8} | {'deq+sdpa ms':>11} {'peak MB':>8} | {'vs sdpa':>7} {'vs deq':>6}")


def format_row(r: dict) -> str:
    return (f"{r['batch']:>5} {r['tokens']:>7} | {r['fused_ms']:>9.3f} {r['fused_GBps']:>7.1f} "
            f"{r['fused_peak_MB']:>8.1f} | {r['sdpa_fp16_ms']:>9.3f} {r['sdpa_fp16_GBps']:>7.1f} "
            f"{r['sdpa_fp16_peak_MB']:>8.1f} | {r['dequant_sdpa_ms']:>11.3f} {r['dequant_sdpa_peak_MB']:>8.1f} | "
            f"{r['speedup_vs_sdpa']:>6.2f}x {r['speedup_vs_dequant']:>5.2f}x")


NEEDS = """needs: a CUDA GPU (torch built with CUDA, triton) to time what it is for: the Triton decode kernel
(kernels/triton_decode.py) on fp16 inputs, against fp16 SDPA, with CUDA events and max_memory_allocated; default
sizes there are 1K..128K tokens at batch 1, 4, 16. Without one it runs on the CPU: the blockwise torch path of
decode_attention on float32 inputs (1K..16K tokens, batch 1 and 4), which says nothing about the GPU kernel.
--device cuda without a visible GPU stops with an error. For GPU readiness without a GPU (registers, spills,
occupancy of every kernel variant compiled for sm_90, and a bytes roofline) run python -m hf_kvcache.eval.kernel_report."""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=NEEDS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=None)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU and torch built with CUDA; none is visible here "
                "(leave --device out to run the CPU path)")
    tokens = args.tokens or ([1024, 4096, 16384, 32768, 65536, 131072] if device == "cuda" else [1024, 4096, 16384])
    batches = args.batch or ([1, 4, 16] if device == "cuda" else [1, 4])
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device={name} kv_heads={args.kv_heads} group={args.group} head_dim={args.head_dim} bits={args.bits}")
    print(HEADER)
    run(tokens, batches, args.kv_heads, args.group, args.head_dim, args.bits, args.iters, device)


if __name__ == "__main__":
    main()
