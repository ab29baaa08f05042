"""Every Triton kernel variant the library launches, as data (`Variant`: kernel, signature, constexprs, the
arguments compiled as multiples of 16, where it is launched), and how one is compiled for a GPU target without a GPU.

Read off the launch sites (`triton_decode.py`, `triton_quant.py`, `triton_tokens.py`, `triton_step.py`,
`triton_subspace.py`, `kivi_pack.py`); the variants themselves are
described in `hf_kvcache.eval.kernel_report`. Two users: `compile_check` (does every variant compile?) and
`eval.kernel_report` (registers, spills, shared memory and occupancy of each).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from .triton_quant import rows_launch
from .triton_subspace import subspace_launch
from .triton_tokens import token_launch

ARCH = 90  # the CUDA target compiled for without a GPU: Hopper (sm_90)
P8, P16, P32, I8, I32 = "*u8", "*fp16", "*fp32", "*i8", "i32"
X_DTYPES = {"fp16": P16, "bf16": "*bf16", "fp32": P32}
BLOCK_T = 64  # triton_decode.BLOCK_T
BLOCK_R = 16  # kivi_values_triton's block_rows
HEAD_DIMS = (64, 128, 256)
BITS = (2, 4, 8)
GROUPS = (32, 64)  # tokens per key group: 32 = tiered warm tier and KIVI, 64 = tiered archive
DTYPES = ("fp16", "bf16")
KERNELS = ("_quant_attn_rows_kernel", "_quant_attn_kernel", "_quant_mass_kernel", "_token_attn_kernel", "_keys_kernel",
           "_values_kernel", "_step_kernel", "_subspace_attn_kernel")
# the uniform caches' per-token formats the token kernel reads: (bits, channels per scale (None: the head), zeros)
TOKEN_FORMATS = ((4, 32, False), (8, None, False))
TIER_OF = {(2, 64): "tiered archive", (4, 32): "tiered warm", (2, 32): "KIVI-2"}


@dataclass(frozen=True)
class Variant:
    module: str  # under hf_kvcache.kernels
    kernel: str
    signature: tuple[tuple[str, str], ...]  # runtime arguments
    constexprs: tuple[tuple[str, object], ...]
    divisible: tuple[str, ...]  # arguments compiled as multiples of 16 (aligned pointers, aligned counts)
    use: str  # where the library launches it
    num_warps: int = 4  # warps per program at the launch site

    @property
    def params(self) -> dict:
        return dict(self.constexprs)

    def label(self) -> str:
        c = self.params
        parts = [f"{k}={v}" for k, v in c.items() if k not in ("BLOCK", "BLOCK_R")]
        x = dict(self.signature).get("x_ptr")
        if x is not None:
            parts.append("x=" + x.lstrip("*"))
        return f"{self.kernel}[{', '.join(parts)}]"


def _ptrs(sig: dict) -> tuple[str, ...]:
    return tuple(n for n, t in sig.items() if t.startswith("*"))


def decode_variants(head_dims=HEAD_DIMS, bits=BITS, groups=GROUPS, m_pads=(16,), fp16_dot: bool = False,
                    kernels=KERNELS) -> list[Variant]:
    out = []
    for d in head_dims:
        for b in bits:
            for g in groups:
                tier = TIER_OF.get((b, g), "tiered/KIVI option")
                for m_pad in m_pads:
                    for has_valid in (False, True):
                        for dot_f32 in (True, False) if fp16_dot else (True,):
                            common = dict(HAS_VALID=has_valid, M_PAD=m_pad, D=d, BLOCK=BLOCK_T, K_BITS=b)
                            valid = I8 if has_valid else P8  # without a mask the launch passes the code pointer
                            how = "decode" if m_pad == 16 else f"{m_pad} rows (multi-token query)"
                            how += "" if dot_f32 else ", fp16 dot (not reached: queries are fp32)"
                            if "_quant_attn_kernel" in kernels:
                                sig = dict(q_ptr=P32, kc_ptr=P8, ks_ptr=P16, kz_ptr=P16, vc_ptr=P8, vs_ptr=P16,
                                           vz_ptr=P16, valid_ptr=valid, m_ptr=P32, l_ptr=P32, acc_ptr=P32, n_tok=I32,
                                           kv_heads=I32, tokens_per_split=I32, kc_row=I32, vc_row=I32)
                                c = {**common, "V_BITS": b, "K_GROUP": g, "V_GROUP": min(g, d), "DOT_F32": dot_f32}
                                out.append(Variant("triton_decode", "_quant_attn_kernel", tuple(sig.items()),
                                                   tuple(c.items()),
                                                   _ptrs(sig) + ("n_tok", "tokens_per_split", "kc_row", "vc_row"),
                                                   f"{tier}, {how}"))
                            if "_quant_mass_kernel" in kernels:
                                sig = dict(q_ptr=P32, kc_ptr=P8, ks_ptr=P16, kz_ptr=P16, valid_ptr=valid, lse_ptr=P32,
                                           mass_ptr=P32, n_tok=I32, kv_heads=I32, n_rows=I32, kc_row=I32)
                                c = {**common, "K_GROUP": g, "DOT_F32": dot_f32}
                                out.append(Variant("triton_decode", "_quant_mass_kernel", tuple(sig.items()),
                                                   tuple(c.items()), _ptrs(sig) + ("n_tok", "kc_row"),
                                                   f"{tier}, attention mass, {how}"))
    return out


def rows_variants(head_dims=HEAD_DIMS, bits=BITS, groups=GROUPS, kernels=KERNELS) -> list[Variant]:
    """`_quant_attn_rows_kernel` (`decode_attention` -> `triton_quant.quant_partial_rows`, every KIVI-layout segment
    of 2 / 4 / 8 bits on CUDA): fp16 operand dots (models in fp16 / bf16) and fp32 dots (fp32 models), with and
    without a key mask, M_PAD 16, the default launch's warps (`triton_quant.rows_launch`)."""
    if "_quant_attn_rows_kernel" not in kernels:
        return []
    out = []
    for d in head_dims:
        for b in bits:
            for g in groups:
                tier = TIER_OF.get((b, g), "tiered/KIVI option")
                for dot_f32 in (False, True):
                    for has_valid in (False, True):
                        sig = dict(q_ptr=P32, kc_ptr=P8, ks_ptr=P16, kz_ptr=P16, vc_ptr=P8, vs_ptr=P16, vz_ptr=P16,
                                   valid_ptr=I8 if has_valid else P8, out_ptr=P32, n_tok=I32, kv_heads=I32,
                                   n_rows=I32, tokens_per_split=I32, kc_row=I32, vc_row=I32)
                        c = dict(HAS_VALID=has_valid, M_PAD=16, D=d, K_BITS=b, V_BITS=b, K_GROUP=g,
                                 V_GROUP=min(g, d), DOT_F32=dot_f32)
                        use = f"{tier}, decode, {'fp32 model' if dot_f32 else 'fp16/bf16 model'}"
                        out.append(Variant("triton_quant", "_quant_attn_rows_kernel", tuple(sig.items()),
                                           tuple(c.items()),
                                           _ptrs(sig) + ("n_tok", "tokens_per_split", "kc_row", "vc_row"), use,
                                           num_warps=rows_launch(d, dot_f32)[0]))
    return out


