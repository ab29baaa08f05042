"""Bit-identity check for refactors: the streaming perplexity and bytes held of a fixed list of cache configurations.

Every configuration of `configs.json` (a `hf-kvcache bench --caches` spec: `label=name:{json options}`) runs through
`hf_kvcache.eval.bench.run_benchmark` -- the path of `hf-kvcache bench --decode-steps 0` -- on each listed model and
the same tokens of the same text. Per configuration it records the perplexity (`repr` of the float: every digit), the
sum of the per-chunk NLLs, a hash of the list of per-chunk NLLs, and the bytes held. A refactor that claims to change
no result must reproduce the saved file exactly:

    OMP_NUM_THREADS=1 python benchmarks/identity/run.py --out benchmarks/identity/before.json    # unchanged code
    OMP_NUM_THREADS=1 python benchmarks/identity/run.py --check benchmarks/identity/before.json  # after the change

`--check` runs the list again and exits with status 1, listing every field that differs, on any difference (or a
configuration missing from the new run). Run with one thread (`OMP_NUM_THREADS=1`): reductions split over threads
may round differently from run to run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIELDS = ("perplexity", "nll_sum", "chunk_nll_sha256", "bytes", "fp16_bytes", "tokens")


def measure(spec_text: str, model: str, settings: dict) -> dict:
    """Run one configuration on one model; the fields compared by `--check` (floats as `repr` strings).

    Args:
        spec_text: a `--caches` spec (`label=name:{json}`).
        model: a zoo model name (`hf_kvcache.eval.assets`).
        settings: `text`, `start`, `tokens`, `chunk` of `configs.json`.
    Returns:
        `{"spec", "perplexity", "nll_sum", "chunk_nll_sha256", "bytes", "fp16_bytes", "tokens", "seconds"}`.
    """
    from hf_kvcache.eval.bench import parse_specs, run_benchmark

    (spec,) = parse_specs([spec_text])
    t0 = time.perf_counter()
    (row,) = run_benchmark([spec], model_name=model, text=settings["text"], start=settings["start"],
                           tokens=settings["tokens"], chunk=settings["chunk"], decode_steps=0, progress=False)
    nll = row["chunk_nll"]
    return {
        "spec": spec_text,
        "perplexity": repr(row["perplexity"]),
        "nll_sum": repr(sum(nll)),
        "chunk_nll_sha256": hashlib.sha256(" ".join(map(repr, nll)).encode()).hexdigest(),
        "bytes": row["bytes"],
        "fp16_bytes": row["fp16_bytes"],
        "tokens": row["tokens"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def label_of(spec_text: str) -> str:
    from hf_kvcache.eval.bench import CacheSpec

    return CacheSpec.parse(spec_text).label


def differences(saved: dict, new: dict) -> list[str]:
    """Every (model, configuration, field) whose value differs between two result files, and what is missing."""
    out = []
    for model, rows in saved["results"].items():
        for label, row in rows.items():
            got = new["results"].get(model, {}).get(label)
            if got is None:
                out.append(f"{model} / {label}: missing from the new run")
                continue
            out += [f"{model} / {label} / {f}: {row[f]!r} -> {got[f]!r}" for f in FIELDS if row.get(f) != got.get(f)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=str(HERE / "configs.json"), help="the list of configurations")
    parser.add_argument("--out", help="write the results here (rewritten after every configuration)")
    parser.add_argument("--check", help="a saved result file: fail on any difference from it")
    parser.add_argument("--only", nargs="*", help="run only these labels (a subset: --check compares those)")
    parser.add_argument("--models", nargs="*", help="run only these models")
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("warning: run with OMP_NUM_THREADS=1 for deterministic results", file=sys.stderr)
    settings = json.loads(Path(args.configs).read_text())
    models = args.models or settings["models"]
    specs = [s for s in settings["configs"] if not args.only or label_of(s) in args.only]
    if args.only and len(specs) != len(args.only):
        raise SystemExit(f"--only names labels not in {args.configs}: {sorted(set(args.only) - set(map(label_of, specs)))}")
    result = {
        "command": "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "") + " python " + " ".join(sys.argv),
        "settings": {k: settings[k] for k in ("text", "start", "tokens", "chunk")},
        "results": {},
    }
    for model in models:
        rows = result["results"].setdefault(model, {})
        for spec_text in specs:
            label = label_of(spec_text)
            rows[label] = measure(spec_text, model, settings)
            print(f"{model} {label}: ppl {rows[label]['perplexity']} bytes {rows[label]['bytes']} "
                  f"({rows[label]['seconds']} s)", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if not args.check:
        return 0
    saved = json.loads(Path(args.check).read_text())
    if saved["settings"] != result["settings"]:
        raise SystemExit(f"settings differ from {args.check}: {saved['settings']} vs {result['settings']}")
    wanted = set(map(label_of, specs))  # a subset run (--only / --models) compares that subset
    saved["results"] = {m: {lab: row for lab, row in rows.items() if lab in wanted}
                        for m, rows in saved["results"].items() if m in models}
    diff = differences(saved, result)
    compared = sum(len(rows) for rows in saved["results"].values())
    if diff:
        print(f"DIFFERENT: {len(diff)} field(s) differ from {args.check}:\n  " + "\n  ".join(diff))
        return 1
    print(f"IDENTICAL: {compared} (model, configuration) results equal {args.check} in {', '.join(FIELDS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
