"""Bytes held by n samples of one long prompt (`generate(num_return_sequences=n)`), with and without shared pages.

    python -m hf_kvcache.eval.shared_prefix      # SmolLM2-135M, 4096-token Moby Dick prompt, 8 samples of 32 tokens

generate expands the prompt to n identical rows before the prefill; the paged cache stores their equal pages once.
Each case runs the same sampling (same seed), and its bytes are every tensor the cache holds after generate returns
(`memory_stats()`); `fp16_bytes` is what an fp16 `DynamicCache` holds for the same rows and tokens (2 bytes per key
and value element: the model runs in fp32 here, so its own DynamicCache would hold twice that).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .assets import load_model, load_text, load_tokens

ROWS_DIR = Path(__file__).resolve().parent.parent / "docs" / "rows"


@dataclass
class SharedPrefixCase:
    """A cache to run: a registered name with its `cache_config`, and the label of its row."""

    label: str
    name: str
    options: dict = field(default_factory=dict)


DEFAULT_CASES = [
    SharedPrefixCase("paged (unshared)", "paged_quant", {"share": False}),
    SharedPrefixCase("paged (shared)", "paged_quant", {"share": True}),
    SharedPrefixCase("tiered", "tiered", {}),
]


@dataclass
class SharedPrefixRow:
    label: str
    cache: str
    options: dict
    prompt_tokens: int
    samples: int
    new_tokens: int
    bytes: int  # every tensor the cache holds after generate
    fp16_bytes: int  # an fp16 DynamicCache for the same rows and tokens
    vs_first: float  # bytes / bytes of the first case
    vs_fp16: float  # bytes / fp16_bytes
    pages: int | None  # paged cache: distinct pages held (all layers), else None
    page_refs: int | None  # paged cache: page-table entries (all layers)
    distinct_samples: int  # different continuations among the n rows
    samples_sha: str  # digest of the generated tokens: equal digests, equal samples
    seconds: float  # wall time of generate


def measure_shared_prefix(model_name: str = "smollm2-135m", prompt_tokens: int = 4096, n: int = 8,
                          new_tokens: int = 32, caches: list[SharedPrefixCase] | None = None,
                          seed: int = 0, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per case (`SharedPrefixRow` as a dict): `n` samples of `new_tokens` tokens from a `prompt_tokens`-token
    Moby Dick prompt, the same seed for every case; `on_row` is called with each row as soon as it is measured."""
    model, tok = load_model(model_name)
    ids = load_tokens(tok, load_text("moby-dick"), 0, prompt_tokens)
    rows: list[SharedPrefixRow] = []
    for case in caches or DEFAULT_CASES:
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, do_sample=True, num_return_sequences=n, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=tok.eos_token_id,
                                 cache_implementation=case.name, cache_config=dict(case.options),
                                 return_dict_in_generate=True)
        seconds = time.perf_counter() - start
        stats = out.past_key_values.memory_stats()
        generated = out.sequences[:, prompt_tokens:]
        first = rows[0].bytes if rows else stats["bytes"]
        rows.append(SharedPrefixRow(
            case.label, case.name, dict(case.options), prompt_tokens, n, new_tokens, int(stats["bytes"]),
            int(stats["fp16_bytes"]), stats["bytes"] / first, stats["bytes"] / stats["fp16_bytes"],
            stats.get("pages"), stats.get("page_refs"), len({tuple(r) for r in generated.tolist()}),
            hashlib.blake2b(generated.numpy().tobytes(), digest_size=6).hexdigest(), round(seconds, 1)))
        del out
        if on_row is not None:
            on_row(asdict(rows[-1]))
    return [asdict(r) for r in rows]


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table."""
    r0 = rows[0]
    lines = [f"{r0['samples']} samples x {r0['new_tokens']} new tokens of a {r0['prompt_tokens']}-token prompt; "
             f"fp16 DynamicCache: {r0['fp16_bytes'] / 2**20:.1f} MiB",
             f"{'cache':<18} {'MiB held':>9} {'vs first':>9} {'vs fp16':>8} {'pages':>7} {'refs':>7} "
             f"{'distinct':>8} {'samples':>12} {'s':>7}"]
    for r in rows:
        lines.append(f"{r['label']:<18} {r['bytes'] / 2**20:>9.2f} {r['vs_first']:>9.3f} {r['vs_fp16']:>8.3f} "
                     f"{r['pages'] if r['pages'] is not None else '-':>7} "
                     f"{r['page_refs'] if r['page_refs'] is not None else '-':>7} {r['distinct_samples']:>8} "
                     f"{r['samples_sha']:>12} {r['seconds']:>7.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    rows = measure_shared_prefix(on_row=lambda row: print(row, flush=True))
    (ROWS_DIR / "shared_prefix_smollm2-135m.json").write_text(json.dumps(rows, indent=1) + "\n")
    (ROWS_DIR / "shared_prefix_smollm2-135m.txt").write_text(format_table(rows) + "\n")
    print(format_table(rows))
