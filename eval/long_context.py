"""Streaming perplexity at long context (8K-32K), both ways a cache is driven, rows written as they come.

    python -m hf_kvcache.eval.long_context run --model qwen2.5-coder-0.5b --start 150000 \\
        --lengths 8192 16384 32768 --chunk 512 --caches dynamic tiered --loops attached plain \\
        --json docs/rows/long_ppl_qwen2.5-coder-0.5b.json
    python -m hf_kvcache.eval.long_context table docs/rows/long_ppl_*.json

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
units `table` resamples for the paired interval of each cache against the dynamic row of the same tokens).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import dataclass, field

import torch

from .assets import load_model, load_text, load_tokens
from .bench import LOOPS, CacheSpec, driving, parse_specs
from .paired import chunk_tokens, paired_ratio
from .pareto import Point, plot
from .pareto import table as pareto_table
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_kvcache.eval.long_context", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="stream the caches and write rows as they come")
    r.add_argument("--model", required=True)
    r.add_argument("--text", default="moby-dick")
    r.add_argument("--start", type=int, required=True, help="first token of the window")
    r.add_argument("--lengths", type=int, nargs="+", required=True)
    r.add_argument("--chunk", type=int, default=512)
    r.add_argument("--nll-block", type=int, default=64)
    r.add_argument("--caches", nargs="+", required=True, help="specs as compare takes them (name, label=name:{json})")
    r.add_argument("--loops", nargs="+", default=list(LOOPS), choices=list(LOOPS))
    r.add_argument("--threads", type=int, default=None)
    r.add_argument("--json", required=True)
    t = sub.add_parser("table", help="the markdown table of rows files, deltas against dynamic")
    t.add_argument("files", nargs="+")
    f = sub.add_parser("pareto", help="ratio / perplexity-delta Pareto table (and PNG) of one length")
    f.add_argument("files", nargs="+")
    f.add_argument("--tokens", type=int, required=True)
    f.add_argument("--png", default=None, help="also plot to this .png file")
    f.add_argument("--title", default=None)
    args = p.parse_args(argv)
    if args.command == "table":
        print(markdown_table([row for f in args.files for row in read_rows(f)]))
        return 0
    if args.command == "pareto":
        points = pareto_points([row for f in args.files for row in read_rows(f)], args.tokens)
        print(pareto_table(points))
        if args.png:
            plot(points, args.title or f"{points[0].source}, {args.tokens} tokens", args.png)
            print(f"wrote {args.png}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    opts = LongRun(args.model, args.start, args.lengths, args.text, args.chunk, args.nll_block, args.loops)
    threads = os.environ.get("OMP_NUM_THREADS")
    command = (f"OMP_NUM_THREADS={threads} " if threads else "") + shlex.join(
        ["python", "-m", "hf_kvcache.eval.long_context", *(argv if argv is not None else sys.argv[1:])])
    rows = run(parse_specs(args.caches), opts, args.json, command)
    print(markdown_table([r for r in rows if r["model"] == opts.model]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
