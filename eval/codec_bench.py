"""KV codec benchmark: bytes per token, continuation perplexity after a round trip, encode / decode speed, and time
to first token with a prefix hit.

    python -m hf_kvcache.eval.codec_bench                       # SmolLM2 + Moby Dick, 2048 + 512 tokens, TTFT at 2K
    python -m hf_kvcache.eval.codec_bench --ttft 2048 8192 --json codec.json
    hf-kvcache codec-bench ...                                   # the same

Round trip: the first `--prefix` tokens are prefilled into a cache, the cache is serialized and rebuilt, and the next
`--continuation` tokens are streamed through the rebuilt cache (chunks of `--chunk`); perplexity is over those
tokens. Rows whose bytes come from a cache (int8, tiered) are rebuilt from that cache: int8 / zstd / lossy rows as a
DynamicCache of the dequantized prefix (the continuation itself is exact), the lossless tiered row as the
TieredQuantCache it encodes (the continuation then goes through the tiered cache, as it would in use).
MB/s are of fp16-equivalent KV (2 bytes per cached element) per second of encode or decode.
TTFT: a full prefill of context + `--suffix` tokens vs decoding the stored context's blob + prefilling the suffix.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Any

import torch
import zstandard
from transformers import DynamicCache

from hf_kvcache import codec
from hf_kvcache.caches import TieredQuantCache, UniformQuantCache
from hf_kvcache.caches.tiered import ROTATIONS
from hf_kvcache.codec.layers import set_dynamic_layer
from hf_kvcache.transformers_compat import cache_kwargs

from .assets import load_model, load_text, load_tokens
from .perplexity import streaming_perplexity

ROWS = ("baselines", "lossy", "tiered")
# lossy settings: label -> encode options
LOSSY_SETTINGS = {
    "lossy head 544": {"bins": (5, 4, 4), "step_from": "head"},
    "lossy head 666": {"bins": (6, 6, 6), "step_from": "head"},
    "lossy hi": {"bins": (16, 12, 8), "step_from": "values"},
    "lossy mid": {"bins": (12, 8, 6), "step_from": "values"},
    "lossy lo": {"bins": (8, 6, 4), "step_from": "values"},
}


def _prefill(model, ids: torch.Tensor, cache, step: int = 512, desc: str = "prefill"):
    from tqdm.auto import tqdm

    with torch.inference_mode():
        for s in tqdm(range(0, ids.shape[1], step), desc=desc, leave=False, unit="chunk"):
            model(ids[:, s : s + step], **cache_kwargs(cache), use_cache=True)
    return cache


def _dense_copy(cache, config) -> DynamicCache:
    """A DynamicCache holding the (dequantized) keys / values of any cache."""
    out = DynamicCache(config=config)
    for src, dst in zip(cache.layers, out.layers):
        k, v = src.materialize() if hasattr(src, "materialize") else (src.keys, src.values)
        set_dynamic_layer(dst, k.clone(), v.clone())
    return out


def _fp16_bytes(cache) -> int:
    return sum(2 * (layer.keys.numel() + layer.values.numel()) for layer in cache.layers)


def _row(label: str, nbytes: int, tokens: int, fp16: int, int8: int | None, ppl: float, base: float,
         enc_s: float | None = None, dec_s: float | None = None, note: str = "") -> dict[str, Any]:
    return {
        "label": label, "bytes": nbytes, "bytes_per_token": nbytes / tokens, "vs_fp16": fp16 / nbytes,
        "vs_int8": (int8 / nbytes) if int8 else None, "ppl": ppl, "delta_pct": 100 * (ppl / base - 1),
        "encode_MBps": fp16 / enc_s / 1e6 if enc_s else None, "decode_MBps": fp16 / dec_s / 1e6 if dec_s else None,
        "note": note,
    }


def format_rows(rows: list[dict]) -> str:
    head = f"{'row':<34} {'B/token':>9} {'vs fp16':>8} {'vs int8':>8} {'ppl':>8} {'delta':>8} {'enc MB/s':>9} {'dec MB/s':>9}"
    lines = [head]
    for r in rows:
        f = lambda v, spec: format("-" if v is None else v, spec if v is not None else ">9")  # noqa: E731
        lines.append(
            f"{r['label']:<34} {r['bytes_per_token']:>9.0f} {r['vs_fp16']:>7.2f}x "
            f"{'-' if r['vs_int8'] is None else format(r['vs_int8'], '.2f') + 'x':>8} "
            f"{r['ppl']:>8.3f} {r['delta_pct']:>+7.2f}% {f(r['encode_MBps'], '>9.1f')} {f(r['decode_MBps'], '>9.1f')}"
            + (f"  {r['note']}" if r["note"] else "")
        )
    return "\n".join(lines)


def _baselines(model, cfg, pre, cont, dyn, chunk, base, prefix, fp16, rows, out) -> int:
    """naive fp16 (raw fp16 bytes of keys and values), int8 cache and zstd-over-int8 rows; returns the int8
    cache's bytes."""
    t0 = time.perf_counter()
    raw = [(layer.keys.half().numpy().tobytes(), layer.values.half().numpy().tobytes()) for layer in dyn.layers]
    enc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = DynamicCache(config=cfg)
    for (kb, vb), src, dst in zip(raw, dyn.layers, back.layers):
        k = torch.frombuffer(bytearray(kb), dtype=torch.float16).view(src.keys.shape).float()
        v = torch.frombuffer(bytearray(vb), dtype=torch.float16).view(src.values.shape).float()
        set_dynamic_layer(dst, k, v)
    dec_s = time.perf_counter() - t0
    ppl = streaming_perplexity(model, cont, back, chunk_size=chunk).perplexity
    rows.append(_row("naive fp16 serialization", fp16, prefix, fp16, None, ppl, base, enc_s, dec_s))
    print(format_rows(rows[-1:]), file=out, flush=True)

    # int8 cache (per token and KV head), and zstd over its bytes
    int8 = _prefill(model, pre, UniformQuantCache(config=cfg, dtype="int8"), desc="int8 prefill")
    int8_bytes = int8.memory_stats()["bytes"]
    ppl = streaming_perplexity(model, cont, _dense_copy(int8, cfg), chunk_size=chunk).perplexity
    for r in rows:
        r["vs_int8"] = int8_bytes / r["bytes"]
    rows.append(_row("int8 cache (UniformQuantCache)", int8_bytes, prefix, fp16, int8_bytes, ppl, base,
                     note="bytes held"))
    zc = zstandard.ZstdCompressor(level=3)
    t0 = time.perf_counter()
    z = sum(len(zc.compress(t.contiguous().view(torch.uint8).numpy().tobytes()))
            for layer in int8.layers for q in (layer.key_codes, layer.value_codes) for t in q.tensors())
    enc_s = time.perf_counter() - t0
    rows.append(_row("zstd-3 over int8 cache", z, prefix, fp16, int8_bytes, ppl, base, enc_s, None))
    print(format_rows(rows[-2:]), file=out, flush=True)
    return int8_bytes


