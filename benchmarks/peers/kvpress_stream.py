"""NVIDIA kvpress presses applied while streaming: perplexity on the very tokens of `hf-kvcache bench` (#11).

kvpress 0.5.5 pins transformers < 5.3, so this runs in its own virtual environment and imports nothing from
hf_kvcache; the token ids come from a file written in the main environment:

    python benchmarks/peers/kvpress_stream.py --dump-ids /tmp/kvpress_ids.pt            # main env (needs hf_kvcache)
    python -m venv /tmp/kvpress-env && /tmp/kvpress-env/bin/pip install torch==2.13.0 kvpress==0.5.5
    MODEL=$(python -c "from hf_kvcache.eval.assets import model_dir; print(model_dir('smollm2-135m'))")
    /tmp/kvpress-env/bin/python benchmarks/peers/kvpress_stream.py --ids /tmp/kvpress_ids.pt --model-dir $MODEL \\
        --budgets ratio:0.2 fixed:410 --json /tmp/kvpress_stream.json

Protocol (the same as `hf_kvcache.eval.perplexity.streaming_perplexity`): the ids ([1, N], Moby Dick 5000:7048 by
default) go through the model in chunks of 32 with one cache; token t is scored from the logits of position t-1,
whichever chunk that was in, so N-1 tokens are scored (the first chunk's own predictions included). Every forward
gets the true `position_ids` (kvpress's cache length no longer counts evicted tokens; its pipeline does the same),
while `cache_position` is left to the model (it counts the tokens held, which is what the causal mask needs).

kvpress compresses during decoding through `DecodingPress` (keeps a fixed `target_size` of tokens) or
`CompressionRatioDecodingPress` (keeps `int(seen * (1 - target_compression_ratio))`, `seen` = the largest position
id + 1). Each chunk after the first is a "decoding" step for kvpress (its `cache_position` does not start at 0);
with `compression_interval=1` the press compresses after every chunk, as our H2OCache does. Budgets:

- `ratio:R` (R = fraction kept, e.g. 0.2): `PrefillDecodingPress(prefilling_press=P(compression_ratio=1-R),
  decoding_press=CompressionRatioDecodingPress(P(), target_compression_ratio=1-R, compression_interval=1))`, so the
  first chunk is compressed too (kvpress's compression_ratio is the fraction REMOVED).
- `fixed:T` (T tokens): `DecodingPress(P(), target_size=T, compression_interval=1)` (nothing evicted before T).

Presses P: snapkv (`SnapKVPress(window_size=chunk-1)` unless --snapkv-window: kvpress asserts the buffered queries outnumber the window,
and the buffer holds one chunk since it is cleared at each compression), tova, expected_attention, knorm,
adakv_snapkv (`AdaKVPress(SnapKVPress(...))`: masks keys per head with fake keys, storage not reduced).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import sys
import time

import torch

PRESSES = ["snapkv", "tova", "expected_attention", "knorm", "adakv_snapkv"]


def dump_ids(path: str, model: str, text: str, start: int, count: int) -> None:
    """Main environment only: write the benchmark's token ids ([1, count]) to `path` (.pt or .json)."""
    from transformers import AutoTokenizer

    from hf_kvcache.eval.assets import load_text, load_tokens, model_dir

    directory = model_dir(model)
    ids = load_tokens(AutoTokenizer.from_pretrained(directory), load_text(text), start, count)
    meta = {"model": model, "model_dir": directory, "text": text, "start": start, "count": count}
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump({**meta, "ids": ids[0].tolist()}, f)
    else:
        torch.save({**meta, "ids": ids}, path)
    print(f"wrote {tuple(ids.shape)} ids of {text} {start}:{start + count} ({directory}) to {path}")


def load_ids(path: str) -> tuple[torch.Tensor, dict]:
    if path.endswith(".json"):
        with open(path) as f:
            data = json.load(f)
        ids = torch.tensor([data.pop("ids")])
    else:
        data = torch.load(path)
        ids = data.pop("ids")
    return ids.long(), data


def scorer(name: str, ratio: float, window: int):
    import kvpress

    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=window)
    if name == "tova":
        return kvpress.TOVAPress(compression_ratio=ratio)
    if name == "expected_attention":
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio)
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if name == "adakv_snapkv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=window))
    raise SystemExit(f"unknown press {name!r}; choose from {PRESSES}")


def make_press(name: str, budget: str, window: int):
    import kvpress

    kind, value = budget.split(":")
    if kind == "ratio":
        removed = 1.0 - float(value)
        return kvpress.PrefillDecodingPress(
            prefilling_press=scorer(name, removed, window),
            decoding_press=kvpress.CompressionRatioDecodingPress(
                base_press=scorer(name, 0.0, window), target_compression_ratio=removed, compression_interval=1
            ),
        )
    if kind == "fixed":
        return kvpress.DecodingPress(base_press=scorer(name, 0.0, window), target_size=int(value), compression_interval=1)
    raise SystemExit(f"budget {budget!r}: use ratio:KEPT_FRACTION or fixed:TOKENS")


