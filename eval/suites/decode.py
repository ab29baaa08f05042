"""End-to-end decoding on a filled cache (`--suite decode`): tokens/s and the peak memory of one decode step.

Caches (`--caches`; default DynamicCache, transformers' QuantizedCache quanto 2-bit when optimum-quanto is installed,
and the tiered defaults) each prefill `--tokens` tokens of the text in chunks of `--chunk` (512). A cache the fused
attention reads in place (`reads_fused`: tiered, KIVI, int8 / int4 / fp8) runs twice: through the dequantize path (`sdpa`: the layer
expands its past every step) and through the fused attention (`hf_kvcache`); on the CPU, where the compiled kernel
(`kernels/native.py`) is available, a third time through the fused attention's torch path. Then `--decode-steps`
(64) single-token steps are timed (an evicting cache, `needs_attention_mass`, under the `hf_kvcache` attention that
reports what it ranks tokens by) on the following tokens, the variants taking turns every 8 steps so that a slow
spell of the machine hits every variant alike. Every variant runs in this one process; fp16 on CUDA, fp32 on the CPU.

Rows: `prefill_tokens_per_s` (the context / the time of its chunks; the variants prefill chunk by chunk in turns)
and `prefill_vs_first`, `decode_tokens_per_s` (steps / their total time, so the steps that move groups between tiers
count),
`median_tokens_per_s` (1 / median step), `step_peak_mb` (one more step under the peak-memory probe: CUDA
max_memory_allocated above what was allocated before, or on CPU the torch profiler's allocation events replayed in time
order), `cache_mb`, `ratio` (vs fp16), `vs_first` (tokens/s vs the first variant) with `vs_first_low` /
`vs_first_high`, its 95 % paired interval over the rounds of 8 steps (`round_seconds`: each round's summed step times;
`paired.paired_time_ratio`), `first_round_s` (the first round's seconds: a calibrating cache calibrates in its
first step after a chunked prompt) and, from three rounds, `steady_vs_first` with its interval (the same ratio over
the rounds after the first), on fused rows `vs_dequantize`
(tokens/s vs the same cache's dequantize row) and, on the CPU, `scratch_mb` (the reusable O(block) scratch the CPU
fused path holds, allocated once, and the float32 weights of the subspace bases its kernel keeps).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import statistics
import time
from dataclasses import dataclass

import torch
from hf_kvcache.kernels import native, native_subspace
from hf_kvcache.kernels.blockwise import scratch_bytes

from hf_kvcache.caches.base import memory_stats
from hf_kvcache.transformers_compat import cache_kwargs

from ..assets import load_model, load_text, load_tokens
from ..bench import CacheSpec, parse_specs
from ..paired import paired_time_ratio
from ..rows import Row, make_row
from .options import SuiteOptions, decode_steps_option, device_option
from .kernels import cpu_peak_bytes, gpu_peak_bytes, pick_device

QUANTO_2 = 'HF QuantizedCache quanto 2-bit=hf-quanto:{"nbits": 2, "q_group_size": 32, "axis_key": 0, "axis_value": 0}'


def default_caches() -> list[str]:
    """DynamicCache, quanto 2-bit where optimum-quanto is installed, the tiered defaults."""
    quanto = importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto")
    return ["DynamicCache=dynamic"] + ([QUANTO_2] if quanto else []) + ["tiered"]


@dataclass(frozen=True)
class Variant:
    """One timed configuration: a cache spec run under an attention implementation (and, for the fused attention on
    the CPU, with or without the compiled kernel)."""

    label: str
    attn: str  # the attention implementation the model runs
    spec: CacheSpec
    native: bool = True  # False: the fused attention keeps its torch path (`native.turned_off`)
    fused: bool = False  # the cache is bound to the model: the fused attention reads its codes in place

    def running(self):
        return contextlib.nullcontext() if self.native else native.turned_off()


def variants(model, specs: list[CacheSpec], device: str = "cpu") -> list[Variant]:
    """Every cache through sdpa (evicting caches through the "hf_kvcache" attention, which reports what they rank by);
    fused-readable ones also fused (on the CPU with the compiled kernel, and through the torch path too where that
    kernel is available)."""
    out = []
    for spec in specs:
        cache = spec.build(model)
        if getattr(cache, "reads_fused", False):
            out += [Variant(f"{spec.label}, dequantize + SDPA", "sdpa", spec),
                    Variant(f"{spec.label}, fused (hf_kvcache)", "hf_kvcache", spec, fused=True)]
            if device == "cpu" and native.available()[0]:
                out.append(Variant(f"{spec.label}, fused, torch path", "hf_kvcache", spec, native=False, fused=True))
        else:  # a cache that ranks tokens by the attention they receive runs the attention that reports it
            out.append(Variant(spec.label, "hf_kvcache" if getattr(cache, "needs_attention_mass", False) else "sdpa",
                               spec))
    return out


@torch.inference_mode()
def measure_interleaved(model, chosen: list[Variant], ids: torch.Tensor, context: int, steps: int,
                        chunk: int, round_steps: int = 8) -> dict[str, dict]:
    """Prefill one cache per variant, chunk by chunk in turns (each variant's chunk s, then chunk s + 1: timed), then
    time their decode steps in turns of `round_steps` (A B C A B C ...); then one more step per variant under the
    peak-memory probe."""
    caches = {}
    prefill: dict[str, float] = {v.label: 0.0 for v in chosen}
    for v in chosen:
        caches[v.label] = v.spec.build(model)
        if v.fused:  # read in place while the model runs that attention (what generate sets up)
            caches[v.label].bind(model)
    for s in range(0, context, chunk):
        for v in chosen:
            model.set_attn_implementation(v.attn)
            with v.running():
                t0 = time.perf_counter()
                model(input_ids=ids[:, s : min(s + chunk, context)], **cache_kwargs(caches[v.label]), use_cache=True)
                if ids.is_cuda:
                    torch.cuda.synchronize()
                prefill[v.label] += time.perf_counter() - t0
    step_ids = ids[:, context:]
    times: dict[str, list[float]] = {v.label: [] for v in chosen}
    try:
        for r0 in range(0, steps, round_steps):
            for v in chosen:
                model.set_attn_implementation(v.attn)
                with v.running():
                    for i in range(r0, min(r0 + round_steps, steps)):
                        t0 = time.perf_counter()
                        model(input_ids=step_ids[:, i : i + 1], **cache_kwargs(caches[v.label]), use_cache=True)
                        if ids.is_cuda:
                            torch.cuda.synchronize()
                        times[v.label].append(time.perf_counter() - t0)
        out = {}
        for v in chosen:
            model.set_attn_implementation(v.attn)
            cache = caches[v.label]

            def one_step(cache=cache) -> None:
                model(input_ids=step_ids[:, steps : steps + 1], **cache_kwargs(cache), use_cache=True)

            with v.running():
                peak = gpu_peak_bytes(one_step) if ids.is_cuda else cpu_peak_bytes(one_step)
            stats = memory_stats(cache)
            t = times[v.label]
            out[v.label] = {"prefill_tokens_per_s": context / prefill[v.label],
                            "decode_tokens_per_s": len(t) / sum(t), "median_tokens_per_s": 1.0 / statistics.median(t),
                            "round_seconds": [sum(t[i : i + round_steps]) for i in range(0, len(t), round_steps)],
                            "step_peak_mb": peak / 2**20, "cache_mb": stats["bytes"] / 2**20, "ratio": stats["ratio"]}
    finally:
        model.set_attn_implementation("sdpa")
    return out


@dataclass
class DecodeOptions(SuiteOptions):
    """`--suite decode`: decode tokens/s of each cache after a prefill."""

    decode_steps: int | None = decode_steps_option()
    device: str | None = device_option()


OPTIONS = DecodeOptions


def run(opts: DecodeOptions) -> list[Row]:
    """One row per variant, in the order of --caches."""
    if opts.decode_steps is not None and opts.decode_steps < 1:
        raise ValueError(f"--suite decode times at least one step; got --decode-steps {opts.decode_steps}")
    context = opts.one_length(4096)
    steps = opts.decode_steps or 64
    device = pick_device(opts.device)
    specs = parse_specs(opts.caches or default_caches())
    model, tok = load_model(opts.model, dtype=torch.float16 if device.startswith("cuda") else torch.float32)
    model.to(device)
    ids = load_tokens(tok, load_text(opts.text), opts.start, context + steps + 1).to(device)
    chosen = variants(model, specs, "cuda" if ids.is_cuda else "cpu")
    results = measure_interleaved(model, chosen, ids, context, steps, opts.chunk or 512)
    rows = [make_row("decode", v.label, opts.model, context, **results[v.label]) for v in chosen]
    for row, v in zip(rows, chosen):
        row["vs_first"] = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
        _, low, high = paired_time_ratio(rows[0]["round_seconds"], row["round_seconds"])
        if math.isfinite(low):  # two rounds at least
            row["vs_first_low"], row["vs_first_high"] = low, high
        row["first_round_s"] = row["round_seconds"][0]
        if len(row["round_seconds"]) >= 3:  # the rounds after the first (a calibration's, a warm-up's), two at least
            steady = paired_time_ratio(rows[0]["round_seconds"][1:], row["round_seconds"][1:])
            row["steady_vs_first"], row["steady_vs_first_low"], row["steady_vs_first_high"] = steady
        row["prefill_vs_first"] = row["prefill_tokens_per_s"] / rows[0]["prefill_tokens_per_s"]
        if v.fused:
            deq = next(r for r, w in zip(rows, chosen) if w.spec is v.spec and not w.fused)
            row["vs_dequantize"] = row["decode_tokens_per_s"] / deq["decode_tokens_per_s"]
            if not ids.is_cuda:
                # the kernels' working memory: scratch buffers and the subspace bases' float32 weights they keep
                row["scratch_mb"] = (scratch_bytes() + native_subspace.held_weight_bytes()) / 2**20
    return rows