@torch.inference_mode()
def run_quality(model, tok, text: str, start: int, prefix: int, continuation: int, chunk: int,
                settings: dict[str, dict], out=sys.stdout, rows_wanted: tuple = ROWS,
                tiered_rotation: str = "both") -> list[dict]:
    cfg = model.config
    ids = load_tokens(tok, load_text(text), start, prefix + continuation)
    pre, cont = ids[:, :prefix], ids[:, prefix:]
    dyn = _prefill(model, pre, DynamicCache(config=cfg))
    fp16 = _fp16_bytes(dyn)
    base = streaming_perplexity(model, cont, copy.deepcopy(dyn), chunk_size=chunk).perplexity
    rows = [_row("DynamicCache (reference, no trip)", fp16 * 2, prefix, fp16, None, base, base, note="fp32 in memory")]
    print(f"reference continuation ppl {base:.3f}", file=out, flush=True)

    if "baselines" not in rows_wanted:
        int8_bytes = None
    else:
        int8_bytes = _baselines(model, cfg, pre, cont, dyn, chunk, base, prefix, fp16, rows, out)
    if "lossy" in rows_wanted:
        for label, opts in settings.items():
            t0 = time.perf_counter()
            blob = codec.encode(dyn, config=cfg, **opts)
            enc_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = codec.decode(blob, config=cfg)
            dec_s = time.perf_counter() - t0
            ppl = streaming_perplexity(model, cont, back, chunk_size=chunk).perplexity
            note = json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in opts.items()})
            rows.append(_row(f"codec {label}", len(blob), prefix, fp16, int8_bytes, ppl, base, enc_s, dec_s, note))
            print(format_rows(rows[-1:]), file=out, flush=True)
    if "tiered" not in rows_wanted:
        return rows
    # rotation="both" by default: the measured recipe for SmolLM2 (docs/results/codec.md), fixed so the row does not
    # depend on calibration; a rotation ruins some layers of other models (Qwen2.5: --tiered-rotation none)
    tiered = _prefill(model, pre, TieredQuantCache(config=cfg, rotation=tiered_rotation), desc="tiered prefill")
    tiered_bytes = tiered.memory_stats()["bytes"]
    t0 = time.perf_counter()
    blob = codec.encode(tiered, config=cfg, mode="lossless")
    enc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = codec.decode(blob, config=cfg)
    dec_s = time.perf_counter() - t0
    ppl_t = streaming_perplexity(model, cont, copy.deepcopy(tiered), chunk_size=chunk).perplexity
    ppl = streaming_perplexity(model, cont, back, chunk_size=chunk).perplexity
    rows.append(_row(f"tiered cache, rotation {tiered_rotation} (held)", tiered_bytes, prefix, fp16, int8_bytes, ppl_t, base,
                     note="continuation through the tiered cache"))
    rows.append(_row("codec lossless over tiered codes", len(blob), prefix, fp16, int8_bytes, ppl, base, enc_s,
                     dec_s, f"{100 * (1 - len(blob) / tiered_bytes):.1f} % smaller than the tiered cache"))
    print(format_rows(rows[-2:]), file=out, flush=True)
    return rows


