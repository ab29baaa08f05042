"""How well the online quality proxy (`cache.quality_metrics()["proxy"]`) predicts the measured perplexity delta.

    hf-kvcache proxy-check rows_model_a.json rows_model_b.json ...

Reads `hf-kvcache bench --json` rows (every row of a cache with `quality_metrics` carries `proxy`), and prints the
Pearson and Spearman correlation of proxy and delta per file and pooled over all files.
"""

from __future__ import annotations

import argparse
import json

import torch


def pairs(path: str) -> list[tuple[str, float, float]]:
    """(label, proxy, delta %) of every row of `path` that has a proxy."""
    with open(path) as f:
        rows = json.load(f)
    return [(r["cache"], float(r["proxy"]), float(r["delta_pct"])) for r in rows if "proxy" in r]


def _ranks(x: torch.Tensor) -> torch.Tensor:
    r = torch.empty_like(x)
    r[x.argsort()] = torch.arange(len(x), dtype=x.dtype)
    return r


def correlation(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(Pearson, Spearman) of two equally long lists (at least 3 points)."""
    if len(xs) != len(ys) or len(xs) < 3:
        raise ValueError(f"need at least 3 (proxy, delta) pairs, got {len(xs)}; bench more caches with --json")
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)

    def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-300))

    return pearson(x, y), pearson(_ranks(x), _ranks(y))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("rows", nargs="+", help="bench / compare --json files")


def main_args(args: argparse.Namespace) -> int:
    """`hf-kvcache proxy-check`: the correlation table of the files `args.rows`."""
    pooled: list[tuple[str, float, float]] = []
    print("| rows | points | Pearson | Spearman |\n| --- | --- | --- | --- |")
    for path in args.rows:
        pts = pairs(path)
        pooled += pts
        if len(pts) >= 3:
            r, s = correlation([q for _, q, _ in pts], [d for _, _, d in pts])
            print(f"| {path} | {len(pts)} | {r:.3f} | {s:.3f} |")
    r, s = correlation([q for _, q, _ in pooled], [d for _, _, d in pooled])
    print(f"| pooled | {len(pooled)} | {r:.3f} | {s:.3f} |")
    return 0
