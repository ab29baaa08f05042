"""One benchmark runner: a suite of measurements over caches side by side in one process, one table, one JSON rows
schema, a ratio / perplexity Pareto PNG.

    hf-kvcache compare --model smollm2-135m --tokens 1024 --caches dynamic int8 int4 tiered --json rows.json --png p.png
    hf-kvcache compare --suite peers --tokens 2048          # tiered / KIVI beside transformers' QuantizedCache
    hf-kvcache compare --suite ablations                    # the tiered defaults, one thing changed per row
    hf-kvcache compare --suite cpac --sections pressure     # CPAC's claims (sections: pressure similarity curve timing)
    hf-kvcache compare --suite decode --tokens 2048         # decode tok/s: fused attention vs dequantize vs others
    hf-kvcache compare --suite kernels --tokens 1024 4096   # decode-attention kernels on random tensors
    hf-kvcache compare --suite append --tokens 512 4096     # per-step append cost at each cache size
    hf-kvcache compare --suite passkey --caches dynamic h2o --budgets 0.2 0.5
    hf-kvcache compare --suite ruler --tokens 4096 8192 --task-samples 8 --budgets 0.5 0.25 --json rows.json
    hf-kvcache compare --suite long --start 150000 --tokens 8192 16384 --loop plain --json rows.json  # long ppl

Every suite (`hf_kvcache.eval.suites`) returns rows of one schema (`hf_kvcache.eval.rows`: `suite`, `cache`,
`model`, `tokens` and its metric columns), printed by one formatter and written by `--json`; rows that carry a ratio
and a perplexity delta get a Pareto column (`pareto.front`: no other row is at least as small and at least as good,
better in one) and `--png` plots them. `--from-json` prints the table of rows written before, running nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from .bench import CacheSpec, parse_specs, run_benchmark
from .long_context import SUITE as LONG_SUITE
from .long_context import pareto_points as long_points
from .pareto import PERPLEXITY, SUITE_SCORE, Point, plot
from .pareto import table as pareto_table
from .rows import Row, format_rows, has_pareto, make_row, read_rows, write_json
from .suites import SUITES, SuiteOptions, run_suite
from .suites.options import add_suite_arguments, options_of, suite_module

__all__ = ["add_arguments", "check_outputs", "compare_table", "main_args", "parse_specs", "points_of", "run_compare"]

PARETO_SUITES = ("perplexity", "peers", "ablations", "cpac")  # the suites whose rows carry ratio and delta


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


def points_of(rows: list[Row], source: str = "compare") -> list[Point]:
    """The rows that carry a ratio and a perplexity delta, as Pareto points (label, ratio, delta %, perplexity)."""
    return [Point(r["cache"], r["ratio"], r["delta_pct"], r["perplexity"], source) for r in rows if has_pareto([r])]


def compare_table(rows: list[Row]) -> str:
    """The rows as the runner prints them (`rows.format_rows`, with the Pareto column)."""
    return format_rows(rows)


def run_compare(specs: list[CacheSpec], model_name: str = "smollm2-135m", text: str = "moby-dick", *,
                json_path: str | None = None, png_path: str | None = None, title: str = "", **bench) -> list[Row]:
    """Perplexity rows of every spec (the first one the baseline), written to `json_path` and plotted to `png_path`;
    `bench`: the other arguments of `bench.run_benchmark` (start, tokens, chunk, decode_steps, progress)."""
    check_outputs(json_path, png_path)
    rows = run_benchmark(specs, model_name, text, **bench)
    rows = [make_row("perplexity", r.pop("cache"), model_name, r.pop("tokens"), **r) for r in rows]
    write_json(json_path, rows)
    if png_path is not None:
        plot(points_of(rows, json_path or "compare"), title, png_path)
    return rows


def add_arguments(p: argparse.ArgumentParser, model_help: str = "a zoo model, a local folder or a hub id") -> None:
    """Every option of `hf-kvcache compare`: the common ones, then each suite's."""
    p.add_argument("--suite", default="perplexity", choices=list(SUITES),
                   help="what to measure (default perplexity); see the groups below for each suite's own options")
    p.add_argument("--model", default="smollm2-135m", help=model_help)
    p.add_argument("--text", default="moby-dick", help="moby-dick, pydoc, shakespeare, a file, or path:config:split")
    p.add_argument("--start", type=int, default=5000, help="first token of the text window")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens scored / cached (perplexity 1024, peers / ablations / cpac 2048, decode 4096, "
                        "passkey 1024, ruler 4096); kernels, append, needle and ruler take several lengths")
    p.add_argument("--chunk", type=int, default=None,
                   help="tokens per forward (perplexity / cpac 32, decode prefill 512, passkey 0: one forward)")
    p.add_argument("--caches", nargs="+", default=None,
                   help="specs: name, name:{json}, or label=name:{json}; the first one is the baseline; added after "
                        "a preset suite's caches")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    p.add_argument("--png", default=None, help="write the ratio / perplexity-delta Pareto plot to this .png file")
    p.add_argument("--title", default=None, help="plot title (default: model, text and token window)")
    p.add_argument("--from-json", default=None, help="print the table of rows an earlier --json wrote; run nothing "
                   "(with --png: also their Pareto table and plot; ruler rows: ratio against points lost)")
    add_suite_arguments(p)


