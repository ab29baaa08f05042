"""The one row schema of every benchmark suite, its one table formatter and its one JSON writer.

A row is a flat dict. Every row has the common keys `suite` (the suite that measured it), `cache` (the label of what
was measured: a cache spec, a kernel variant, a CPAC setting), `model` (a model name, or a description of the random
tensors a synthetic suite times) and `tokens` (the tokens held by the cache or scored); the suite adds its metric
columns (`COLUMNS` names the known ones) and, where a suite has several tables, `section`. Values that are lists or
dicts (per-trial answers, per-tier bytes, options) go to the JSON only.
"""

from __future__ import annotations

import json
import os
from typing import Any

Row = dict[str, Any]
COMMON = ("suite", "cache", "model", "tokens")

# key -> (format, header), in the order the table shows them
COLUMNS: dict[str, tuple[str, str]] = {
    "cache": ("{}", "cache"),
    "task": ("{}", "task"),
    "features": ("{}", "features"),
    "batch": ("{}", "batch"),
    "tokens": ("{}", "tokens"),
    "perplexity": ("{:.3f}", "ppl"),
    "delta_pct": ("{:+.2f}%", "delta"),
    "low_pct": ("{:+.2f}%", "low"),
    "high_pct": ("{:+.2f}%", "high"),
    "bytes": ("{:,}", "bytes held"),
    "ratio": ("{:.2f}x", "vs fp16"),
    "answer_ratio": ("{:.2f}x", "vs fp16 (answered)"),
    "tokens_per_s": ("{:.0f}", "stream tok/s"),
    "prefill_tokens_per_s": ("{:.0f}", "prefill tok/s"),
    "prefill_vs_first": ("{:.2f}x", "prefill vs first"),
    "decode_tokens_per_s": ("{:.1f}", "decode tok/s"),
    "median_tokens_per_s": ("{:.2f}", "median tok/s"),
    "step_peak_mb": ("{:.2f}", "step peak MB"),
    "cache_mb": ("{:.2f}", "cache MB"),
    "vs_first": ("{:.2f}x", "vs first"),
    "vs_first_low": ("{:.2f}x", "low"),
    "vs_first_high": ("{:.2f}x", "high"),
    "first_round_s": ("{:.2f}", "first 8 steps s"),
    "steady_vs_first": ("{:.2f}x", "after them vs first"),
    "steady_vs_first_low": ("{:.2f}x", "low"),
    "steady_vs_first_high": ("{:.2f}x", "high"),
    "vs_dequantize": ("{:.2f}x", "vs dequantize"),
    "scratch_mb": ("{:.2f}", "scratch MB"),
    "proxy": ("{:.4f}", "proxy"),
    "base_pages": ("{}", "base"),
    "delta_pages": ("{}", "delta pages"),
    "raw_pages": ("{}", "raw"),
    "pressure": ("{:.2f}", "pressure"),
    "measured_pressure": ("{:.2f}", "measured"),
    "threshold": ("{:.2f}", "thr"),
    "compress_ms_per_block": ("{:.3f}", "comp ms/blk"),
    "decompress_ms_per_block": ("{:.4f}", "decomp ms/blk"),
    "cos_mean": ("{:.3f}", "best cos (mean)"),
    ">=0.95": ("{:.1%}", ">=0.95"),
    ">=0.85": ("{:.1%}", ">=0.85"),
    ">=0.7": ("{:.1%}", ">=0.70"),
    "delta_rel_norm": ("{:.3f}", "median |page-base|/|page|"),
    "blocks": ("{}", "blocks"),
    "compress_ms": ("{:.3f}", "compress ms/block"),
    "decompress_ms": ("{:.3f}", "decompress ms/block (one at a time)"),
    "decompress_batched_ms": ("{:.4f}", "decompress ms/block (whole layer)"),
    "ms": ("{:.3f}", "ms"),
    "gb_per_s": ("{:.1f}", "GB/s"),
    "peak_mb": ("{:.1f}", "peak MB"),
    "vs_sdpa": ("{:.2f}x", "vs sdpa"),
    "update_ms": ("{:.2f}", "update ms"),
    "update_worst_ms": ("{:.2f}", "worst"),
    "store_ms": ("{:.2f}", "store ms"),
    "store_worst_ms": ("{:.2f}", "worst"),
    "quantized_per_step": ("{:.2f}", "quantized/step"),
    "mode": ("{}", "mode"),
    "depth": ("{:g}", "depth"),
    "correct": ("{}", "correct"),
    "held": ("{:.1f}", "held"),
    "samples": ("{}", "samples"),
    "new_tokens": ("{}", "new tokens"),
    "pages": ("{}", "pages"),
    "page_refs": ("{}", "refs"),
    "distinct_samples": ("{}", "distinct"),
    "samples_sha": ("{}", "samples sha"),
    "delta_pts": ("{:+.1f}", "vs full (pts)"),
    "low_pts": ("{:+.1f}", "low"),
    "high_pts": ("{:+.1f}", "high"),
    "accuracy": ("{:.1%}", "mean"),
    "nll": ("{:.3f}", "answer nll"),
    "delta_nll": ("{:+.3f}", "nll vs full"),
    "low_nll": ("{:+.3f}", "nll low"),
    "high_nll": ("{:+.3f}", "nll high"),
    "trials": ("{}", "trials"),
}
LAST = ("accuracy", "trials")  # after the suite's own columns (passkey: after the accuracy per depth)
DEPTH_PREFIX = "depth "  # passkey: "depth 0.5" -> accuracy at that depth
# in the JSON, not in the table: said once above the table, or too long for a cell
HIDDEN = {"suite", "model", "section", "fp16_bytes", "seconds", "layer", "command", "earlier_commands"}


