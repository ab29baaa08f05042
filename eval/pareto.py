"""Ratio / perplexity Pareto table and plot from `hf-kvcache bench --json` rows.

    hf-kvcache pareto --title smollm2-135m rows_a.json rows_b.json --out docs/pareto/smollm2-135m

Rows of several files merge (a later file's row replaces an earlier one of the same label, so reruns win); every
row needs `cache`, `perplexity`, `ratio` and `delta_pct` (measured against the baseline of its own run, which must be
the same model, text and tokens: every file's baseline must agree; `--tokens N` keeps the rows of N-token runs only,
for files that hold several windows). A row is on the front
when no other row is at least as small (ratio) and at least as good (delta), better in one.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass


@dataclass
class Point:
    """One cache on a front: `ratio` vs fp16 (larger is smaller), `delta_pct` its loss against the baseline (lower is
    better: the perplexity delta in %, or the points a task suite lost), `perplexity` the measured value (perplexity,
    or a suite's accuracy in %), `source` where it comes from."""

    label: str
    ratio: float
    delta_pct: float
    perplexity: float
    source: str

    def dominated_by(self, other: "Point") -> bool:
        return (other.ratio >= self.ratio and other.delta_pct <= self.delta_pct
                and (other.ratio > self.ratio or other.delta_pct < self.delta_pct))


def load_points(paths: list[str], baseline_ppl: float | None = None, tolerance: float = 1e-3,
                tokens: int | None = None) -> list[Point]:
    """Rows of every file (of `tokens`-token runs only, when given), later files winning on a label; the baseline
    rows (delta 0) are checked to agree."""
    points: dict[str, Point] = {}
    for path in paths:
        try:
            with open(path) as f:
                rows = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read bench rows from {path}: {exc}; write them with hf-kvcache bench --json") from exc
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{path} holds no bench rows (a JSON list written by hf-kvcache bench --json)")
        for row in rows:
            missing = [k for k in ("cache", "perplexity", "ratio", "delta_pct") if k not in row]
            if missing:
                raise ValueError(f"a row of {path} lacks {missing}; write it with hf-kvcache bench --json")
            if tokens is not None and row.get("tokens") != tokens:
                continue
            if row["delta_pct"] == 0.0:
                base = row["perplexity"]
                baseline_ppl = base if baseline_ppl is None else baseline_ppl
                if abs(base / baseline_ppl - 1.0) > tolerance:
                    raise ValueError(f"{path}: baseline perplexity {base:.3f} differs from {baseline_ppl:.3f}: rows "
                                     "of different models, texts or token windows cannot share one front")
            points[row["cache"]] = Point(row["cache"], row["ratio"], row["delta_pct"], row["perplexity"], path)
    return list(points.values())


def front(points: list[Point]) -> list[Point]:
    """The non-dominated points, by ratio."""
    return sorted((p for p in points if not any(p.dominated_by(q) for q in points if q is not p)),
                  key=lambda p: p.ratio)


@dataclass(frozen=True)
class Axis:
    """What a front's value and loss are: column names of the table, the plot's y label, and their formats."""

    value: str = "perplexity"
    loss: str = "delta"
    ylabel: str = "perplexity delta vs DynamicCache (%)"
    value_format: str = "{:.3f}"
    loss_format: str = "{:+.2f} %"


PERPLEXITY = Axis()
SUITE_SCORE = Axis("accuracy %", "points lost", "points lost vs the full cache (task average)", "{:.1f}", "{:+.1f}")


def table(points: list[Point], axis: Axis = PERPLEXITY) -> str:
    on = {id(p) for p in front(points)}
    lines = [f"| cache | ratio vs fp16 | {axis.value} | {axis.loss} | Pareto |", "| --- | --- | --- | --- | --- |"]
    for p in sorted(points, key=lambda p: -p.ratio):
        lines.append(f"| {p.label} | {p.ratio:.2f}x | {axis.value_format.format(p.perplexity)} | "
                     f"{axis.loss_format.format(p.delta_pct)} | {'yes' if id(p) in on else ''} |")
    return "\n".join(lines)


def plot(points: list[Point], title: str, path: str, axis: Axis = PERPLEXITY) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    best = front(points)
    ax.plot([p.ratio for p in best], [p.delta_pct for p in best], "-", color="0.7", zorder=1, label="Pareto front")
    for p in points:
        peer = p.label.startswith(("quanto", "hf-", "kvpress"))
        ax.scatter(p.ratio, p.delta_pct, s=28, zorder=2, color="C3" if peer else "C0")
        ax.annotate(p.label, (p.ratio, p.delta_pct), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("symlog", linthresh=5.0)
    ax.set_xlabel("compression vs fp16 DynamicCache (bytes held)")
    ax.set_ylabel(axis.ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("rows", nargs="+", help="bench --json files of one model, text and token window")
    p.add_argument("--title", default="", help="plot title (e.g. the model)")
    p.add_argument("--out", default=None, help="write OUT.md (table) and OUT.png (plot)")
    p.add_argument("--drop", nargs="*", default=[], help="labels to leave out (e.g. the baseline)")
    p.add_argument("--tokens", type=int, default=None, help="only the rows of runs over this many tokens")


def main_args(args: argparse.Namespace) -> int:
    points = [p for p in load_points(args.rows, tokens=args.tokens) if p.label not in set(args.drop)]
    if not points:
        raise ValueError(f"no rows of {args.tokens}-token runs in {args.rows}; drop --tokens or pick a window "
                         "they hold")
    text = table(points)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(f"{args.title}\n\n{text}\n" if args.title else text + "\n")
        plot(points, args.title, args.out + ".png")
        print(f"wrote {args.out}.md and {args.out}.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_kvcache.eval.pareto", description=__doc__.split("\n")[0])
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
