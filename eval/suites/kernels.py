"""Decode-attention kernels (`--suite kernels`): the fused attention over KIVI codes vs SDPA over an fp16 cache vs
dequantize-then-SDPA, on random tensors, for each cached length (`--tokens`) and batch size (`--batch`).

Needs a CUDA GPU (torch built with CUDA, triton) to time what it is for: the Triton decode kernel
(kernels/triton_decode.py) on fp16 inputs, against fp16 SDPA, with CUDA events and max_memory_allocated; default
sizes there are 1K..128K tokens at batch 1, 4, 16. Without one it runs on the CPU: the blockwise torch path of
decode_attention on float32 inputs (1K..16K tokens, batch 1 and 4), which says nothing about the GPU kernel.
`--device cuda` without a visible GPU is an error. GPU readiness without a GPU: `hf-kvcache kernel-report`.

Rows, one per variant, length and batch: `cache` (fused / sdpa fp16 (fp32 on the CPU) / dequantize + sdpa),
`tokens`, `batch`, `ms` (median of `--iters` runs after warm-up; CUDA events or perf_counter), `gb_per_s` (bytes
the variant reads / time), `peak_mb` (CUDA max_memory_allocated above the inputs, or on CPU the torch profiler's
allocation events replayed in time order), `vs_sdpa` (sdpa time / this time).
"""

from __future__ import annotations

from dataclasses import dataclass

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from hf_kvcache.kernels.decode_attention import decode_attention
from hf_kvcache.quant.kivi import kivi_key_codes, kivi_value_codes
from hf_kvcache.kernels.segments import QuantSegment

from ..rows import Row, make_row
from .options import SuiteOptions, device_option, option


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
    """Peak CUDA bytes allocated while `fn` runs, above what was allocated before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Median milliseconds of `iters` calls after two warm-up calls."""
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
    """Random query, fp keys / values and their KIVI codes (groups of 32)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=g).to(device, dtype)
    v = torch.randn(batch, kv_heads, tokens, head_dim, generator=g).to(device, dtype)
    kc, ks, kz = kivi_key_codes(k, bits, 32)
    vc, vs, vz = kivi_value_codes(v, bits, 32)
    seg = QuantSegment(kc, ks, kz, vc, vs, vz, bits, bits, 32, 32, head_dim)
    q = torch.randn(batch, kv_heads * group, 1, head_dim, generator=g).to(device, dtype)
    return q, k, v, seg


def pick_device(device: str | None) -> str:
    """`device`, or CUDA when visible, else the CPU; a ValueError for CUDA asked without a GPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA GPU and torch built with CUDA; none is visible here "
                         "(leave --device out to run on the CPU)")
    return device


def time_case(q: torch.Tensor, k16: torch.Tensor, v16: torch.Tensor, seg: QuantSegment, iters: int,
              cuda: bool) -> list[tuple[str, float, float, float]]:
    """(variant, ms, GB/s, peak MB) of the three variants on one case."""

    def fused():
        return decode_attention(q, [seg])[0]

    def sdpa():
        return F.scaled_dot_product_attention(q, k16, v16, enable_gqa=True)

    def dequantize_sdpa():
        return F.scaled_dot_product_attention(q, *seg.dequantize(q.dtype), enable_gqa=True)

    peak_fn = gpu_peak_bytes if cuda else cpu_peak_bytes
    out = []
    for name, fn, nbytes in (("fused", fused, seg.nbytes()),
                             (f"sdpa {'fp16' if cuda else 'fp32'}", sdpa, k16.nbytes + v16.nbytes),
                             ("dequantize + sdpa", dequantize_sdpa, seg.nbytes())):
        ms = time_ms(fn, iters, "cuda" if cuda else "cpu")
        out.append((name, ms, nbytes / ms / 1e6, peak_fn(fn) / 2**20))
    return out


@dataclass
class KernelsOptions(SuiteOptions):
    """`--suite kernels`: decode-attention kernels on random tensors of these shapes."""

    batch: list[int] | None = option(None, "batch sizes (CUDA 1 4 16, CPU 1 4)", type=int, nargs="+")
    kv_heads: int = option(8, "KV heads")
    group: int = option(4, "query heads per KV head")
    head_dim: int = option(128, "head dim")
    bits: int = option(2, "code width of the quantized variants")
    iters: int = option(10, "timed runs per variant (median)")
    device: str | None = device_option()


OPTIONS = KernelsOptions


def run(opts: KernelsOptions) -> list[Row]:
    """Rows of every (batch, tokens), three variants each."""
    device = pick_device(opts.device)
    cuda = device.startswith("cuda")
    lengths = opts.tokens or ([1024, 4096, 16384, 32768, 65536, 131072] if cuda else [1024, 4096, 16384])
    batches = opts.batch or ([1, 4, 16] if cuda else [1, 4])
    dtype = torch.float16 if cuda else torch.float32
    where = torch.cuda.get_device_name() if cuda else "cpu"
    model = (f"random {where} kv_heads={opts.kv_heads} group={opts.group} head_dim={opts.head_dim} "
             f"bits={opts.bits}")
    rows: list[Row] = []
    for batch in batches:
        for tokens in lengths:
            q, k, v, seg = make_case(batch, tokens, opts.kv_heads, opts.group, opts.head_dim, opts.bits, device,
                                     dtype)
            k16, v16 = (k.half(), v.half()) if cuda else (k, v)
            del k, v  # on CUDA only the fp16 copies stay
            timed = time_case(q, k16, v16, seg, opts.iters, cuda)
            del q, k16, v16, seg
            sdpa_ms = timed[1][1]
            rows += [make_row("kernels", name, model, tokens, batch=batch, ms=ms, gb_per_s=gbps, peak_mb=peak,
                              vs_sdpa=sdpa_ms / ms) for name, ms, gbps, peak in timed]
    return rows
