"""The shared prefill of the RULER-style suite (`hf_kvcache.eval.replay`) on a zoo model: every cache's stored tensors
after its own prefill and after the replayed one, compared bit for bit, then the answers of both.

    OMP_NUM_THREADS=1 python benchmarks/identity/replay_check.py --model gemma3-270m --tokens 4096 \\
        --caches int8 int4 kivi fp8 tiered tiered_long --json benchmarks/identity/replay_gemma3-270m_4096.json

One sample of `--task` (sample 0, seed 0) as the suite builds it. Per cache: `replayed` (whether the replay took),
`identical` (every tensor the cache holds after the prefill equal, in dtype and value), `recipes_identical` (tiered:
what calibration chose), `same_answer`, and the seconds of both prefills. Exit status 1 when a replayed cache differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def held(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.held_tensors()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--caches", nargs="+", required=True)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from hf_kvcache.eval.assets import load_model, load_plays, load_text
    from hf_kvcache.eval.bench import CacheSpec, parse_specs
    from hf_kvcache.eval.replay import PrefillReplay
    from hf_kvcache.eval.ruler_tasks import TaskGenerator
    from hf_kvcache.eval.suites.passkey import answer
    from hf_kvcache.registry import attached

    model, tokenizer = load_model(args.model)
    gen = TaskGenerator(tokenizer, load_text("moby-dick"), load_plays())
    sample = gen.samples(args.task, args.tokens, 1, 0)[0]
    ids = torch.tensor([sample.context_ids])
    prefill = PrefillReplay(sample.context_ids)
    full = CacheSpec("dynamic", {}, "dynamic")
    base = answer(model, tokenizer, full, sample.context_ids, sample.question_ids, sample.new_tokens, prefill=prefill)
    rows, bad = [], 0
    for spec in parse_specs(args.caches):
        own = spec.build(model)
        t0 = time.perf_counter()
        with torch.inference_mode(), attached(model, own):
            model(ids, past_key_values=own, logits_to_keep=1)
        own_s = time.perf_counter() - t0
        replayed = spec.build(model)
        t0 = time.perf_counter()
        took = prefill.replay(replayed)
        replay_s = time.perf_counter() - t0
        row = {"cache": spec.label, "replayed": took, "own_prefill_s": round(own_s, 1),
               "replay_s": round(replay_s, 1)}
        if took:
            a, b = held(replayed), held(own)
            row["identical"] = len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
            if hasattr(own, "recipes"):
                row["recipes_identical"] = replayed.recipes() == own.recipes()
            alone = answer(model, tokenizer, spec, sample.context_ids, sample.question_ids, sample.new_tokens)
            shared = answer(model, tokenizer, spec, sample.context_ids, sample.question_ids, sample.new_tokens,
                            prefill=prefill)
            row.update(same_answer=alone.text == shared.text and alone.bytes == shared.bytes, answer=shared.text)
            bad += not (row["identical"] and row.get("recipes_identical", True) and row["same_answer"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"model": args.model, "tokens": args.tokens, "task": args.task, "full_cache_answer": base.text,
           "command": "OMP_NUM_THREADS=1 python " + " ".join(sys.argv), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