@torch.inference_mode()
def stream_ppl(model, ids: torch.Tensor, press, chunk: int) -> dict:
    from transformers import DynamicCache

    cache = DynamicCache()
    n = ids.shape[1]
    nll, scored, last_logits, chunk_nll = 0.0, 0, None, []
    t0 = time.perf_counter()
    with press(model) if press is not None else contextlib.nullcontext():
        for start in range(0, n, chunk):
            piece = ids[:, start : start + chunk]
            position_ids = torch.arange(start, start + piece.shape[1])[None]
            logits = model(input_ids=piece, past_key_values=cache, position_ids=position_ids, use_cache=True).logits
            logits = logits[0].float()
            preds = logits[:-1] if last_logits is None else torch.cat([last_logits, logits[:-1]])
            targets = piece[0, 1:] if last_logits is None else piece[0]
            chunk_nll.append(torch.nn.functional.cross_entropy(preds, targets, reduction="sum").item())
            nll += chunk_nll[-1]
            scored += targets.numel()
            last_logits = logits[-1:]
    held = [layer.keys.shape[2] for layer in cache.layers]
    masked = []
    for layer in model.model.layers:
        m = getattr(layer.self_attn, "masked_key_indices", None)
        masked.append(0 if m is None else int(m[0].numel()))
    kv_heads = model.config.num_key_value_heads
    return {
        "ppl": math.exp(nll / scored),
        "nll": nll,
        "scored": scored,
        "seconds": time.perf_counter() - t0,
        "tokens_held_per_layer": sorted(set(held)),
        # AdaKV only masks: mean (over layers and kv heads) of the keys left unmasked at the end
        "unmasked_mean": sum(h - m / kv_heads for h, m in zip(held, masked)) / len(held),
        "chunk_nll": chunk_nll,  # summed nll of the tokens scored in each chunk (the first chunk scores chunk-1)
    }


def _command() -> str:
    """This run's command line, kept in every row it writes (`OMP_NUM_THREADS` first when set)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    return (f"OMP_NUM_THREADS={threads} " if threads else "") + shlex.join(["python", *sys.argv])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump-ids", default=None, help="main env: only write the token ids to this .pt/.json file")
    ap.add_argument("--model", default="smollm2-135m", help="--dump-ids: zoo name")
    ap.add_argument("--text", default="moby-dick")
    ap.add_argument("--start", type=int, default=5000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ids", default=None, help="the file written by --dump-ids")
    ap.add_argument("--model-dir", default=None, help="local HF folder of the model (hf_kvcache model_dir)")
    ap.add_argument("--presses", nargs="+", default=PRESSES)
    ap.add_argument("--budgets", nargs="+", default=["ratio:0.2"], help="ratio:KEPT_FRACTION or fixed:TOKENS")
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--snapkv-window", type=int, default=None,
                    help="SnapKV's window_size (default chunk-1, the most kvpress allows with one chunk buffered)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-baseline", action="store_true", help="skip the DynamicCache row")
    ap.add_argument("--json", default=None, help="write the rows here (rewritten after every row)")
    args = ap.parse_args()
    if args.dump_ids:
        dump_ids(args.dump_ids, args.model, args.text, args.start, args.tokens)
        return
    if not args.ids or not args.model_dir:
        raise SystemExit("--ids and --model-dir are required (or --dump-ids)")
    torch.set_num_threads(args.threads)

    import kvpress
    import transformers
    from importlib.metadata import version
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    ids, meta = load_ids(args.ids)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    env = {"kvpress": version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__}
    print(f"kvpress {env['kvpress']}, transformers {env['transformers']}, torch {env['torch']}; "
          f"{meta.get('text', '?')} {meta.get('start', '?')}:{meta.get('start', 0) + ids.shape[1]} "
          f"({ids.shape[1]} tokens) chunk={args.chunk} threads={args.threads} model={args.model_dir}", flush=True)
    base = {**{k: v for k, v in meta.items() if k != "model_dir"}, "model_dir": args.model_dir, "chunk": args.chunk,
            "tokens": ids.shape[1], **env, "command": _command()}
    window = args.snapkv_window or args.chunk - 1
    rows, baseline = [], None

    def emit(row):
        rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)

    if not args.no_baseline:
        r = stream_ppl(model, ids, None, args.chunk)
        baseline = r["ppl"]
        print(f"dynamic: ppl {r['ppl']:.3f}  held {r['tokens_held_per_layer']}  ({r['seconds']:.0f} s)", flush=True)
        emit({**base, "press": "dynamic", "budget": None, **r})
    for budget in args.budgets:
        for name in args.presses:
            press = make_press(name, budget, window)
            r = stream_ppl(model, ids, press, args.chunk)
            delta = None if baseline is None else 100 * (r["ppl"] / baseline - 1)
            extra = f"  unmasked {r['unmasked_mean']:.1f}" if name.startswith("adakv") else ""
            label = f"{name}(window={window})" if "snapkv" in name else name
            print(f"{label} {budget}: ppl {r['ppl']:.3f}"
                  + ("" if delta is None else f" ({delta:+.2f} %)")
                  + f"  held {r['tokens_held_per_layer']}{extra}  ({r['seconds']:.0f} s)", flush=True)
            emit({**base, "press": name, "snapkv_window": window if "snapkv" in name else None, "budget": budget,
                  "press_repr": repr(press), "delta_pct": delta, **r})


if __name__ == "__main__":
    main()
