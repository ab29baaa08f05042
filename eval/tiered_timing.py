"""Per-step cost of appending to a quantized cache at two cache sizes (issue: O(new tokens) appends), and decode
speed on the real model, interleaved so that a noisy shared machine hits every cache alike.

    python -m hf_kvcache.eval.tiered_timing --cached 512 4096
    python -m hf_kvcache.eval.tiered_timing --decode --caches dynamic tiered --cached 2048

Fills each cache with random keys/values shaped like SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64) up to
`--cached` tokens, then times `--steps` single-token decoding steps, all layers:

- `update ms`: the whole `cache.update` (dequantizing the past for attention + storing the new token), mean and worst
  step (a worst step is one where groups graduate between tiers, or where HF's QuantizedLayer flushes);
- `store ms`: only the storing part (`append` for our layers: tail, graduation, quantization), mean and worst;
- `quantized/step`: tokens handed to the quantizer per step and layer (keys), averaged over the steps.

For `TieredQuantCache` the store column stays flat from 512 to 4096 cached tokens: only the groups that move are
quantized. transformers' QuantizedCache re-quantizes its whole cache at every flush, so its worst step grows with it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_kvcache.caches.tiered as tiered_mod
from hf_kvcache.caches.tiered import TieredQuantLayer

LAYERS, HEADS, HEAD_DIM = 30, 3, 64


def _make(name: str, options: dict, config):
    from hf_kvcache.eval.bench import CacheSpec

    class _M:  # CacheSpec.build only reads model.config
        pass

    m = _M()
    m.config = config
    return CacheSpec(name, options).build(m)


def _smollm2_like_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=LAYERS, num_attention_heads=9, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
        hidden_size=576, vocab_size=128,
    )


@torch.inference_mode()
def time_cache(name: str, options: dict, cached: int, steps: int = 64, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    cache = _make(name, options, _smollm2_like_config())
    for start in range(0, cached, 256):
        n = min(256, cached - start)
        k, v = torch.randn(1, HEADS, n, HEAD_DIM), torch.randn(1, HEADS, n, HEAD_DIM)
        for layer in range(LAYERS):
            cache.update(k, v, layer)
    store_times: list[float] = []
    quantized = [0]
    real_append = TieredQuantLayer.append
    real_quantize = tiered_mod.quantize_kivi

    def timed_append(self, k, v):
        t0 = time.perf_counter()
        real_append(self, k, v)
        store_times[-1] += time.perf_counter() - t0

    def counting_quantize(x, **kw):
        quantized[0] += x.shape[2]
        return real_quantize(x, **kw)

    update_times = []
    TieredQuantLayer.append = timed_append
    tiered_mod.quantize_kivi = counting_quantize
    try:
        for _ in range(steps):
            k, v = torch.randn(1, HEADS, 1, HEAD_DIM), torch.randn(1, HEADS, 1, HEAD_DIM)
            store_times.append(0.0)
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                cache.update(k, v, layer)
            update_times.append(time.perf_counter() - t0)
    finally:
        TieredQuantLayer.append = real_append
        tiered_mod.quantize_kivi = real_quantize
    ours = isinstance(cache.layers[0], TieredQuantLayer)
    return {
        "cache": name if not options else f"{name} {options}",
        "cached": cached,
        "update_ms": 1e3 * statistics.mean(update_times),
        "update_worst_ms": 1e3 * max(update_times),
        "store_ms": 1e3 * statistics.mean(store_times) if ours else float("nan"),
        "store_worst_ms": 1e3 * max(store_times) if ours else float("nan"),
        # keys and values are both counted: halve; per layer
        "quantized_per_step": quantized[0] / 2 / LAYERS / steps if ours else float("nan"),
    }


@torch.inference_mode()
def decode_speed(texts: list[str], cached: int = 2048, steps: int = 8, rounds: int = 5, model_name: str = "smollm2-135m",
                 text: str = "moby-dick", start: int = 5000) -> list[dict]:
    """Decode tokens/s of each cache holding `cached` tokens of real text: every round times `steps` single-token
    steps on each cache in turn, then crops them off again; the median round counts."""
    from hf_kvcache.eval import load_model, load_text, load_tokens
    from hf_kvcache.eval.bench import CacheSpec

    model, tok = load_model(model_name)
    ids = load_tokens(tok, load_text(text), start, cached + steps)
    specs = [CacheSpec.parse(t) for t in texts]
    caches = []
    for spec in specs:
        cache = spec.build(model)
        for i in range(0, cached, 512):  # prefill in chunks of 512 tokens
            model(input_ids=ids[:, i : min(cached, i + 512)], past_key_values=cache, use_cache=True)
        caches.append(cache)
    times: list[list[float]] = [[] for _ in specs]
    for _ in range(rounds):
        for i, cache in enumerate(caches):
            t0 = time.perf_counter()
            for j in range(steps):
                model(input_ids=ids[:, cached + j : cached + j + 1], past_key_values=cache, use_cache=True)
            times[i].append(time.perf_counter() - t0)
            cache.crop(-steps)
    rows = []
    for spec, ts in zip(specs, times):
        rows.append({"cache": spec.label, "decode_tokens_per_s": steps / statistics.median(ts),
                     "best_tokens_per_s": steps / min(ts)})
    base = rows[0]["decode_tokens_per_s"]
    for r in rows:
        r["vs_first"] = r["decode_tokens_per_s"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    import hf_kvcache  # noqa: F401

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cached", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--caches", nargs="+", default=["tiered", 'hf-quanto:{"nbits":2,"q_group_size":32,"residual_length":64}'],
                   help="specs as in `hf-kvcache bench`")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode", action="store_true", help="real-model decode tokens/s instead (first cache = baseline)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps per round (--decode)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.decode:
        for cached in args.cached:
            rows = decode_speed(args.caches, cached, args.decode_steps, args.rounds)
            print(f"decode at {cached} cached tokens, {args.decode_steps} steps x {args.rounds} rounds (median), "
                  f"threads={args.threads}")
            print(f"{'cache':<50} {'tok/s':>8} {'best':>8} {'vs first':>9}")
            for r in rows:
                print(f"{r['cache'][:50]:<50} {r['decode_tokens_per_s']:>8.2f} {r['best_tokens_per_s']:>8.2f} "
                      f"{r['vs_first']:>8.2f}x")
        return 0
    from hf_kvcache.eval.bench import CacheSpec

    rows = []
    for text in args.caches:
        spec = CacheSpec.parse(text)
        for cached in args.cached:
            rows.append(time_cache(spec.name, spec.options, cached, args.steps))
    head = f"{'cache':<60} {'cached':>6} {'update ms':>10} {'worst':>8} {'store ms':>9} {'worst':>8} {'quantized/step':>15}"
    print(f"{args.steps} single-token steps, {LAYERS} layers, [1, {HEADS}, *, {HEAD_DIM}] random keys/values")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['cache'][:60]:<60} {r['cached']:>6} {r['update_ms']:>10.2f} {r['update_worst_ms']:>8.2f} "
            f"{r['store_ms']:>9.2f} {r['store_worst_ms']:>8.2f} {r['quantized_per_step']:>15.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
