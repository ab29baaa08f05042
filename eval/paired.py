"""Paired comparison of two caches streamed over the same tokens: their perplexity ratio with a bootstrap interval
(and `paired_difference`: two systems' mean scores on the same items, e.g. task samples, with a paired interval).

    hf-kvcache paired 'docs/rows/evict_oe_target_qwen2.5-coder-0.5b.json#cache=snapkv-50%-merge-mass-oe' \\
        'docs/rows/kvpress_qwen2.5-coder-0.5b.json#press=expected_attention,budget=ratio:0.5'

Each side is a rows file and a selector (`#key=value[,key=value]`, every pair must match; the selector may be left out
when the file holds one row) naming a row that carries `chunk_nll`, the summed nll of each chunk's scored tokens
(`hf-kvcache bench` rows, `benchmarks/peers/kvpress_stream.py` rows). Both rows must come from the same token ids:
their chunk counts must agree and, when both rows name their model / start / tokens, so must those.

The ratio is `ppl(A) / ppl(B) = exp((NLL_A - NLL_B) / scored)`. Its interval resamples the chunks with replacement,
the same chunks for both sides (paired), in blocks of `block` consecutive chunks (a cache's state carries from one
chunk to the next, so neighbouring chunks are not independent), and takes the 2.5 / 97.5 % percentiles. It says how
far the gap between two caches on one stream is from what the stream's own chunk-to-chunk variation could give: an
interval that holds 1 means the stream cannot rank them.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import torch

FIRST_CHUNK_LOST = 1  # the first chunk scores chunk - 1 tokens (its first token has no prediction)


@dataclass
class PairedResult:
    """`ratio` = ppl(A) / ppl(B) on the same tokens, `low` / `high` its bootstrap interval, `a_better` the share of
    chunks where A's nll is lower."""

    ratio: float
    low: float
    high: float
    a_better: float
    chunks: int

    def line(self, a: str, b: str) -> str:
        return (f"ppl({a}) / ppl({b}) = {self.ratio:.4f}  (95 % interval {self.low:.4f} .. {self.high:.4f}; "
                f"A lower on {100 * self.a_better:.0f} % of {self.chunks} chunks)")


