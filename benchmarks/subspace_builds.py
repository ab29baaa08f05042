"""The native subspace kernel built from other sources (an earlier commit's, say) timed beside the current one on one
decode step's partials of a real model.

    git show c838ef4:kernels/native_subspace.c > /tmp/before.c
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/subspace_builds.py /tmp/before.c [--model smollm2-135m] \
        [--tokens 2048] [--rounds 40]

The partials are those `benchmarks/subspace_codes.py` keeps (the `tiered` default after a `--tokens` prompt). Each
source is compiled with the kernel's flags and, in rounds, every build reads them all. Printed per build: the C time
of a step (minimum and median over the rounds), the median of the per-round ratios current / this, and the largest
difference of its partials from the current build's relative to the largest entry. A source from before the kernel
read fp16 scales (`subspace_abi()` below 2: commits before 5596efc) takes other argument types: its build refuses to
load.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from hf_kvcache.kernels import native_subspace
from subspace_codes import _Timed, parsed_step, time_builds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", type=Path, help="C sources of the kernel to time beside the current one")
    args, calls = parsed_step(ap, rounds=40)
    builds = {"current": _Timed(native_subspace.library())}
    for source in args.sources:
        builds[str(source)] = _Timed(native_subspace._compile(source=source))
    outs, times = time_builds(builds, calls, args.rounds)
    print(f"{args.model}, {args.tokens} tokens: {len(calls)} subspace partials a step")
    for name, ts in times.items():
        ratio = statistics.median(c / t for c, t in zip(times["current"], ts))
        diff = max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
                   for got, ref in zip(outs[name], outs["current"]) for x, y in zip(got, ref))
        print(f"{name:20s} C {min(ts):6.2f} ms a step (median {statistics.median(ts):6.2f}); current / this, median "
              f"of the rounds: {ratio:.3f}; largest difference from current {diff:.1e}")


if __name__ == "__main__":
    main()
