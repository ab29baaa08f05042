"""`--suite needle`: needle-in-a-haystack accuracy per (context length, depth) cell, per cache and mode.

    hf-kvcache compare --suite needle --tokens 1024 2048 4096 --depths 0.1 0.5 0.9 --trials 2 \\
        --caches dynamic h2o --budgets 0.2 --mode question --heatmaps docs/needle

The needle is the passkey sentence in Moby Dick (`hf_kvcache.eval.needle`, trials of the passkey suite's
`make_trials` at each length); `--mode` as in the passkey suite. One row per cell: `tokens` (the context length),
`depth`, `accuracy`, `correct`, `trials`, `held` (mean slots per KV head when the answer starts) and the per-trial
answers (JSON only); `--heatmaps DIR` writes one heatmap PNG per cache (`plot_grid`).
"""

from __future__ import annotations

from dataclasses import dataclass

import os

from ..assets import load_model, load_text
from ..bench import parse_specs
from ..needle import needle_grid, plot_grid
from ..rows import Row, make_row
from .options import option
from .passkey import PasskeyOptions, with_budgets


@dataclass
class NeedleOptions(PasskeyOptions):
    """`--suite needle`: the passkey trials over a grid of context lengths x depths."""

    heatmaps: str | None = option(None, "write one heatmap PNG per cache into this folder", type=str)


OPTIONS = NeedleOptions


def run(opts: NeedleOptions) -> list[Row]:
    lengths = tuple(opts.tokens or (1024, 2048, 4096))
    if opts.heatmaps and not os.path.isdir(opts.heatmaps):
        raise ValueError(f"--heatmaps {opts.heatmaps!r} is not a folder; create it first (mkdir -p {opts.heatmaps})")
    model, tokenizer = load_model(opts.model)
    specs = parse_specs(opts.caches or ["dynamic", 'h2o:{"budget":0.2}'])
    if opts.budgets:
        specs = with_budgets(specs, opts.budgets, model)
    text = load_text(opts.text)
    rows: list[Row] = []
    for spec in specs:
        # question-aware: an evicting cache other than h2o is refused (run_trial says so)
        grid = needle_grid(model, tokenizer, spec, lengths, tuple(opts.depths), opts.mode, opts.trials, text,
                           opts.seed, opts.answer_tokens())
        if opts.heatmaps:
            name = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{spec.label}_{opts.mode}")
            plot_grid(grid, os.path.join(opts.heatmaps, f"{name}.png"))
        for cell in grid:
            rows.append(make_row("needle", spec.label, opts.model, cell["length"], mode=opts.mode, depth=cell["depth"],
                                 accuracy=cell["accuracy"], correct=cell["correct"], trials=cell["trials"],
                                 held=cell["held"], seconds=cell["seconds"], results=cell["results"]))
    return rows
