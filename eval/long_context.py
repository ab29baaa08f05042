"""Streaming perplexity at long context (8K-32K), every way a cache is driven, rows written as they come; run by
`hf-kvcache compare --suite long` (`eval/suites/long.py`, one loop per call):

    hf-kvcache compare --suite long --model qwen2.5-coder-0.5b --start 150000 --tokens 8192 16384 32768 \\
        --caches dynamic tiered --loop plain --json docs/rows/long_ppl_qwen2.5-coder-0.5b.json
    hf-kvcache compare --from-json docs/rows/long_ppl_qwen2.5-coder-0.5b.json             # the rows, deltas
    hf-kvcache compare --from-json ROWS --tokens 16384 --png front.png                   # the front at one length

One stream of `max(lengths)` tokens per cache and loop; the perplexity at each shorter length is that of the
stream's first `length` tokens (a cache's state at a position depends only on the tokens before it, so this is the
perplexity a run of that length gives), with the bytes the cache holds at that point. A row per (cache, loop,
length) is written as soon as the stream reaches the length, and a rerun skips the rows its file already holds.

Loops: "attached" runs the model inside `hf_kvcache.attached(model, cache)`, as `generate` does (the "hf_kvcache"
attention: queries reported to the cache, codes read in place); "plain" is a user's own loop,
`model(ids, past_key_values=cache)` with the model's own attention (on an sdpa model the calls of a layer that asks
for queries or mass are served by the "hf_kvcache" attention, `hf_kvcache.attention.plain`); "unserved" is that loop
with nothing reported to the cache (an eager model's loop; what "plain" measured before the service existed). A cache
that is not ours (`dynamic`) runs once, plain. `chunk_nll` holds the summed nll of every `nll_block` positions (the
units `compare_to_baseline` resamples for the paired interval of each cache against the dynamic row of the same tokens).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from .assets import load_model, load_text, load_tokens
from .bench import LOOPS, CacheSpec, driving
from .paired import chunk_tokens, paired_ratio
from .pareto import Point
from .perplexity import streaming_perplexity
from .rows import read_rows as rows_of
from .rows import write_json

SUITE = "long-perplexity"
BASELINE = "dynamic"
SAME_TOKENS = ("model", "text", "start", "tokens", "chunk", "nll_block")  # rows of one stream window


@dataclass
class LongRun:
    """What `run` streams: `model` on `text` from token `start`, scored up to each of `lengths`, `chunk` tokens per
    forward, nll summed per `nll_block` positions."""

    model: str
    start: int
    lengths: list[int]
    text: str = "moby-dick"
    chunk: int = 512
    nll_block: int = 64
    loops: list[str] = field(default_factory=lambda: list(LOOPS))

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 2 for n in self.lengths):
            raise ValueError(f"lengths must be token counts >= 2, got {self.lengths}")
        bad = [n for n in self.lengths if n % self.chunk]
        if bad:
            raise ValueError(f"every length must be a multiple of --chunk {self.chunk} (the rows are taken between "
                             f"chunks): {bad}")
        if self.chunk % self.nll_block:
            raise ValueError(f"--nll-block {self.nll_block} must divide --chunk {self.chunk}")
        unknown = sorted(set(self.loops) - set(LOOPS))
        if unknown:
            raise ValueError(f"unknown loop(s) {unknown}; choose among {list(LOOPS)}")
        self.lengths = sorted(set(self.lengths))


def is_ours(spec: CacheSpec) -> bool:
    """Caches of this library (the loop changes how they run); dynamic and peers run once, plain."""
    from .bench import PEER_CACHES

    return spec.name != BASELINE and spec.name not in PEER_CACHES


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ("cache", "loop", *SAME_TOKENS))


def read_rows(path: str | None) -> list[dict]:
    """The rows of `path` (`rows.read_rows`); none when there is no such file yet."""
    return rows_of(path) if path and os.path.exists(path) else []


def _cache_facts(cache) -> dict:
    """What a row keeps of the cache besides bytes: per-tier bytes and tokens, and the per-layer recipes."""
    facts: dict = {}
    stats = cache.memory_stats() if hasattr(cache, "memory_stats") else {}
    if "tiers" in stats:
        facts["tiers"] = stats["tiers"]
    if hasattr(cache, "recipes"):
        facts["recipes"] = cache.recipes()
    return facts


def stream_rows(model, ids: torch.Tensor, spec: CacheSpec, loop: str, run: LongRun, base: dict,
                emit) -> None:
    """Stream `ids` through a fresh cache of `spec`; `emit(row)` at each length of `run`."""
    from hf_kvcache.caches.base import memory_stats

    cache = spec.build(model)
    t0 = time.perf_counter()

    def at_chunk(start: int, chunk_nll: list[float]) -> None:
        end = start + run.chunk
        if end not in run.lengths:
            return
        blocks = chunk_nll[: end // run.nll_block]
        stats = memory_stats(cache)
        nll = sum(blocks) / (end - 1)
        emit({**base, "cache": spec.label, "loop": loop, "tokens": end, "perplexity": float(torch.tensor(nll).exp()),
              "bytes": stats["bytes"], "fp16_bytes": stats["fp16_bytes"], "ratio": stats["ratio"],
              "seconds": time.perf_counter() - t0, "chunk_nll": blocks, **_cache_facts(cache)})

    with driving(loop, model, cache):
        streaming_perplexity(model, ids, cache, run.chunk, progress=False, on_chunk=at_chunk,
                             nll_block=run.nll_block)


def run(specs: list[CacheSpec], opts: LongRun, json_path: str | None, command: str = "") -> list[dict]:
    """Every (spec, loop) streamed once over `max(lengths)` tokens; returns all rows of `json_path` (old and new)."""
    rows = read_rows(json_path)
    done = {row_key(r) for r in rows}
    base = {"suite": SUITE, "model": opts.model, "text": opts.text, "start": opts.start, "chunk": opts.chunk,
            "nll_block": opts.nll_block, "command": command}
    jobs = [(s, loop) for s in specs for loop in (opts.loops if is_ours(s) else ["plain"])]
    todo = [(s, loop) for s, loop in jobs
            if any(row_key({**base, "cache": s.label, "loop": loop, "tokens": n}) not in done for n in opts.lengths)]
    if not todo:
        return rows
    torch.manual_seed(0)
    model, tokenizer = load_model(opts.model)
    ids = load_tokens(tokenizer, load_text(opts.text), opts.start, max(opts.lengths))
    for spec, _ in todo:  # every spec checked before the first run
        spec.build(model)

    def emit(row: dict) -> None:
        if row_key(row) in done:
            return
        rows.append(row)
        done.add(row_key(row))
        write_json(json_path, rows)
        print(f"  .. {row['cache']} [{row['loop']}] {row['tokens']} tokens: ppl {row['perplexity']:.3f}, "
              f"{row['ratio']:.2f}x, {row['seconds']:.0f} s", flush=True)

    for spec, loop in todo:
        stream_rows(model, ids, spec, loop, opts, base, emit)
    return rows


def compare_to_baseline(rows: list[dict], block: int = 8) -> list[dict]:
    """Each row with `delta_pct` against the dynamic row of the same tokens and its paired 95 % interval
    (`paired.paired_ratio`, blocks of `block` consecutive nll units), where that row exists."""
    bases = {tuple(r.get(k) for k in SAME_TOKENS): r for r in rows if r["cache"] == BASELINE}
    out = []
    for r in rows:
        b = bases.get(tuple(r.get(k) for k in SAME_TOKENS))
        r = dict(r)
        if b is not None:
            units = chunk_tokens(r["tokens"], r["nll_block"])
            p = paired_ratio(r["chunk_nll"], b["chunk_nll"], units, block=min(block, units.numel()))
            r.update(delta_pct=100 * (p.ratio - 1), low_pct=100 * (p.low - 1), high_pct=100 * (p.high - 1))
        out.append(r)
    return out


def markdown_table(rows: list[dict]) -> str:
    """model | tokens | cache | loop | ppl | delta vs dynamic [95 % interval] | ratio, one line per row."""
    lines = ["| model | tokens | cache | loop | ppl | delta vs dynamic [95 % paired interval] | vs fp16 |",
             "| --- | ---: | --- | --- | ---: | --- | ---: |"]
    for r in sorted(compare_to_baseline(rows), key=lambda r: (r["model"], r["start"], r["tokens"],
                                                              r["cache"] != BASELINE, r["cache"], r["loop"])):
        delta = "" if r["cache"] == BASELINE or "delta_pct" not in r else (
            f"{r['delta_pct']:+.2f} % [{r['low_pct']:+.2f}, {r['high_pct']:+.2f}]")
        lines.append(f"| {r['model']} | {r['tokens']} | {r['cache']} | {r['loop']} | {r['perplexity']:.3f} | {delta} "
                     f"| {r['ratio']:.2f}x |")
    return "\n".join(lines)


def pareto_points(rows: list[dict], tokens: int) -> list[Point]:
    """The rows of `tokens` tokens as Pareto points (`eval.pareto.Point`), deltas against the dynamic row of the same
    tokens; a cache measured in several loops gets one point per loop, labeled `cache [loop]` (loops that measured
    the same perplexity and ratio share a point, `cache [attached = plain]`).

    Raises:
        ValueError: when no row of `tokens` tokens has a delta (no dynamic row of the same tokens)."""
    held = sorted({r["tokens"] for r in rows})
    rows = [r for r in compare_to_baseline(rows) if r["tokens"] == tokens and "delta_pct" in r]
    if not rows:
        raise ValueError(f"no rows of {tokens} tokens with a dynamic row beside them; the files hold lengths {held}")
    loops: dict[str, set] = {}
    same: dict[tuple, list[dict]] = {}  # loops of one cache that measured the same: one point
    for r in rows:
        loops.setdefault(r["cache"], set()).add(r["loop"])
        same.setdefault((r["cache"], r["perplexity"], r["ratio"]), []).append(r)
    points = []
    for (cache, ppl, ratio), group in same.items():
        label = cache if len(loops[cache]) == 1 else f"{cache} [{' = '.join(sorted(r['loop'] for r in group))}]"
        points.append(Point(label, ratio, group[0]["delta_pct"], ppl, group[0]["model"]))
    return points
