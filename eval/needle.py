"""Needle in a haystack on real text: accuracy per (context length, depth) cell, and its heatmap.

The haystack is a window of a real book (Moby Dick by default, `load_text`), the needle the passkey sentence "The pass
key is 12345. Remember it. 12345 is the pass key." with a random 5-digit key, put at a sentence end at `depth` of the
filler (0 = right after the instruction, 1 = right before the question); the trials are those of
`hf_kvcache.eval.suites.passkey.make_trials` at each length (`trials` per depth, own key and window each, seed
`seed + length`) and each runs through `passkey.run_trial` in the given `mode` ("agnostic": the context compressed before the question;
"question": context + question prefilled, then evicted to the budget, question kept).

    rows = needle_grid(model, tokenizer, CacheSpec.parse('h2o:{"budget":0.2,"policy":"snapkv"}'),
                       lengths=(1024, 2048), depths=(0.1, 0.5, 0.9), mode="question", trials=3)
    plot_grid(rows, "docs/needle/snapkv-20.png")

`grid_trials` / `dump_grid_trials` give the same trials (token ids, each tagged with its `length`) to another
environment (`benchmarks/peers/kvpress_passkey.py`), and `rows_from_results` turns per-trial results back into grid
rows.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict

from .bench import CacheSpec
from .suites import check_mode
from .suites.passkey import PasskeyTrial, make_trials, run_trial


def _check_grid(lengths: tuple[int, ...], depths: tuple[float, ...], trials: int) -> None:
    if not lengths or not depths:
        raise ValueError("give at least one context length and one depth, e.g. lengths=(1024,), depths=(0.5,)")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 64:
            raise ValueError(f"context lengths are token counts >= 64, got {n!r}")
    if len(set(lengths)) != len(lengths) or len(set(depths)) != len(depths):
        raise ValueError(f"lengths {lengths} and depths {depths} must not repeat a value (one cell each)")
    if trials < 1:
        raise ValueError(f"trials per cell must be >= 1, got {trials}")


def grid_trials(
    tokenizer, text: str, lengths: tuple[int, ...], depths: tuple[float, ...], trials: int, seed: int = 0
) -> dict[int, list[PasskeyTrial]]:
    """The trials of every cell, by context length: `trials` per depth at each length (`passkey.make_trials`, seed
    `seed + length`, so a length's trials do not depend on the other lengths of the grid)."""
    _check_grid(tuple(lengths), tuple(depths), trials)
    return {n: make_trials(tokenizer, text, n, tuple(depths), trials, seed + n) for n in lengths}


def dump_grid_trials(path: str, by_length: dict[int, list[PasskeyTrial]]) -> None:
    """The grid's trials as JSON token ids, each with its `length`, for `benchmarks/peers/kvpress_passkey.py`."""
    with open(path, "w") as f:
        json.dump([asdict(t) | {"length": n} for n, ts in by_length.items() for t in ts], f)


def rows_from_results(
    results: list[dict], cache: str, mode: str, lengths: tuple[int, ...], depths: tuple[float, ...]
) -> list[dict]:
    """One row per (length, depth) cell from per-trial results (`{"length", "depth", "correct", ...}`):
    `{"cache", "mode", "length", "depth", "accuracy", "correct", "trials", "held"}` (`held`: mean slots per KV head
    when the answer starts, when the results have it)."""
    rows = []
    for n in lengths:
        for d in depths:
            cell = [r for r in results if r["length"] == n and math.isclose(r["depth"], d)]
            if not cell:
                raise ValueError(f"no result for the cell length={n}, depth={d}: run every cell of the grid")
            held = [r["held"] for r in cell if r.get("held") is not None]
            rows.append({
                "cache": cache, "mode": mode, "length": n, "depth": d,
                "accuracy": sum(r["correct"] for r in cell) / len(cell), "correct": sum(r["correct"] for r in cell),
                "trials": len(cell), "held": sum(held) / len(held) if held else None,
            })
    return rows


def needle_grid(
    model,
    tokenizer,
    cache_spec: CacheSpec,
    lengths: tuple[int, ...] = (1024, 2048, 4096),
    depths: tuple[float, ...] = (0.1, 0.5, 0.9),
    mode: str = "agnostic",
    trials: int = 3,
    text: str | None = None,
    seed: int = 0,
    new_tokens: int = 8,
) -> list[dict]:
    """Accuracy of `cache_spec` in every (length, depth) cell: one row per cell (`rows_from_results`), plus the
    per-trial answers under `"results"` and the cell's `"seconds"`. `text`: the haystack (default Moby Dick)."""
    from .assets import load_text

    check_mode(mode)
    by_length = grid_trials(tokenizer, text if text is not None else load_text("moby-dick"), lengths, depths, trials,
                            seed)
    rows = []
    for n, cell_trials in by_length.items():
        for d in depths:
            t0 = time.perf_counter()
            results = [run_trial(model, tokenizer, cache_spec, t, new_tokens, 0, mode) | {"length": n}
                       for t in cell_trials if math.isclose(t.depth, d)]
            row = rows_from_results(results, cache_spec.label, mode, (n,), (d,))[0]
            rows.append(row | {"seconds": time.perf_counter() - t0, "results": results})
    return rows


def format_grid(rows: list[dict]) -> str:
    """The grid as text: one line per length, one column per depth (correct / trials), for one (cache, mode)."""
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cell = {(r["length"], r["depth"]): r for r in rows}
    head = f"{rows[0]['cache']} ({rows[0]['mode']})"
    lines = [head, "length  " + "  ".join(f"depth {d:<5g}" for d in depths)]
    for n in lengths:
        lines.append(f"{n:<6d}  " + "  ".join(
            f"{cell[n, d]['correct']:>2d}/{cell[n, d]['trials']:<8d}" if (n, d) in cell else " " * 11 for d in depths))
    total = sum(r["correct"] for r in rows), sum(r["trials"] for r in rows)
    lines.append(f"all     {total[0]}/{total[1]} = {100 * total[0] / total[1]:.1f} %")
    return "\n".join(lines)


def plot_grid(rows: list[dict], path: str, title: str | None = None) -> str:
    """A heatmap PNG of one (cache, mode) grid -- context length down, depth across, accuracy in each cell (with
    correct / trials) -- written to `path` (its folder must exist). Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not rows:
        raise ValueError("no rows to plot: run needle_grid first")
    if len({(r["cache"], r["mode"]) for r in rows}) != 1:
        raise ValueError("plot_grid draws one (cache, mode) grid: pass the rows of one needle_grid call")
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    acc = np.full((len(lengths), len(depths)), np.nan)
    label = [["" for _ in depths] for _ in lengths]
    for r in rows:
        i, j = lengths.index(r["length"]), depths.index(r["depth"])
        acc[i, j] = r["accuracy"]
        label[i][j] = f"{100 * r['accuracy']:.0f} %\n{r['correct']}/{r['trials']}"
    fig, ax = plt.subplots(figsize=(1.4 * len(depths) + 2.2, 0.9 * len(lengths) + 1.6))
    im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i in range(len(lengths)):
        for j in range(len(depths)):
            ax.text(j, i, label[i][j], ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth (fraction of the context)")
    ax.set_ylabel("context tokens")
    ax.set_title(title or f"{rows[0]['cache']}\n{rows[0]['mode']}", fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
