"""`--suite adapt`: convergence of `adapt_thresholds` on real text: samples vs hot boundary / archive bits /
perplexity delta / ratio.

    hf-kvcache compare --suite adapt --model smollm2-135m --start 20000 --out docs/adapt

Each sample is one window of `--tokens` (512) consecutive real tokens of `--text` from `--start` (windows are taken
in order and reused cyclically after `--windows`), streamed in chunks of `--chunk` (32) through a tiered cache that
is `reset()` before each window
(`streaming_perplexity`, as the benchmarks measure it, with the cache attached as `generate` would). The feedback
is that window's perplexity delta against `DynamicCache` on the same window (computed once per window and kept).
The cache then adapts its thresholds (`AdaptiveThresholds.adapt_thresholds`, the default hysteresis-safe rule) and
the next sample runs with them. One run per `--starts` point (deliberately bad ones: too little memory, too much),
`--steps` samples each; the tiered options (`--tiered`, JSON over these defaults) make the archive matter at this
length (no warm tier, no rotation, so the thresholds are the only knobs). Rows: one per sample (the `FIELDS`), the cache named by its start
point; with `--out`, also `convergence.csv`, `convergence.png` and `summary.json` (each run's settling) in that folder.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hf_kvcache import TieredQuantCache
from hf_kvcache.calibrate import Feedback, Thresholds
from hf_kvcache.registry import attached

from ..assets import load_model, load_text, load_tokens
from ..perplexity import streaming_perplexity
from ..rows import Row, make_row
from .options import SuiteOptions, option

DEFAULT_TIERED = {"warm_length": 0, "rotation": "none"}
FIELDS = ["start", "sample", "window", "token_start", "tail_length", "archive_bits", "ppl", "ref_ppl", "delta",
          "verdict", "ratio", "bytes", "fp16_bytes", "next_tail_length", "next_archive_bits", "seconds"]




@dataclass
class AdaptOptions(SuiteOptions):
    """`--suite adapt`: the start points, the feedback rule's target and margin, the windows and samples."""

    starts: list[str] = option(["16:2", "512:4"], "start points TAIL:BITS of the thresholds", type=str, nargs="+")
    steps: int = option(80, "samples (windows streamed, then adapted on) per start point")
    windows: int = option(40, "distinct consecutive windows (reused cyclically)")
    target: float = option(0.03, "perplexity delta the feedback aims under")
    margin: float = option(0.5, "fraction of the target below which the feedback says there is room")
    tiered: str = option(json.dumps(DEFAULT_TIERED), "other tiered options (JSON)")
    out: str | None = option(None, "folder for convergence.csv, convergence.png and summary.json", type=str)


OPTIONS = AdaptOptions


def parse_start(text: str) -> Thresholds:
    try:
        tail, bits = text.split(":")
        return Thresholds(int(tail), int(bits))
    except ValueError as exc:
        raise ValueError(f"--starts {text!r}: write TAIL:BITS, e.g. 16:2 ({exc})") from None


def settled_at(rows: list[dict]) -> int:
    """The first sample from which the thresholds never changed again (1-based; 1: never changed)."""
    last = 0
    for r in rows:
        if (r["next_tail_length"], r["next_archive_bits"]) != (r["tail_length"], r["archive_bits"]):
            last = r["sample"]
    return last + 1


def convergence(model_name: str, text: str, token_start: int, window: int, windows: int, samples: int, chunk: int,
                starts: list[Thresholds], target: float, margin: float, tiered: dict, out=None
                ) -> tuple[list, dict]:
    """The rows (one per sample and start point, `FIELDS`) and the summary (each run's settling) of the
    experiment the module docstring describes; a progress line per sample to `out` (None: the current
    `sys.stdout`)."""
    out = out or sys.stdout
    torch.manual_seed(0)
    model, tokenizer = load_model(model_name)
    ids = load_tokens(tokenizer, load_text(text), token_start, window * windows)
    cls = TieredQuantCache
    refs: dict[int, float] = {}

    def reference(w: int) -> float:
        if w not in refs:
            seg = ids[:, w * window : (w + 1) * window]
            refs[w] = streaming_perplexity(model, seg, DynamicCache(config=model.config), chunk).perplexity
        return refs[w]

    rows: list[dict] = []
    summary: dict = {"model": model_name, "text": text, "token_start": token_start, "window": window,
                     "windows": windows, "samples": samples, "chunk": chunk, "target": target, "margin": margin,
                     "tiered": tiered, "rule": dataclasses.asdict(cls.adapt_rule), "runs": []}
    for start in starts:
        cache = cls(config=model.config, **{**tiered, "tail_length": start.tail_length,
                                            "archive_bits": start.archive_bits})
        run_rows = []
        for i in range(samples):
            w = i % windows
            ref = reference(w)
            seg = ids[:, w * window : (w + 1) * window]
            before = cache.thresholds()
            cache.reset()
            t0 = time.perf_counter()
            with attached(model, cache):
                r = streaming_perplexity(model, seg, cache, chunk)
            seconds = time.perf_counter() - t0
            fb = Feedback.from_perplexity(r.perplexity, ref, target=target, margin=margin)
            after = cache.adapt_thresholds(fb)
            row = {"start": f"{start.tail_length}:{start.archive_bits}", "sample": i + 1, "window": w,
                   "token_start": token_start + w * window, "tail_length": before.tail_length,
                   "archive_bits": before.archive_bits, "ppl": round(r.perplexity, 4), "ref_ppl": round(ref, 4),
                   "delta": round(fb.delta, 6), "verdict": fb.verdict, "ratio": round(r.ratio, 4),
                   "bytes": r.bytes, "fp16_bytes": r.fp16_bytes, "next_tail_length": after.tail_length,
                   "next_archive_bits": after.archive_bits, "seconds": round(seconds, 2)}
            run_rows.append(row)
            print(f"[{row['start']} {i + 1}/{samples}] window {w}: tail {before.tail_length} bits "
                  f"{before.archive_bits}: ppl {r.perplexity:.3f} vs {ref:.3f} ({100 * fb.delta:+.2f} %, "
                  f"{fb.verdict}), {r.ratio:.2f}x -> tail {after.tail_length} bits {after.archive_bits}",
                  file=out, flush=True)
        rows += run_rows
        s = settled_at(run_rows)
        after_settle = [r for r in run_rows if r["sample"] >= s]
        summary["runs"].append({
            "start": start.to_dict(), "final": cache.thresholds().to_dict(), "settled_at_sample": s,
            "samples_after_settling": len(after_settle),
            "max_delta_after_settling": max(r["delta"] for r in after_settle) if after_settle else None,
            "mean_delta_after_settling": (sum(r["delta"] for r in after_settle) / len(after_settle)
                                          if after_settle else None),
            "ratio_after_settling": after_settle[-1]["ratio"] if after_settle else None,
            "threshold_changes": sum((r["next_tail_length"], r["next_archive_bits"])
                                     != (r["tail_length"], r["archive_bits"]) for r in run_rows),
        })
    return rows, summary


