"""What scoring a context by its reconstruction costs: prefill time and peak memory relative to a plain prefill.

    python -m hf_kvcache.eval.reconstruct_cost --model qwen2.5-coder-0.5b --tokens 4096 --chunk 512 \\
        --json docs/rows/reconstruct_cost_qwen2.5-coder-0.5b.json

Each variant runs in a fresh subprocess (so the peak resident memory of one does not hide the other's): it loads the
model, reads its resident memory after a 64-token warm-up forward, then prefills `--tokens` tokens of Moby Dick in one forward and reads the peak
resident memory (`ru_maxrss`); the row gives the seconds and the peak over the loaded model. Variants: `plain` (the
full cache, `DynamicCache`, the model's SDPA attention), `evict` (the evicting cache with the `snapkv` policy, which
needs the attention mass: the `"hf_kvcache"` attention), `reconstruct` (the evicting cache with the `reconstruct`
policy: the prefill, then `score_context` in `--chunk`-token forwards, then the eviction; its row splits the seconds
into `prefill_seconds` and `score_seconds`). The budget is 25 % of the tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("plain", "evict", "reconstruct")


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(model_name: str, tokens: int, variant: str, chunk: int) -> dict:
    """One variant in this process (see the module docstring): seconds and peak memory over the loaded model."""
    import torch
    from transformers import DynamicCache

    from hf_kvcache.caches.evict.reconstruct import held_for_scoring, reconstruction_prompt_ids
    from hf_kvcache.eval.assets import load_model, load_text
    from hf_kvcache.registry import attached, build_cache

    model, tokenizer = load_model(model_name)
    ids = tokenizer(load_text("moby-dick")[200_000:], add_special_tokens=False).input_ids[:tokens]
    context = torch.tensor([ids])
    torch.set_grad_enabled(False)
    model(context[:, :64], past_key_values=DynamicCache(config=model.config), use_cache=True)  # first-call setup
    base = _rss_kib()
    out = {"variant": variant}
    t0 = time.perf_counter()
    if variant == "plain":
        model(context, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    elif variant == "evict":
        cache = build_cache("h2o", model.config, budget=0.25, policy="snapkv")
        with attached(model, cache):
            model(context, past_key_values=cache, use_cache=True, logits_to_keep=1)
    else:
        cache = build_cache("h2o", model.config, budget=0.25, policy="reconstruct", chunk=chunk)
        prompt = reconstruction_prompt_ids(tokenizer)
        with attached(model, cache):
            with held_for_scoring(model, cache, context, prompt):
                model(context, past_key_values=cache, use_cache=True, logits_to_keep=1)
                out["prefill_seconds"] = time.perf_counter() - t0
        out["score_seconds"] = time.perf_counter() - t0 - out["prefill_seconds"]
    out["seconds"] = time.perf_counter() - t0
    out["peak_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one variant, print its row
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.model, args.tokens, args.one, args.chunk)))
        return
    from hf_kvcache.eval.rows import make_row, write_json

    rows = []
    for variant in args.variants:
        cmd = [sys.executable, "-m", "hf_kvcache.eval.reconstruct_cost", "--model", args.model, "--tokens",
               str(args.tokens), "--chunk", str(args.chunk), "--one", variant]
        result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                           env=os.environ.copy()).stdout.strip().splitlines()[-1])
        rows.append(make_row("reconstruct_cost", result.pop("variant"), args.model, args.tokens, chunk=args.chunk,
                             threads=os.environ.get("OMP_NUM_THREADS"), **result))
        print(json.dumps(rows[-1]), flush=True)
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