def token_variants(head_dims=HEAD_DIMS, kernels=KERNELS) -> list[Variant]:
    """`_token_attn_kernel` (`decode_attention` -> `token_partial_triton`, the uniform caches on CUDA): int4 / int8 at
    their default groups (symmetric: no zeros), keys pre-RoPE (the default) or as they come, with and without a
    validity mask; fp16 operand dots (fp16 / bf16 models) and fp32 dots (fp32 models), M_PAD 16, tiles and warps of
    `triton_tokens.token_launch`."""
    if "_token_attn_kernel" not in kernels:
        return []
    out = []
    for d in head_dims:
        for bits, group, zeros in TOKEN_FORMATS:
            for prerope in (True, False):
                for has_valid in (False, True):
                    for dot_f32 in (False, True):
                        sig = dict(q_ptr=P32, kc_ptr=P8, ks_ptr=P16, kz_ptr=P16, vc_ptr=P8, vs_ptr=P16, vz_ptr=P16,
                                   shift_ptr=P32, cscale_ptr=P32, pos_ptr="*i32" if prerope else P32, freq_ptr=P32,
                                   valid_ptr=I8 if has_valid else P8, m_ptr=P32, l_ptr=P32, acc_ptr=P32, n_tok=I32,
                                   kv_heads=I32, tokens_per_split=I32, kc_row=I32, vc_row=I32, stats_batched=I32,
                                   pos_batched=I32, rope_scaling="fp32")
                        block, warps, _ = token_launch(d, dot_f32)
                        c = dict(HAS_VALID=has_valid, PREROPE=prerope, M_PAD=16, D=d, BLOCK=block, K_BITS=bits,
                                 V_BITS=bits, K_GROUP=group or d, V_GROUP=group or d, K_ZERO=zeros, V_ZERO=zeros,
                                 DOT_F32=dot_f32, FAST_TRIG=True)
                        use = (f"int{bits}, keys {'pre-RoPE' if prerope else 'as they come'}, decode, "
                               f"{'fp32 model' if dot_f32 else 'fp16/bf16 model'}")
                        out.append(Variant("triton_tokens", "_token_attn_kernel", tuple(sig.items()),
                                           tuple(c.items()), _ptrs(sig) + ("tokens_per_split",), use,
                                           num_warps=warps))
    return out


