"""One-shot GPU check (`hf-kvcache gpu-check --out DIR`): everything the library needs to know from one short lease of
a CUDA GPU, written as `gpu_check.json` and a markdown table `gpu_check.md` into DIR after every section (a run cut
off by its time limit still leaves what it measured).

Sections, in order, each bounded by a share of `--budget-s`:
  environment  versions, device, SMs, memory
  bandwidth    device-to-device copy (bytes read + written / time): the ceiling the decode kernels are read against
  correctness  every Triton kernel the library launches against its torch reference (the same codes, dequantized, and
               softmax attention in fp32 on the CPU): KIVI-layout segments (2 / 4 / 8 bits, groups 32 / 64, head dims
               64 / 128 / 256, GQA 1 / 4 / 8, with and without a key mask, the attention mass), per-token segments
               (int4 / int8, keys as they come or pre-RoPE), subspace archives (keys pre-RoPE or as they come, with
               and without a key mask), the KIVI pack kernels against the torch quantizer
  decode       decode attention (one query position) of the tiered / int4 / int8 / KIVI caches, filled with random
               bf16 keys and values in 4K-token chunks, and of a subspace archive (the tiered archive in fitted bases,
               pre-RoPE keys, built from random keys and values: no cache chooses it without queries), against SDPA
               over the bf16 cache (flash backend where it takes the shape): 4K / 32K / 128K tokens, batch 1 and 8,
               head dims 64 and 128, 8 KV heads x 4 query heads each; milliseconds (median of CUDA-event timings),
               bytes read, GB/s and its share of the copy bandwidth
  sweep        the KIVI-layout decode kernel's launch knobs (tokens per tile, warps, fp16 dots, programs per SM) at 32K
  generate     `generate` tokens/s in bf16 with a random-weight model of a zoo architecture (speed does not depend on
               the weights' values) and a long random prompt, per cache, prefill and decode timed apart

Without CUDA the command fails with a ValueError (nothing is skipped silently); `--dry-run` runs the same sections
with tiny sizes on the CPU (no Triton: the torch paths), so the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .gpu_generate import generate_timing
from .gpu_sections import Deadline, copy_bandwidth, correctness, decode_timing, environment, kernel_sweep

SECTIONS = ("environment", "bandwidth", "correctness", "decode", "sweep", "generate")


@dataclass
class CheckOptions:
    """What the check runs; the defaults are the one-shot run on a GPU (the budget: about 6 minutes)."""

    out: Path
    budget_s: float = 360.0
    dry_run: bool = False
    lengths: tuple[int, ...] = (32768, 4096, 131072)  # 32K first: the target
    batches: tuple[int, ...] = (1, 8)
    head_dims: tuple[int, ...] = (128, 64)
    caches: tuple[str, ...] = ("tiered", "int4", "int8", "kivi", "subspace archive")
    kv_heads: int = 8
    group: int = 4
    iters: int = 20
    model: str = "qwen2.5-coder-0.5b"
    prompt_tokens: int = 32768
    new_tokens: int = 32
    generate_caches: tuple[str, ...] = ("dynamic", "int8", "int4", "tiered", "kivi")
    sections: tuple[str, ...] = SECTIONS  # the ones to run (their shares of the budget scaled to sum to one)
    # the share of the budget each section may use (what is left over passes on to the next)
    shares: dict[str, float] = field(default_factory=lambda: dict(
        environment=0.01, bandwidth=0.02, correctness=0.22, decode=0.33, sweep=0.14, generate=0.28))

    @classmethod
    def dry(cls, out: Path) -> "CheckOptions":
        """Tiny sizes for a run on the CPU (tests, and the dry run of the command)."""
        return cls(out=out, budget_s=120.0, dry_run=True, lengths=(256,), batches=(1,), head_dims=(64,),
                   iters=2, model="smollm2-135m", prompt_tokens=128, new_tokens=3,
                   generate_caches=("dynamic", "int4"))


class Report:
    """Sections of results, written to `out` after every change."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, object] = {}

    def put(self, section: str, value: object) -> None:
        self.data[section] = value
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "gpu_check.md").write_text(render_markdown(self.data))