@torch.inference_mode()
def run_ttft(model, tok, text: str, start: int, context: int, suffix: int, options: dict) -> dict[str, Any]:
    """Seconds to the first token's logits: full prefill of context + suffix vs decode of the context's blob +
    prefill of the suffix (both in one forward, as generate does)."""
    cfg = model.config
    ids = load_tokens(tok, load_text(text), start, context + suffix)
    cache = DynamicCache(config=cfg)
    t0 = time.perf_counter()
    full_logits = model(ids, **cache_kwargs(cache), use_cache=True).logits[:, -1]
    full_s = time.perf_counter() - t0
    cache.crop(-suffix)
    blob = codec.encode(cache, config=cfg, **options)
    t0 = time.perf_counter()
    hit = codec.decode(blob, config=cfg)
    dec_s = time.perf_counter() - t0
    hit_logits = model(ids[:, context:], **cache_kwargs(hit), use_cache=True).logits[:, -1]
    hit_s = time.perf_counter() - t0
    same = bool(full_logits.argmax(-1).eq(hit_logits.argmax(-1)).all())
    return {"context": context, "suffix": suffix, "full_prefill_s": full_s, "hit_s": hit_s, "decode_s": dec_s,
            "speedup": full_s / hit_s, "blob_bytes": len(blob), "same_first_token": same}


def format_ttft(rows: list[dict]) -> str:
    lines = [f"{'context':>8} {'suffix':>6} {'full prefill s':>15} {'hit: decode + suffix s':>23} {'of it decode s':>15} "
             f"{'speedup':>8} {'same 1st token':>15}"]
    for r in rows:
        lines.append(f"{r['context']:>8} {r['suffix']:>6} {r['full_prefill_s']:>15.2f} {r['hit_s']:>23.2f} "
                     f"{r['decode_s']:>15.2f} {r['speedup']:>7.1f}x {str(r['same_first_token']):>15}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="codec-bench", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="moby-dick")
    p.add_argument("--start", type=int, default=5000, help="first token of the prefix")
    p.add_argument("--prefix", type=int, default=2048, help="tokens encoded")
    p.add_argument("--continuation", type=int, default=512, help="tokens streamed after the round trip")
    p.add_argument("--chunk", type=int, default=64, help="tokens per forward when streaming the continuation")
    p.add_argument("--settings", nargs="*", default=list(LOSSY_SETTINGS),
                   help=f"lossy settings: names from {list(LOSSY_SETTINGS)} or label=JSON options")
    p.add_argument("--ttft", type=int, nargs="*", default=[2048], help="contexts for the time-to-first-token rows")
    p.add_argument("--suffix", type=int, default=64, help="new tokens after the stored context (TTFT)")
    p.add_argument("--json", default=None, help="also write every row to this file")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS, help="which row groups to measure")
    p.add_argument("--tiered-rotation", default="both", choices=ROTATIONS,
                   help="rotation of the tiered cache whose codes the lossless row encodes")


def _settings(specs: list[str]) -> dict[str, dict]:
    out = {}
    for s in specs:
        if s in LOSSY_SETTINGS:
            out[s] = LOSSY_SETTINGS[s]
        elif "=" in s:
            label, opts = s.split("=", 1)
            out[label] = json.loads(opts)
        else:
            raise ValueError(f"unknown lossy setting {s!r}: use one of {list(LOSSY_SETTINGS)} or label=JSON")
    return out


def main_args(args: argparse.Namespace, out=sys.stdout) -> int:
    settings = _settings(args.settings)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    model.set_attn_implementation("sdpa")
    print(f"model={args.model} text={args.text} prefix={args.start}:{args.start + args.prefix} continuation="
          f"{args.continuation} chunk={args.chunk} torch threads={torch.get_num_threads()}", file=out, flush=True)
    rows = run_quality(model, tok, args.text, args.start, args.prefix, args.continuation, args.chunk, settings, out,
                       tuple(args.rows), args.tiered_rotation)
    print("\n" + format_rows(rows), file=out, flush=True)
    ttft = []
    ttft_opts = next(iter(settings.values()), {})
    for ctx in args.ttft:
        ttft.append(run_ttft(model, tok, args.text, args.start, ctx, args.suffix, ttft_opts))
        print(format_ttft(ttft[-1:]), file=out, flush=True)
    if ttft:
        print(f"\nTTFT (hit = decode of a lossy blob {json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in ttft_opts.items()})}"
              " + suffix prefill):\n" + format_ttft(ttft), file=out, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ttft": ttft, "args": vars(args)}, f, indent=2, default=str)
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
