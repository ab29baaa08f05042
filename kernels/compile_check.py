"""Compile every Triton kernel for a GPU target without a GPU (catches what the interpreter lets through).

Run in a process where TRITON_INTERPRET is unset: `python -m hf_kvcache.kernels.compile_check [--quick]`.
The variants are `variants.all_variants` (what the library launches, as `eval.kernel_report` lists them) plus the
3-bit codes (straddling bytes) and the fp16-dot path; `--quick` compiles one variant per kernel and code path.
"""

from __future__ import annotations

import sys

from .variants import ARCH, Variant, all_variants, compile_kernel, decode_variants, pack_variants, quick_variants


def check_variants(quick: bool = False) -> list[Variant]:
    """`quick`: the report's quick set (2-bit archive decode + mass with the mask, the int4 pre-RoPE token kernel,
    the 4-bit packers) and 3-bit codes: decode / mass through both dot paths (fp32 and fp16), and the packers."""
    if quick:
        straddling = decode_variants(head_dims=(64,), bits=(3,), groups=(32,), fp16_dot=True)
        packers = pack_variants(head_dims=(64,), bits=(3,), groups=(32,), dtypes=("fp16",))
        return quick_variants() + [v for v in straddling if v.params["HAS_VALID"]] + packers
    return all_variants(bits=(2, 3, 4, 8), fp16_dot=True)


def compile_all(arch: int = ARCH, quick: bool = False) -> list[str]:
    """Compile `check_variants(quick)` for sm_`arch`; the labels of the variants compiled (raises on the first that
    does not compile)."""
    done = []
    for v in check_variants(quick):
        compile_kernel(v, arch)
        done.append(v.label())
    return done


if __name__ == "__main__":
    names = compile_all(quick="--quick" in sys.argv)
    print(f"compiled {len(names)} kernel variants for sm_{ARCH}")
    sys.exit(0)