def table_rows(rows: list[Row]) -> list[Row]:
    """The rows `--from-json` prints: those of a suite that summarizes what it wrote (its `table_rows`) through it."""
    suite = rows[0].get("suite") if rows else None
    if suite not in SUITES:
        return rows
    module = suite_module(suite)
    return module.table_rows(rows) if hasattr(module, "table_rows") else rows


def headline(opts: SuiteOptions, rows: list[Row]) -> str:
    """What the table above it measured: suite, model, text window; the baseline where rows have a delta."""
    line = f"suite={opts.suite} model={rows[0]['model'] if rows else opts.model}"
    if opts.suite not in ("kernels", "append"):
        line += f" text={opts.text}" + (f" start={opts.start}" if opts.suite != "passkey" else "")
    tokens = {r["tokens"] for r in rows}
    if len(tokens) == 1:
        line += f" tokens={tokens.pop()}"
    if opts.chunk:
        line += f" chunk={opts.chunk}"
    if any("delta_pct" in r for r in rows):
        line += f" (delta vs {rows[0]['cache']})"
    if any("delta_pts" in r for r in rows):
        line += f" (points vs {rows[0]['cache']} on the same samples, 95 % paired interval)"
    return line


def run_and_report(opts: SuiteOptions, png_path: str | None = None, title: str | None = None,
                   command: str | None = None) -> int:
    """Run the suite of `opts`, print its table, write its rows to `opts.json` (with `command`, the invocation that
    made them) and its Pareto plot to `png_path`; returns the exit status (0)."""
    check_outputs(opts.json, png_path)
    if png_path and opts.suite not in PARETO_SUITES:
        raise ValueError(f"--png plots ratio against perplexity delta; --suite {opts.suite} has neither (the suites "
                         f"that do: {', '.join(PARETO_SUITES)}); leave --png out")
    rows = run_suite(opts)
    print(headline(opts, rows))
    print(format_rows(rows))
    # a row read back from the file (a resumed or rerun suite) keeps the command that measured it
    write_json(opts.json, [{**r, "command": r.get("command") or command} for r in rows] if command else rows)
    if png_path:
        window = f"{opts.text} tokens {opts.start}:{opts.start + rows[0]['tokens']}" if rows else opts.text
        plot(points_of(rows, opts.json or "compare"), title or f"{opts.model}, {window}", png_path)
    for path in (opts.json, png_path):
        if path:
            print(f"wrote {path}")
    return 0


def plot_rows(rows: list[Row], png_path: str, title: str | None = None, tokens: list[int] | None = None) -> None:
    """Print the Pareto table of rows written before and plot it to `png_path`: ratio against perplexity delta, or,
    for the rows of `--suite ruler` (one model, length and mode), against the points lost on the task average; long-
    context rows (`--suite long`) at the one length of `tokens` (needed when they hold several).

    Raises:
        ValueError: for long-context rows of several lengths and no single `tokens` value."""
    check_outputs(None, png_path)
    if rows and all(r.get("suite") == "ruler" for r in rows):
        from .suites.ruler import pareto_points

        points, axis = pareto_points(rows), SUITE_SCORE
    elif rows and all(r.get("suite") == LONG_SUITE for r in rows):
        lengths = sorted({r["tokens"] for r in rows})
        if tokens and len(tokens) == 1:
            length = tokens[0]
        elif len(lengths) == 1:
            length = lengths[0]
        else:
            raise ValueError(f"these long-context rows hold lengths {lengths}: pick one with --tokens N")
        points, axis = long_points(rows, length), PERPLEXITY
        title = title or f"{points[0].source}, {length} tokens"
    else:
        points, axis = points_of(rows), PERPLEXITY
    if not points:
        raise ValueError("--png: these rows carry no ratio and perplexity delta to plot")
    print(pareto_table(points, axis))
    plot(points, title or points[0].source, png_path, axis)
    print(f"wrote {png_path}")


def main_args(args: argparse.Namespace) -> int:
    """`hf-kvcache compare`: the table of `--from-json`, or a run of the suite the arguments describe."""
    if args.from_json:
        rows = read_rows(args.from_json)
        print(format_rows(table_rows(rows)))
        if args.png:
            plot_rows(rows, args.png, args.title, args.tokens)
        return 0
    return run_and_report(options_of(args), args.png, args.title, getattr(args, "invocation", None))
