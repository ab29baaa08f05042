"""`--suite greedy`: how many tokens a cache's greedy generation shares with DynamicCache's from the start.

A real prompt (`--tokens` tokens of `--text` from `--start`; 700 by default) goes through `generate` once per cache
(our caches prefill it in their chunks of `prefill_chunk_size`, 512 by default, so the prompt's last tokens already
attend to the compressed first ones), `--new-tokens` greedy tokens each (24 by default). The reference's top-2
log-probability gap per step is printed and kept in its row: a near-tie there is where a cache's small error can flip
the token.

    hf-kvcache compare --suite greedy --model gemma3-270m --start 20000 --caches tiered kivi int4

Rows: one per cache (`same`: leading tokens equal to DynamicCache's, `new_tokens`, `seconds`), after one for the
reference (`reference`: DynamicCache's generation, with `reference_gaps`, nats per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hf_kvcache.transformers_compat import cache_kwargs

from ..assets import load_model, load_text, load_tokens
from ..bench import CacheSpec, parse_specs
from ..rows import Row, make_row
from .options import SuiteOptions, new_tokens_option

DEFAULT_PROMPT = 700
DEFAULT_NEW_TOKENS = 24
DEFAULT_CACHES = ["tiered"]
REFERENCE = "reference"  # the row of DynamicCache's own generation (its top-2 gaps)


@dataclass
class GreedyOptions(SuiteOptions):
    """`--suite greedy`: greedy tokens of each cache against DynamicCache's."""

    new_tokens: int | None = new_tokens_option()


OPTIONS = GreedyOptions


def agreement(reference: torch.Tensor, tokens: torch.Tensor) -> int:
    """Leading tokens of `tokens` equal to `reference` (both `[new_tokens]`)."""
    n = min(reference.numel(), tokens.numel())
    differ = (reference[:n] != tokens[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


@torch.inference_mode()
def greedy_rows(specs: list[CacheSpec], model_name: str, text: str = "moby-dick", start: int = 20000,
                prompt_tokens: int = DEFAULT_PROMPT, new_tokens: int = DEFAULT_NEW_TOKENS
                ) -> tuple[list[dict], list[float]]:
    """One row per spec (`{"cache", "same", "new_tokens", "seconds"}`) against DynamicCache's greedy tokens, and
    the reference's top-2 log-probability gap at each step (nats, `[new_tokens]`)."""
    torch.manual_seed(0)
    model, tokenizer = load_model(model_name)
    ids = load_tokens(tokenizer, load_text(text), start, prompt_tokens)
    generate = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    attention_mask=torch.ones_like(ids), pad_token_id=tokenizer.eos_token_id)
    out = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), output_scores=True,
                         return_dict_in_generate=True, **generate)
    reference = out.sequences[0, prompt_tokens:]
    gaps = []
    for scores in out.scores:
        top = torch.log_softmax(scores[0].float(), -1).topk(2).values
        gaps.append(float(top[0] - top[1]))
    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        seq = model.generate(ids, **cache_kwargs(spec.build(model)), **generate)[0, prompt_tokens:]
        rows.append({"cache": spec.label, "same": agreement(reference, seq), "new_tokens": new_tokens,
                     "seconds": time.perf_counter() - t0})
    return rows, gaps


def run(opts: GreedyOptions) -> list[Row]:
    """`--suite greedy`: see the module docstring."""
    prompt = opts.one_length(DEFAULT_PROMPT)
    new_tokens = DEFAULT_NEW_TOKENS if opts.new_tokens is None else opts.new_tokens
    if new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1, got {new_tokens}")
    rows, gaps = greedy_rows(parse_specs(opts.caches or DEFAULT_CACHES), opts.model, opts.text, opts.start, prompt,
                             new_tokens)
    if opts.progress:
        print(f"reference top-2 gaps (nats): " + " ".join(f"{g:.3f}" for g in gaps), flush=True)
    common = dict(text=opts.text, start=opts.start)
    out = [make_row("greedy", REFERENCE, opts.model, prompt, same=new_tokens, new_tokens=new_tokens,
                    reference_gaps=gaps, **common)]
    return out + [make_row("greedy", r.pop("cache"), opts.model, prompt, **r, **common) for r in rows]