# ---- the run --------------------------------------------------------------------------------------------------------
def run(opts: CheckOptions) -> dict:
    """Run every section within the budget; returns the report's data (also written to `opts.out`)."""
    device = "cpu" if opts.dry_run else "cuda"
    if not opts.dry_run and not torch.cuda.is_available():
        raise ValueError("gpu-check needs a CUDA GPU and torch built with CUDA; none is visible here (use --dry-run "
                         "to run the script with tiny sizes on the CPU)")
    unknown = set(opts.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown gpu-check sections {sorted(unknown)}: choose among {', '.join(SECTIONS)}")
    report = Report(opts.out)
    start = time.monotonic()
    spent_share = 0.0
    copy_gbps = None
    chosen = [s for s in SECTIONS if s in opts.sections]
    total_share = sum(opts.shares[s] for s in chosen)
    for section in chosen:
        spent_share += opts.shares[section] / total_share
        deadline = Deadline(start + opts.budget_s * spent_share - time.monotonic())
        t0 = time.monotonic()
        try:
            if section == "environment":
                result = environment(device)
            elif section == "bandwidth":
                result = copy_bandwidth(device, opts.dry_run)
                copy_gbps = result["gb_per_s"]
            elif section == "correctness":
                result = correctness(device, opts, deadline)
            elif section == "decode":
                result = decode_timing(device, opts, deadline, copy_gbps)
            elif section == "sweep":
                result = kernel_sweep(device, opts, deadline) if not opts.dry_run else []
            else:
                result = generate_timing(device, opts, deadline)
        except Exception as exc:
            result = dict(error=f"{type(exc).__name__}: {exc}"[:500], trace=traceback.format_exc(limit=8)[-2000:])
        report.put(section, result)
        report.put(f"{section}_seconds", round(time.monotonic() - t0, 1))
        print(f"[gpu-check] {section}: {time.monotonic() - t0:.1f} s", flush=True)
    return report.data


# ---- rendering ------------------------------------------------------------------------------------------------------
def _table(rows: list[dict], columns: list[str]) -> str:
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return "(none)\n"
    columns = [c for c in columns if any(c in r for r in rows)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x).replace("|", "/").replace("\n", " ")


def render_markdown(data: dict) -> str:
    parts = ["# hf-kvcache gpu-check\n"]
    env = data.get("environment")
    if isinstance(env, dict):
        parts.append(", ".join(f"{k} {v}" for k, v in env.items()) + "\n")
    bw = data.get("bandwidth")
    if isinstance(bw, dict) and "gb_per_s" in bw:
        parts.append(f"Copy bandwidth (read + written): {bw['gb_per_s']:,.0f} GB/s\n")
    for name, cols in (("correctness", ["case", "qdtype", "ok", "out_err", "out_scale", "mass_err", "codes_differ",
                                        "scale_err", "error"]),
                       ("decode", ["head_dim", "batch", "tokens", "cache", "ms", "vs_sdpa", "graph_ms", "graph_vs_sdpa",
                                   "bytes", "gb_per_s", "bw_share", "graph_bw_share", "segments", "error",
                                   "graph_error"]),
                       ("sweep", ["head_dim", "bits", "group", "batch", "kernel", "prerope", "block", "num_warps",
                                  "dot_f32", "waves", "num_stages", "default", "ms", "graph_ms", "gb_per_s", "max_err",
                                  "error", "setting"]),
                       ("generate", ["model", "prompt", "cache", "prefill_s", "decode_tok_s", "vs_dynamic",
                                     "peak_gib", "new_tokens", "error"])):
        value = data.get(name)
        if value is None:
            continue
        parts.append(f"\n## {name} ({data.get(f'{name}_seconds', '?')} s)\n")
        parts.append(_table(value, cols) if isinstance(value, list) else f"```\n{json.dumps(value, indent=1)}\n```\n")
    return "\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--budget-s", type=float, default=360.0, help="seconds for the whole check (default 360)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: tests the script, measures nothing")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS, metavar="SECTION",
                   help=f"the sections to run, in their fixed order (default all: {' '.join(SECTIONS)})")


def main_args(args: argparse.Namespace) -> int:
    opts = CheckOptions.dry(args.out) if args.dry_run else CheckOptions(out=args.out, budget_s=args.budget_s)
    opts.sections = tuple(args.sections)
    data = run(opts)
    print((args.out / "gpu_check.md").read_text())
    failed = [r for r in data.get("correctness", []) if isinstance(r, dict) and r.get("ok") is False]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hf_kvcache.eval.gpu_check`: the same as `hf-kvcache gpu-check`, importing nothing else of the CLI
    (a GPU machine may lack the codec's packages)."""
    p = argparse.ArgumentParser(prog="python -m hf_kvcache.eval.gpu_check", description=__doc__.split("\n")[0])
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
