"""The native subspace kernel's two ways of reading codes, timed side by side on one decode step of a real model.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/subspace_codes.py [--model smollm2-135m] [--tokens 2048] \
        [--rounds 60]

The `tiered` default prefills `--tokens` tokens of Moby Dick (from 5000) in 512-token forwards under the fused
attention, decodes 10 steps, and the 11th step's subspace partials (`native_subspace.coefficient_partial`, one call a
layer that holds a subspace archive) are kept. Then, in rounds, each build reads them all: the default one (a row of
codes by one AVX-512 VBMI byte permutation where the CPU has it) and the one built with
`-DHF_KVCACHE_SCALAR_CODES` (a subspace at a time). Printed: whether the two builds' partials are the same bits, and
per build the C time of a step (minimum and median over the rounds) with the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_kvcache.eval.assets import load_model, load_text, load_tokens
from hf_kvcache.eval.bench import CacheSpec
from hf_kvcache.kernels import native_subspace


def captured_calls(model_name: str, tokens: int) -> list[tuple]:
    """(q, segment, key_valid) of every subspace partial of one decode step after a `tokens`-token prompt."""
    model, tok = load_model(model_name)
    ids = load_tokens(tok, load_text("moby-dick"), 5000, tokens + 16)
    cache = CacheSpec.parse("tiered").build(model)
    cache.bind(model)
    model.set_attn_implementation("hf_kvcache")
    calls, real = [], native_subspace.launch
    with torch.inference_mode():
        for s in range(0, tokens, 512):
            model(input_ids=ids[:, s : s + 512], past_key_values=cache, use_cache=True)
        for i in range(10):
            model(input_ids=ids[:, tokens + i : tokens + i + 1], past_key_values=cache, use_cache=True)
        def kept(q, seg, valid):
            calls.append((q.clone(), seg, valid))
            return real(q, seg, valid)

        native_subspace.launch = kept  # the step's calls and `coefficient_partial`'s all go through `launch`
        try:
            model(input_ids=ids[:, tokens + 10 : tokens + 11], past_key_values=cache, use_cache=True)
        finally:
            native_subspace.launch = real
    return calls


class _Timed:
    """A kernel library whose calls add their wall time to `seconds`."""

    def __init__(self, lib) -> None:
        self.lib, self.seconds = lib, 0.0

    def __getattr__(self, name: str):
        fn = getattr(self.lib, name)

        def timed(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            self.seconds += time.perf_counter() - t0
            return out

        return timed


def time_builds(builds: dict[str, _Timed], calls: list[tuple], rounds: int) -> tuple[dict, dict]:
    """Each build's partials of `calls` (name -> list of partials) and, over `rounds` rounds taking turns, the C time of
    each build reading them all (name -> ms a round)."""
    real = native_subspace.library
    outs, times = {}, {name: [] for name in builds}
    try:
        for name, lib in builds.items():
            native_subspace.library = lambda lib=lib: lib
            outs[name] = [native_subspace.coefficient_partial(*c) for c in calls]
        for _ in range(rounds):
            for name, lib in builds.items():
                native_subspace.library = lambda lib=lib: lib
                lib.seconds = 0.0
                for c in calls:
                    native_subspace.coefficient_partial(*c)
                times[name].append(lib.seconds * 1e3)
    finally:
        native_subspace.library = real
    return outs, times


def parsed_step(ap: argparse.ArgumentParser, rounds: int) -> tuple[argparse.Namespace, list[tuple]]:
    """`ap`'s arguments with `--model`, `--tokens` and `--rounds` added, and the captured partials of that step (on
    one thread); exits where the kernel is unavailable or no layer holds a subspace archive."""
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=rounds)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native_subspace.library() is None:
        raise SystemExit("the native subspace kernel is unavailable here (no C compiler, or HF_KVCACHE_NATIVE=0)")
    calls = captured_calls(args.model, args.tokens)
    if not calls:
        raise SystemExit(f"no layer of {args.model} holds a subspace archive after {args.tokens} tokens")
    return args, calls


def main() -> None:
    args, calls = parsed_step(argparse.ArgumentParser(description=__doc__.splitlines()[0]), rounds=60)
    builds = {"vector": _Timed(native_subspace.library()),
              "scalar": _Timed(native_subspace._compile(native_subspace.SCALAR_CODES_FLAGS))}
    outs, times = time_builds(builds, calls, args.rounds)
    same = all(torch.equal(a, b) for x, y in zip(outs["vector"], outs["scalar"]) for a, b in zip(x, y))
    print(f"{args.model}, {args.tokens} tokens: {len(calls)} subspace partials a step; the builds' partials "
          f"{'are the same bits' if same else 'DIFFER'}")
    for name, ts in times.items():
        ratio = statistics.median(s / t for s, t in zip(times["scalar"], ts))
        print(f"{name:7s} C {min(ts):6.2f} ms a step (median {statistics.median(ts):6.2f}); scalar / this, median of "
              f"the rounds: {ratio:.3f}")


if __name__ == "__main__":
    main()