def chunk_tokens(tokens: int, chunk: int) -> torch.Tensor:
    """Tokens scored in each chunk of a `tokens`-long stream fed in chunks of `chunk` (the first chunk scores one
    fewer, the last may be short)."""
    counts = torch.full((-(-tokens // chunk),), float(chunk))
    counts[-1] = tokens - chunk * (counts.numel() - 1)
    counts[0] -= FIRST_CHUNK_LOST
    return counts


def paired_ratio(a_nll: list[float], b_nll: list[float], tokens: torch.Tensor, block: int = 4,
                 samples: int = 10000, seed: int = 0) -> PairedResult:
    """See the module docstring. `a_nll` / `b_nll`: per-chunk summed nll `[chunks]`; `tokens [chunks]` scored."""
    a, b = torch.tensor(a_nll, dtype=torch.float64), torch.tensor(b_nll, dtype=torch.float64)
    if a.shape != b.shape or a.numel() != tokens.numel():
        raise ValueError(f"the two rows hold {a.numel()} and {b.numel()} chunks ({tokens.numel()} expected): "
                         "compare rows streamed over the same tokens with the same chunk size")
    if not 1 <= block <= a.numel():
        raise ValueError(f"block must be between 1 and the number of chunks ({a.numel()}), got {block}")
    diff, tokens = a - b, tokens.double()
    ratio = math.exp(float(diff.sum() / tokens.sum()))
    n = diff.numel()
    idx = bootstrap_indices(n, block, samples, torch.Generator().manual_seed(seed))
    stats = torch.exp(diff[idx].sum(1) / tokens[idx].sum(1))
    low, high = _interval(stats)
    return PairedResult(ratio, low, high, float((diff < 0).double().mean()), n)


def bootstrap_indices(n: int, block: int, samples: int, generator: torch.Generator) -> torch.Tensor:
    """Moving-block bootstrap: `[samples, n]` indices into `n` items, each resample made of ceil(n / block) blocks of
    `block` consecutive items, each block starting anywhere it fits (`block=1`: items drawn with replacement)."""
    per_sample = -(-n // block)
    starts = torch.randint(0, n - block + 1, (samples, per_sample), generator=generator)
    return (starts[..., None] + torch.arange(block)).reshape(samples, -1)[:, :n]


def _interval(stats: torch.Tensor) -> tuple[float, float]:
    """The 2.5 / 97.5 % percentiles of bootstrap statistics."""
    low, high = torch.quantile(stats.double(), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


@dataclass
class PairedDifference:
    """`difference` = mean score of A - mean score of B over the same items (with groups: the mean over groups of
    each group's mean difference), `low` / `high` its bootstrap interval, over `n` pairs."""

    difference: float
    low: float
    high: float
    n: int


def paired_difference(a: list[float], b: list[float], groups: list | None = None, samples: int = 10000,
                      seed: int = 0) -> PairedDifference:
    """The mean score difference of two systems scored on the same items (`a[i]` and `b[i]`: item i), with a paired
    bootstrap interval: the items are resampled with replacement, the same items for both sides, within each group
    (`groups[i]`: the group of item i, e.g. a task; each group weighs the same in the mean). A group of one item has
    no spread to resample: when any group has fewer than 2 items, every item is one group (each item weighs the
    same); fewer than 2 items in all: no interval (nan). An interval that holds 0 means the items cannot tell the two
    apart."""
    diff = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    if len(a) != len(b) or not len(a):
        raise ValueError(f"give the two systems' scores on the same items, at least one: got {len(a)} and {len(b)}")
    groups = [0] * len(a) if groups is None else list(groups)
    if len(groups) != len(a):
        raise ValueError(f"groups names the group of each item: {len(groups)} groups for {len(a)} items")
    if len(a) < 2:
        return PairedDifference(float(diff.mean()), math.nan, math.nan, len(a))
    if min(groups.count(name) for name in set(groups)) < 2:
        groups = [0] * len(a)
    g = torch.Generator().manual_seed(seed)
    means, stats = [], torch.zeros(samples, dtype=torch.float64)
    for name in dict.fromkeys(groups):  # in order of first appearance
        d = diff[torch.tensor([x == name for x in groups])]
        means.append(float(d.mean()))
        stats += d[bootstrap_indices(d.numel(), 1, samples, g)].mean(1)
    low, high = _interval(stats / len(means))
    return PairedDifference(sum(means) / len(means), low, high, len(a))


def paired_time_ratio(a: list[float], b: list[float], samples: int = 10000,
                      seed: int = 0) -> tuple[float, float, float]:
    """`sum(a) / sum(b)` of two timings taken in turns (`a[i]` and `b[i]`: round i, e.g. the summed step times of
    two decoders in one round of the decode suite) and its 95 % paired bootstrap interval (the rounds resampled with
    replacement, the same rounds for both). With `a` the baseline's times it is `b`'s speed relative to `a`'s; an
    interval that holds 1 means the rounds cannot tell the two apart. Fewer than 2 rounds: no interval (nan).

    Returns:
        (ratio, low, high)."""
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if ta.shape != tb.shape or not ta.numel():
        raise ValueError(f"give both timings for the same rounds, at least one: got {ta.numel()} and {tb.numel()}")
    if bool((ta <= 0).any() or (tb <= 0).any()):
        raise ValueError("times must be positive")
    ratio = float(ta.sum() / tb.sum())
    if ta.numel() < 2:
        return ratio, math.nan, math.nan
    idx = bootstrap_indices(ta.numel(), 1, samples, torch.Generator().manual_seed(seed))
    low, high = _interval(ta[idx].sum(1) / tb[idx].sum(1))
    return ratio, low, high


def select_row(spec: str) -> dict:
    """The row `FILE#key=value,...` names (see the module docstring)."""
    path, _, selector = spec.partition("#")
    with open(path) as f:
        rows = json.load(f)
    rows = rows if isinstance(rows, list) else [rows]
    pairs = [pair for pair in selector.split(",") if pair]
    if any("=" not in pair for pair in pairs):
        raise ValueError(f"selector {selector!r}: use key=value pairs separated by commas, e.g. cache=tova-50%")
    wanted = dict(pair.split("=", 1) for pair in pairs)
    found = [r for r in rows if all(str(r.get(k)) == v for k, v in wanted.items())]
    if len(found) != 1:
        labels = [r.get("cache") or f"{r.get('press')} {r.get('budget')}" for r in rows]
        raise ValueError(f"{spec}: {len(found)} rows match (need exactly 1); rows there: {labels}")
    if not found[0].get("chunk_nll"):
        raise ValueError(f"{spec}: the row has no chunk_nll; rerun it (bench and kvpress_stream rows record it)")
    return found[0]


def compare_rows(a: dict, b: dict, chunk: int = 32, block: int = 4, samples: int = 10000) -> PairedResult:
    """`paired_ratio` of two rows (`select_row`) streamed over the same `tokens` ids in chunks of `chunk`."""
    for key in ("model", "text", "start", "tokens"):
        if key in a and key in b and a[key] != b[key]:
            raise ValueError(f"the rows disagree on {key} ({a[key]!r} vs {b[key]!r}): compare the same token ids")
    tokens = a.get("tokens") or b.get("tokens") or chunk * len(a["chunk_nll"])
    return paired_ratio(a["chunk_nll"], b["chunk_nll"], chunk_tokens(tokens, chunk), block, samples)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="FILE#key=value,... of cache A")
    p.add_argument("b", nargs="+", help="FILE#key=value,... of each cache B compared with A")
    p.add_argument("--chunk", type=int, default=32, help="the chunk size both rows were streamed with")
    p.add_argument("--block", type=int, default=4, help="consecutive chunks resampled together")
    p.add_argument("--samples", type=int, default=10000)


def main_args(args: argparse.Namespace) -> int:
    a = select_row(args.a)
    for spec in args.b:
        result = compare_rows(a, select_row(spec), args.chunk, args.block, args.samples)
        print(result.line("A", "B"), f"   A={args.a}  B={spec}")
    return 0