def plot(rows: list[dict], summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    for run_summary in summary["runs"]:
        label = "start tail {tail_length}, {archive_bits} bits".format(**run_summary["start"])
        key = "{tail_length}:{archive_bits}".format(**run_summary["start"])
        rs = [r for r in rows if r["start"] == key]
        x = [r["sample"] for r in rs]
        line = axes[0].step(x, [r["tail_length"] for r in rs], where="post", label=label)[0]
        c = line.get_color()
        axes[1].step(x, [r["archive_bits"] for r in rs], where="post", color=c)
        axes[2].plot(x, [100 * r["delta"] for r in rs], ".-", color=c, lw=0.8, ms=3)
        axes[3].plot(x, [r["ratio"] for r in rs], ".-", color=c, lw=0.8, ms=3)
        for ax in axes:
            ax.axvline(run_summary["settled_at_sample"], color=c, ls=":", lw=1)
    t, m = 100 * summary["target"], 100 * summary["target"] * summary["margin"]
    axes[2].axhspan(m, t, color="green", alpha=0.12, label=f"within target, no margin ({m:g}..{t:g} %)")
    axes[2].axhline(t, color="red", lw=0.8, label=f"target {t:g} %")
    axes[0].set_ylabel("hot boundary\n(tail_length)")
    axes[1].set_ylabel("archive bits")
    axes[1].set_yticks([2, 3, 4])
    axes[2].set_ylabel("perplexity delta\nvs DynamicCache (%)")
    axes[3].set_ylabel("ratio vs fp16")
    axes[3].set_xlabel("sample (window of %d tokens)" % summary["window"])
    axes[0].legend(loc="upper right", fontsize=8)
    axes[2].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"adapt_thresholds on {summary['model']}, {summary['text']} (dotted: settled)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(opts: AdaptOptions) -> list[Row]:
    """`--suite adapt`: see the module docstring."""
    import hf_kvcache  # noqa: F401  (registers the cache names and the attention)
    from hf_kvcache.options import parse_options_json

    tiered = parse_options_json(opts.tiered, "--tiered")
    starts = [parse_start(t) for t in opts.starts]
    if opts.steps < 1 or opts.windows < 1:
        raise ValueError(f"--steps ({opts.steps}) and --windows ({opts.windows}) must be >= 1")
    if opts.out and not os.path.isdir(opts.out):
        raise ValueError(f"--out {opts.out!r} is not a folder; create it first (mkdir -p {opts.out})")
    window, chunk = opts.one_length(512), opts.chunk or 32
    t0 = time.perf_counter()
    rows, summary = convergence(opts.model, opts.text, opts.start, window, opts.windows, opts.steps, chunk, starts,
                                opts.target, opts.margin, tiered)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["threads"] = torch.get_num_threads()
    for r in summary["runs"]:
        if not r["samples_after_settling"]:
            print(f"start {r['start']}: still moving at the last sample ({r['threshold_changes']} changes), "
                  f"now {r['final']}")
            continue
        print(f"start {r['start']}: settled at sample {r['settled_at_sample']} on {r['final']} "
              f"({r['threshold_changes']} changes); after settling: {r['samples_after_settling']} samples, "
              f"max delta {100 * r['max_delta_after_settling']:+.2f} %, "
              f"mean {100 * r['mean_delta_after_settling']:+.2f} %, ratio {r['ratio_after_settling']:.2f}x")
    if opts.out:
        with open(os.path.join(opts.out, "convergence.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(opts.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        plot(rows, summary, os.path.join(opts.out, "convergence.png"))
        print(f"wrote {opts.out}/convergence.csv, convergence.png, summary.json")
    return [make_row("adapt", f"start {r['start']}", opts.model, window, **{k: v for k, v in r.items() if k != "start"})
            for r in rows]
