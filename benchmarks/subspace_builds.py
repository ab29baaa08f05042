"""The native subspace kernel built from other sources (an earlier commit's, say) timed beside the current one on one
decode step's partials of a real model.

    git show c838ef4:kernels/native_subspace.c > /tmp/before.c
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/subspace_builds.py /tmp/before.c [--model smollm2-135m] \
        [--tokens 2048] [--rounds 40]

The partials are those `benchmarks/subspace_codes.py` keeps (the `tiered` default after a `--tokens` prompt). Each
source is compiled with the kernel's flags and, in rounds, every build reads them all. Printed per build: the C time
of a step (minimum and median over the rounds), the median of the per-round ratios current / this, and the largest
difference of its partials from the current build's relative to the largest entry.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from hf_kvcache.kernels import native_subspace
from subspace_codes import _Timed, captured_calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", type=Path, help="C sources of the kernel to time beside the current one")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native_subspace.library() is None:
        raise SystemExit("the native subspace kernel is unavailable here (no C compiler, or HF_KVCACHE_NATIVE=0)")
    calls = captured_calls(args.model, args.tokens)
    if not calls:
        raise SystemExit(f"no layer of {args.model} holds a subspace archive after {args.tokens} tokens")
    real = native_subspace.library
    builds = {"current": _Timed(real())}
    for source in args.sources:
        builds[str(source)] = _Timed(native_subspace._compile(source=source))
    outs, times = {}, {name: [] for name in builds}
    try:
        for name, lib in builds.items():
            native_subspace.library = lambda lib=lib: lib
            outs[name] = [native_subspace.coefficient_partial(*c) for c in calls]
        for _ in range(args.rounds):
            for name, lib in builds.items():
                native_subspace.library = lambda lib=lib: lib
                lib.seconds = 0.0
                for c in calls:
                    native_subspace.coefficient_partial(*c)
                times[name].append(lib.seconds * 1e3)
    finally:
        native_subspace.library = real
    print(f"{args.model}, {args.tokens} tokens: {len(calls)} subspace partials a step")
    for name, ts in times.items():
        ratio = statistics.median(c / t for c, t in zip(times["current"], ts))
        diff = max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
                   for got, ref in zip(outs[name], outs["current"]) for x, y in zip(got, ref))
        print(f"{name:20s} C {min(ts):6.2f} ms a step (median {statistics.median(ts):6.2f}); current / this, median "
              f"of the rounds: {ratio:.3f}; largest difference from current {diff:.1e}")


if __name__ == "__main__":
    main()
