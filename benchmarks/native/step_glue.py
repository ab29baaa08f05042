"""The Python around the C kernels in one layer's decode step of the `tiered` default (a layer with a subspace
archive): the step's calls captured after a prompt, then timed in a loop with the kernels and with the kernels
replaced by no-ops (what is left is the glue: argument checks, conversions, tensors made for the call).

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/native/step_glue.py [--model smollm2-135m] [--tokens 2048] \
        [--tree CHECKOUT]

`--tree`: import the package from another checkout (a worktree at an earlier commit, as `benchmarks/from_tree.py`
does), to time it the same way; a checkout without `native_subspace.step_partial` has its step take
`coefficient_partial`, timed in its place.

Printed per function (`decode_attention._segments_step_native`, the whole step of a layer below the attention
function, and the two native calls' wrappers inside it): microseconds a call, the minimum and the median of 7 rounds
of 200 calls, with the kernels and without them. The calls run warm in the caches (in a model's step the weights
stream between layers, so the same Python runs slower there: compare the two builds with this, not with a step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

FUNCTIONS: dict[str, tuple] = {}  # name -> (module, attribute), set by `main` once the package is imported
SUBSPACE = "native_subspace.step_partial"


def captured(model_name: str, tokens: int) -> dict[str, tuple]:
    """The arguments of each of `FUNCTIONS`' first call in the step after a `tokens`-token prompt and 8 steps, from a
    layer with a subspace archive (the first such call of `_segments_step_native`)."""
    model, tok = load_model(model_name)
    ids = load_tokens(tok, load_text("moby-dick"), 5000, tokens + 16)
    cache = CacheSpec.parse("tiered").build(model)
    cache.bind(model)
    model.set_attn_implementation("hf_kvcache")
    calls: dict[str, tuple] = {}
    real = {name: getattr(module, attr) for name, (module, attr) in FUNCTIONS.items()}

    def keeper(name: str):
        def kept(*args, **kwargs):
            out = real[name](*args, **kwargs)
            if name == "_segments_step_native" and SUBSPACE not in calls:
                return out  # not a layer with a subspace archive
            calls.setdefault(name, (args, kwargs))
            return out
        return kept

    with torch.inference_mode():
        for s in range(0, tokens, 512):
            model(input_ids=ids[:, s : s + 512], past_key_values=cache, use_cache=True)
        for i in range(8):
            model(input_ids=ids[:, tokens + i : tokens + i + 1], past_key_values=cache, use_cache=True)
        for name, (module, attr) in FUNCTIONS.items():
            setattr(module, attr, keeper(name))
        try:
            model(input_ids=ids[:, tokens + 8 : tokens + 9], past_key_values=cache, use_cache=True)
        finally:
            for name, (module, attr) in FUNCTIONS.items():
                setattr(module, attr, real[name])
    missing = [name for name in FUNCTIONS if name not in calls]
    if missing:
        raise SystemExit(f"no layer of this step called {missing}: no subspace archive, or the kernel is unavailable")
    return calls


def timed(calls: dict[str, tuple]) -> dict[str, tuple[float, float]]:
    """(minimum, median) microseconds a call of each captured function over 7 rounds of 200 calls."""
    out = {}
    with torch.inference_mode():
        for name, (module, attr) in FUNCTIONS.items():
            fn, (args, kwargs) = getattr(module, attr), calls[name]
            for _ in range(50):
                fn(*args, **kwargs)
            rounds = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(200):
                    fn(*args, **kwargs)
                rounds.append((time.perf_counter() - t0) / 200 * 1e6)
            out[name] = (min(rounds), statistics.median(rounds))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--tree", type=Path, help="a checkout to import the package from")
    args = ap.parse_args()
    if args.tree is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from from_tree import _TreeFinder
        sys.meta_path.insert(0, _TreeFinder(args.tree.resolve()))
    global torch, load_model, load_text, load_tokens, CacheSpec, native_step, native_subspace
    import torch
    from hf_kvcache.eval.assets import load_model, load_text, load_tokens
    from hf_kvcache.eval.bench import CacheSpec
    from hf_kvcache.kernels import decode_attention, native_step, native_subspace
    FUNCTIONS.update({"_segments_step_native": (decode_attention, "_segments_step_native"),
                      "native_step.step": (native_step, "step"),
                      SUBSPACE: (native_subspace, "step_partial" if hasattr(native_subspace, "step_partial")
                                 else "coefficient_partial")})
    torch.set_num_threads(1)
    calls = captured(args.model, args.tokens)
    with_kernels = timed(calls)
    lib = native_subspace.library()

    class NoKernel:
        def __getattr__(self, name: str):
            return (lambda *a: 0) if name == "subspace_partial" else getattr(lib, name)

    no_kernel = NoKernel()
    real_library, real_function = native_subspace.library, native_step._function
    native_subspace.library, native_step._function = (lambda: no_kernel), (lambda: (lambda *a: 0))
    try:
        glue = timed(calls)
    finally:
        native_subspace.library, native_step._function = real_library, real_function
    print(f"{args.model}, {args.tokens} tokens, one layer's step (us a call: minimum / median of 7 rounds)")
    for name in FUNCTIONS:
        print(f"{name:30s} with the kernels {with_kernels[name][0]:7.1f} / {with_kernels[name][1]:7.1f}   "
              f"kernels as no-ops {glue[name][0]:7.1f} / {glue[name][1]:7.1f}")


if __name__ == "__main__":
    main()
