"""Per-step cost of appending to a cache (`--suite append`): is an append O(new tokens) at every cache size?

Fills each cache (`--caches`; default the tiered defaults and transformers' QuantizedCache quanto 2-bit) with random
keys/values shaped like SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64) up to each `--tokens` length (default 512
and 4096), then times `--decode-steps` (64) single-token steps, all layers. No model is loaded.

Rows, one per cache and length: `update_ms` / `update_worst_ms` (the whole `cache.update`: dequantizing the past for
attention + storing the new token; mean and worst step: a worst step is one where groups graduate between tiers, or
where HF's QuantizedLayer flushes); for tiered layers `store_ms` / `store_worst_ms` (only the storing part, `append`:
tail, graduation, quantization) and `quantized_per_step` (tokens stored quantized per step and layer: the warm and
archive tiers' `_quantize` calls, not calibration round trips).
"""

from __future__ import annotations

from dataclasses import dataclass

import statistics
import time

import torch

from hf_kvcache.caches.tiered import TieredQuantLayer

from ..bench import CacheSpec, parse_specs
from ..rows import Row, make_row
from .options import SuiteOptions, decode_steps_option

LAYERS, HEADS, HEAD_DIM = 30, 3, 64
MODEL = f"random SmolLM2-135M-shaped keys/values ({LAYERS} layers, {HEADS} KV heads, head_dim {HEAD_DIM})"
DEFAULT_CACHES = ["tiered", 'hf-quanto-2=hf-quanto:{"nbits":2,"q_group_size":32,"residual_length":64}']


class _ConfigOnly:
    """What `CacheSpec.build` reads of a model: its config."""

    def __init__(self, config) -> None:
        self.config = config


def smollm2_like_config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=9, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                       hidden_size=576, vocab_size=128)


@torch.inference_mode()
def time_cache(spec: CacheSpec, cached: int, steps: int = 64, seed: int = 0) -> dict:
    """The append metrics of one cache filled to `cached` tokens."""
    torch.manual_seed(seed)
    cache = spec.build(_ConfigOnly(smollm2_like_config()))
    for start in range(0, cached, 256):
        n = min(256, cached - start)
        k, v = torch.randn(1, HEADS, n, HEAD_DIM), torch.randn(1, HEADS, n, HEAD_DIM)
        for layer in range(LAYERS):
            cache.update(k, v, layer)
    store_times: list[float] = []
    quantized = [0]
    real_append, real_quantize = TieredQuantLayer.append, TieredQuantLayer._quantize

    def timed_append(self, k, v):
        t0 = time.perf_counter()
        real_append(self, k, v)
        store_times[-1] += time.perf_counter() - t0

    def counting_quantize(self, keys, values, tier, *args, **kw):
        if kw.get("track"):  # stored, not a calibration round trip
            quantized[0] += keys.shape[2]
        return real_quantize(self, keys, values, tier, *args, **kw)

    update_times = []
    TieredQuantLayer.append, TieredQuantLayer._quantize = timed_append, counting_quantize
    try:
        for _ in range(steps):
            k, v = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, HEADS, 1, HEAD_DIM)
            store_times.append(0.0)
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                cache.update(k, v, layer)
            update_times.append(time.perf_counter() - t0)
    finally:
        TieredQuantLayer.append, TieredQuantLayer._quantize = real_append, real_quantize
    out = {"update_ms": 1e3 * statistics.mean(update_times), "update_worst_ms": 1e3 * max(update_times)}
    if isinstance(cache.layers[0], TieredQuantLayer):
        out.update(store_ms=1e3 * statistics.mean(store_times), store_worst_ms=1e3 * max(store_times),
                   quantized_per_step=quantized[0] / LAYERS / steps)
    return out


@dataclass
class AppendOptions(SuiteOptions):
    """`--suite append`: the per-step append cost at each cache size."""

    decode_steps: int | None = decode_steps_option()


OPTIONS = AppendOptions


def run(opts: AppendOptions) -> list[Row]:
    """One row per cache and length, caches in the order given."""
    lengths = opts.tokens or [512, 4096]
    if min(lengths) < 1:
        raise ValueError(f"--tokens are cached lengths >= 1, got {lengths}")
    steps = opts.decode_steps or 64
    specs = parse_specs(opts.caches or DEFAULT_CACHES)
    return [make_row("append", spec.label, MODEL, cached, **time_cache(spec, cached, steps))
            for spec in specs for cached in lengths]