def subspace_variants(head_dims=HEAD_DIMS, kernels=KERNELS) -> list[Variant]:
    """`_subspace_attn_kernel` (`decode_attention` -> `triton_subspace.coefficient_partial`, a tiered archive coded
    in fitted bases on CUDA): full-rank bases (the widest tiles: ranks padded to D), the archive's key groups of 64,
    keys pre-RoPE (the tiered default) or as they come, with and without a validity mask, fp16 operand dots and fp32
    dots, M_PAD 16, tiles and warps of `triton_subspace.subspace_launch`."""
    if "_subspace_attn_kernel" not in kernels:
        return []
    out = []
    for d in head_dims:
        for prerope in (True, False):
            for has_valid in (False, True):
                for dot_f32 in (False, True):
                    sig = dict(q_ptr=P32, kc_ptr=P8, ks_ptr=P16, kz_ptr=P16, w_ptr=P32, mean_ptr=P32, freq_ptr=P32,
                               vc_ptr=P8, vs_ptr=P32, kdir_ptr="*i32", vdir_ptr="*i32",
                               valid_ptr=I8 if has_valid else P32, m_ptr=P32, l_ptr=P32, acc_ptr=P32, n_tok=I32,
                               kv_heads=I32, tokens_per_split=I32, k_row=I32, v_row=I32, k_rank=I32, v_sub=I32,
                               start=I32, rope_scaling="fp32")
                    block, channels, warps = subspace_launch(d, dot_f32)
                    c = dict(HAS_VALID=has_valid, PREROPE=prerope, M_PAD=16, D=d, KR=d, VR=d, BLOCK=block,
                             CH=channels, K_GROUP=64, DOT_F32=dot_f32, FAST_TRIG=True)
                    use = (f"subspace archive, keys {'pre-RoPE' if prerope else 'as they come'}, decode, "
                           f"{'fp32 model' if dot_f32 else 'fp16/bf16 model'}")
                    out.append(Variant("triton_subspace", "_subspace_attn_kernel", tuple(sig.items()),
                                       tuple(c.items()), _ptrs(sig) + ("tokens_per_split",), use, num_warps=warps))
    return out


# what `triton_step` merges in the launches the caches make: (use, partial sets as their m-row strides (None: the
# row kernel's D + 2; 1: the token kernel's), values rotated, full-precision pieces)
STEP_SHAPES = (("uniform int4 / int8 step", (1,), False, 1), ("tiered step (archive, warm, tail, sinks, new)",
               (None, None), True, 3), ("KIVI step (codes, tail, new)", (None,), False, 2),
               ("tiered step, context still full precision", (), False, 2))


def step_variants(head_dims=HEAD_DIMS, kernels=KERNELS) -> list[Variant]:
    """`_step_kernel` (`decode_attention` -> `triton_step.step_attention`, the one-launch merge of a decode step on
    CUDA) in the shapes the caches launch it, bf16 full-precision pieces (dots on bf16 operands), unused inputs passed
    as the query; rotated values up to `MAX_ROTATED_DIM` (wider heads take the general path)."""
    if "_step_kernel" not in kernels:
        return []
    from .triton_step import BLOCK_N, MAX_PIECES, MAX_ROTATED_DIM, MAX_SETS

    out = []
    for d in head_dims:
        for use, rows, rotated, pieces in STEP_SHAPES:
            sig = dict(q_ptr=P32, out_ptr="*bf16", rot_ptr=P32)
            for i in range(MAX_SETS):
                sig.update({f"m{i}": P32, f"l{i}": P32, f"a{i}": P32, f"n{i}": I32, f"s{i}_bh": I32,
                            f"s{i}_sp": I32, f"a{i}_bh": I32, f"a{i}_sp": I32, f"a{i}_row": I32})
            for i in range(MAX_PIECES):
                kv = "*bf16" if i < pieces else P32
                sig.update({f"k{i}": kv, f"v{i}": kv, f"t{i}": I32, f"k{i}_b": I32, f"k{i}_h": I32, f"k{i}_t": I32,
                            f"v{i}_b": I32, f"v{i}_h": I32, f"v{i}_t": I32})
            sig.update(kv_heads=I32, n_rows=I32)
            row = [d + 2 if r is None else r for r in rows] + [1] * (MAX_SETS - len(rows))
            if rotated and d > MAX_ROTATED_DIM:
                continue
            c = dict(SETS=len(rows), ROW0=row[0], ROW1=row[1], HAS_ROT=rotated, PIECES=pieces, M_PAD=16, D=d,
                     BLOCK=BLOCK_N, DOT_F32=False)
            out.append(Variant("triton_step", "_step_kernel", tuple(sig.items()), tuple(c.items()), _ptrs(sig), use))
    return out


