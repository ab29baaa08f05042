"""Several caches side by side in one process: one table, the bench rows as JSON, a ratio / perplexity Pareto PNG.

    hf-kvcache compare --model smollm2-135m --tokens 1024 --caches dynamic int8 int4 tiered \\
        --json rows.json --png pareto.png

Every cache streams the same window of the same text through the same loaded model (`bench.run_benchmark`); the
first cache is the baseline of `delta_pct`. The rows are those of `hf-kvcache bench --json` (so `hf-kvcache pareto`
reads them too); the table adds a Pareto column (`pareto.front`: no other cache is at least as small and at least as
good, better in one) and the PNG is `pareto.plot` of the rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from .bench import CacheSpec, available_caches, format_table, run_benchmark, write_json
from .pareto import Point, front, plot


def check_outputs(json_path: str | None, png_path: str | None) -> None:
    """Fail before any measurement on outputs that cannot be written (wrong suffix, no matplotlib, no folder)."""
    if png_path is not None:
        if not png_path.lower().endswith(".png"):
            raise ValueError(f"--png takes a path ending in .png, got {png_path!r}")
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--png needs matplotlib: pip install matplotlib  (or pip install 'hf-kvcache[eval]')")
    for path in (json_path, png_path):
        folder = os.path.dirname(path) if path else ""
        if folder and not os.path.isdir(folder):
            raise ValueError(f"the folder of {path!r} does not exist; create it first (mkdir -p {folder})")


def parse_specs(texts: list[str]) -> list[CacheSpec]:
    """Specs of `--caches`, with distinct labels (the rows, the table and the plot name caches by label)."""
    if not texts:
        raise ValueError("give at least one cache: --caches dynamic int4 ...")
    specs = [CacheSpec.parse(t) for t in texts]
    names = available_caches()
    seen: set[str] = set()
    for spec in specs:
        if spec.name not in names:
            raise ValueError(f"unknown cache {spec.name!r} in --caches; pick among: {', '.join(names)} "
                             "(hf-kvcache caches lists them)")
        if spec.label in seen:
            raise ValueError(f"two caches share the label {spec.label!r}; name one: 'other-{spec.name}={spec.name}:"
                             "{...}'")
        seen.add(spec.label)
    return specs


def points_of(rows: list[dict], source: str = "compare") -> list[Point]:
    """The rows as Pareto points (label, ratio, delta %, perplexity)."""
    return [Point(r["cache"], r["ratio"], r["delta_pct"], r["perplexity"], source) for r in rows]


def pareto_labels(rows: list[dict]) -> set[str]:
    """Labels of the rows on the ratio / perplexity-delta front."""
    return {p.label for p in front(points_of(rows))}


def compare_table(rows: list[dict]) -> str:
    """`bench.format_table` of the rows with a Pareto column ("yes" on the front)."""
    on = pareto_labels(rows)
    marks = ["Pareto", "------"] + ["yes" if r["cache"] in on else "" for r in rows]
    return "\n".join(f"{line}  {mark}".rstrip() for line, mark in zip(format_table(rows).splitlines(), marks))


def run_compare(
    specs: list[CacheSpec],
    model_name: str = "smollm2-135m",
    text: str = "moby-dick",
    start: int = 5000,
    tokens: int = 1024,
    chunk: int = 32,
    decode_steps: int = 16,
    json_path: str | None = None,
    png_path: str | None = None,
    title: str = "",
    progress: bool = True,
) -> list[dict]:
    """Bench rows of every spec (the first one the baseline), written to `json_path` and plotted to `png_path`."""
    if tokens < 2:
        raise ValueError(f"--tokens must be at least 2 (tokens scored), got {tokens}")
    check_outputs(json_path, png_path)
    rows = run_benchmark(specs, model_name, text, start, tokens, chunk, decode_steps, progress=progress)
    write_json(json_path, rows)
    if png_path is not None:
        plot(points_of(rows, json_path or "compare"), title, png_path)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--caches", nargs="+", required=True,
                   help="specs: name, name:{json}, or label=name:{json}; the first one is the baseline")
    p.add_argument("--decode-steps", type=int, default=16, help="single-token steps timed after the stream (0: none)")
    p.add_argument("--json", default=None, help="write the rows (hf-kvcache bench --json rows) to this file")
    p.add_argument("--png", default=None, help="write the ratio / perplexity-delta Pareto plot to this .png file")
    p.add_argument("--title", default=None, help="plot title (default: model, text and token window)")


def main_args(args: argparse.Namespace) -> int:
    specs = parse_specs(args.caches)
    window = f"{args.text} tokens {args.start}:{args.start + args.tokens}, chunk {args.chunk}"
    title = args.title if args.title is not None else f"{args.model}, {window}"
    rows = run_compare(specs, args.model, args.text, args.start, args.tokens, args.chunk, args.decode_steps,
                       args.json, args.png, title)
    print(f"model={args.model} {window} (delta vs {specs[0].label})")
    print(compare_table(rows))
    for path in (args.json, args.png):
        if path:
            print(f"wrote {path}")
    return 0