def make_row(suite: str, cache: str, model: str, tokens: int, **metrics: Any) -> Row:
    """A row of the one schema: the common keys first, then the suite's metrics."""
    return {"suite": suite, "cache": cache, "model": model, "tokens": tokens, **metrics}


def write_json(path: str | None, data) -> None:
    """Write `data` (rows, a report) as indented JSON to `path`, whole, through a temporary file (a run cut off while
    writing never leaves half a file); nothing when `path` is None."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, default=str)
        os.replace(tmp, path)


def read_rows(path: str) -> list[Row]:
    """Rows written by `write_json` (`hf-kvcache compare --json`); a ValueError names the fix for anything else."""
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read rows from {path}: {exc}; write them with hf-kvcache compare --json") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "cache" in r for r in rows):
        raise ValueError(f"{path} holds no rows (a JSON list of dicts with 'cache', written by hf-kvcache compare "
                         "--json)")
    return rows


def has_pareto(rows: list[Row]) -> bool:
    """Whether the rows can be placed on a ratio / perplexity-delta front (each has both)."""
    return bool(rows) and all("ratio" in r and "delta_pct" in r and "perplexity" in r for r in rows)


def on_front(rows: list[Row]) -> list[bool]:
    """For each row: no other row is at least as small (ratio) and as good (delta), better in one."""
    from .pareto import Point, front

    points = [Point(str(i), r["ratio"], r["delta_pct"], r["perplexity"], "") for i, r in enumerate(rows)]
    kept = {p.label for p in front(points)}
    return [str(i) in kept for i in range(len(rows))]


def _shown(value: Any) -> bool:
    return not isinstance(value, (dict, list, tuple))


def _columns(rows: list[Row]) -> list[tuple[str, str, str]]:
    keys: list[str] = []
    for r in rows:
        keys += [k for k, v in r.items() if k not in keys and k not in HIDDEN and _shown(v)]
    if len({r.get("tokens") for r in rows}) == 1:  # the same for every row: said above the table
        keys = [k for k in keys if k != "tokens"]
    cols = [(k, *COLUMNS[k]) for k in COLUMNS if k in keys and k not in LAST]
    for k in keys:
        if k not in COLUMNS:
            floats = any(isinstance(r.get(k), float) for r in rows)
            cols.append((k, "{:.0%}" if k.startswith(DEPTH_PREFIX) else "{:.3f}" if floats else "{}", k))
    return cols + [(k, *COLUMNS[k]) for k in LAST if k in keys]


def _cell(row: Row, key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def _table(rows: list[Row], pareto: bool) -> str:
    cols = _columns(rows)
    cells = [[h for _, _, h in cols]] + [[_cell(r, k, fmt) for k, fmt, _ in cols] for r in rows]
    if pareto and has_pareto(rows):
        cells[0].append("Pareto")
        for line, on in zip(cells[1:], on_front(rows)):
            line.append("yes" if on else "")
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_rows(rows: list[Row], pareto: bool = True) -> str:
    """The rows as aligned text tables: one per `section` (in order of appearance, headed `[section]`), columns in
    `COLUMNS` order then the suite's own, "-" where a row lacks a column, and a Pareto column where every row has a
    ratio and a perplexity delta (`pareto=False`: none)."""
    if not rows:
        return "(no rows)"
    sections: dict[str | None, list[Row]] = {}
    for r in rows:
        sections.setdefault(r.get("section"), []).append(r)
    parts = []
    for name, group in sections.items():
        tokens = {r.get("tokens") for r in group}
        head = f"[{name}]" if name is not None else ""
        if name is not None and len(tokens) == 1 and None not in tokens:
            head += f" tokens={tokens.pop()}"
        parts.append((head + "\n" if head else "") + _table(group, pareto))
    return "\n\n".join(parts)