def pack_variants(head_dims=HEAD_DIMS, bits=BITS, groups=GROUPS, dtypes=DTYPES, kernels=KERNELS) -> list[Variant]:
    out = []
    for d in head_dims:
        for b in bits:
            for g in groups:
                tier = TIER_OF.get((b, g), "tiered/KIVI option")
                for dt in dtypes:
                    x = X_DTYPES[dt]
                    if "_keys_kernel" in kernels:
                        sig = dict(x_ptr=x, c_ptr=P8, s_ptr=P16, z_ptr=P16, n_tok=I32, c_row=I32)
                        out.append(Variant("kivi_pack", "_keys_kernel", tuple(sig.items()),
                                           (("D", d), ("GROUP", g), ("BITS", b)), _ptrs(sig) + ("n_tok", "c_row"),
                                           f"{tier}, pack keys"))
                    if "_values_kernel" in kernels:
                        sig = dict(x_ptr=x, c_ptr=P8, s_ptr=P16, z_ptr=P16, n_rows=I32, c_row=I32)
                        out.append(Variant("kivi_pack", "_values_kernel", tuple(sig.items()),
                                           (("BLOCK_R", BLOCK_R), ("D", d), ("GROUP", min(g, d)), ("BITS", b)),
                                           _ptrs(sig) + ("c_row",), f"{tier}, pack values"))
    return out


def all_variants(head_dims=HEAD_DIMS, bits=BITS, groups=GROUPS, dtypes=DTYPES, m_pads=(16,), fp16_dot=False,
                 kernels=KERNELS) -> list[Variant]:
    return (rows_variants(head_dims, bits, groups, kernels) + decode_variants(head_dims, bits, groups, m_pads, fp16_dot,
                                                                               kernels)
            + token_variants(head_dims, kernels) + step_variants(head_dims, kernels)
            + pack_variants(head_dims, bits, groups, dtypes, kernels) + subspace_variants(head_dims, kernels))


def quick_variants() -> list[Variant]:
    """One small variant per kernel: the tiered archive's decode kernel (with the sink mask) and its mass kernel at
    head_dim 64, the warm tier's pack kernels from fp16."""
    dec = decode_variants(head_dims=(64,), bits=(2,), groups=(64,))
    pack = pack_variants(head_dims=(64,), bits=(4,), groups=(32,), dtypes=("fp16",))
    tokens = token_variants(head_dims=(64,))
    rows = [v for v in rows_variants(head_dims=(64,), bits=(2,), groups=(64,)) if v.params["HAS_VALID"]][:1]
    step = [v for v in step_variants(head_dims=(64,)) if v.params["HAS_ROT"]]
    subspace = subspace_variants(head_dims=(64,))[:1]
    return (rows + [v for v in dec if v.params["HAS_VALID"]] + [v for v in tokens if v.params["HAS_VALID"]][:1] + step
            + pack + subspace)


def compile_kernel(v: Variant, arch: int = ARCH):
    """`triton.compile` of `v` for sm_`arch` (a CUDA target, no GPU needed); raises if no cubin comes out. Run where
    TRITON_INTERPRET is unset: the interpreter does not compile."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter does not compile")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"{__package__}.{v.module}"), v.kernel)
    consts = v.params
    sig = dict(v.signature)
    signature = {n: ("constexpr" if n in consts else sig[n]) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in v.divisible}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": v.num_warps})
    if "cubin" not in compiled.asm:
        raise RuntimeError(f"{v.label()} produced no cubin")
    return compiled
