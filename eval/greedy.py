"""Greedy agreement: how many tokens a cache's greedy generation shares with DynamicCache's from the start.

A real prompt (by default 700 tokens of Moby Dick from token 20000) goes through `generate` once per cache (our
caches prefill it in their chunks of `prefill_chunk_size`, 512 by default, so the prompt's last tokens already attend
to the compressed first ones), `new_tokens` greedy tokens each. The reference's top-2 log-probability gap per step
is printed too: a near-tie there is where a cache's small error can flip the token.

    python -m hf_kvcache.eval.greedy --model gemma3-270m --caches tiered kivi int4
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache

from .assets import load_model, load_text, load_tokens
from .bench import parse_specs


def agreement(reference: torch.Tensor, tokens: torch.Tensor) -> int:
    """Leading tokens of `tokens` equal to `reference` (both `[new_tokens]`)."""
    n = min(reference.numel(), tokens.numel())
    differ = (reference[:n] != tokens[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


@torch.inference_mode()
def greedy_rows(specs: list, model_name: str, text: str = "moby-dick", start: int = 20000, prompt_tokens: int = 700,
                new_tokens: int = 24) -> tuple[list[dict], list[float]]:
    """One row per spec (`{"cache", "same", "new_tokens", "seconds"}`) against DynamicCache's greedy tokens, and
    the reference's top-2 log-probability gap at each step."""
    torch.manual_seed(0)
    model, tokenizer = load_model(model_name)
    ids = load_tokens(tokenizer, load_text(text), start, prompt_tokens)
    generate = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    attention_mask=torch.ones_like(ids), pad_token_id=tokenizer.eos_token_id)
    out = model.generate(ids, past_key_values=DynamicCache(config=model.config), output_scores=True,
                         return_dict_in_generate=True, **generate)
    reference = out.sequences[0, prompt_tokens:]
    gaps = []
    for scores in out.scores:
        top = torch.log_softmax(scores[0].float(), -1).topk(2).values
        gaps.append(float(top[0] - top[1]))
    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        seq = model.generate(ids, past_key_values=spec.build(model), **generate)[0, prompt_tokens:]
        rows.append({"cache": spec.label, "same": agreement(reference, seq), "new_tokens": new_tokens,
                     "seconds": time.perf_counter() - t0})
    return rows, gaps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="moby-dick")
    p.add_argument("--start", type=int, default=20000, help="token offset of the prompt")
    p.add_argument("--prompt-tokens", type=int, default=700)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--caches", nargs="+", default=["tiered"], help="specs: name, name:{json}, or label=name:{json}")
    p.add_argument("--json", default=None, help="also write the rows and gaps to this file")
    args = p.parse_args(argv)
    if args.prompt_tokens < 1 or args.new_tokens < 1:
        raise ValueError(f"--prompt-tokens ({args.prompt_tokens}) and --new-tokens ({args.new_tokens}) must be >= 1")
    rows, gaps = greedy_rows(parse_specs(args.caches), args.model, args.text, args.start, args.prompt_tokens,
                             args.new_tokens)
    print(f"{args.model}: {args.prompt_tokens}-token prompt ({args.text} from token {args.start}), "
          f"{args.new_tokens} greedy tokens; reference top-2 gaps (nats): "
          + " ".join(f"{g:.3f}" for g in gaps))
    for row in rows:
        print(f"{row['cache']}: {row['same']} / {row['new_tokens']} tokens equal to DynamicCache's "
              f"({row['seconds']:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "start": args.start, "prompt_tokens": args.prompt_tokens,
                       "rows": rows, "reference_gaps": gaps}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
