"""Compile every Triton kernel for a GPU target without a GPU (catches what the interpreter lets through).

Run in a process where TRITON_INTERPRET is unset: `python -m hf_kvcache.kernels.compile_check`.
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import kivi_pack, triton_decode, triton_tokens

P8, P16, P32, I32 = "*u8", "*fp16", "*fp32", "i32"


def _decode_variants():
    for k_bits, v_bits in ((2, 2), (4, 4), (3, 3), (2, 4), (8, 8)):
        for has_valid in (False, True):
            for dot_f32 in (False, True):
                common = dict(HAS_VALID=has_valid, M_PAD=16, D=64, BLOCK=64, K_BITS=k_bits, K_GROUP=32,
                              DOT_F32=dot_f32)
                attn_sig = dict(q_ptr=P32, kc_ptr=P8, ks_ptr=P16, kz_ptr=P16, vc_ptr=P8, vs_ptr=P16, vz_ptr=P16,
                                valid_ptr="*i8", m_ptr=P32, l_ptr=P32, acc_ptr=P32, n_tok=I32, kv_heads=I32,
                                tokens_per_split=I32, kc_row=I32, vc_row=I32)
                yield triton_decode._quant_attn_kernel, attn_sig, {**common, "V_BITS": v_bits, "V_GROUP": 32}
                mass_sig = dict(q_ptr=P32, kc_ptr=P8, ks_ptr=P16, kz_ptr=P16, valid_ptr="*i8", lse_ptr=P32,
                                mass_ptr=P32, n_tok=I32, kv_heads=I32, n_rows=I32, kc_row=I32)
                yield triton_decode._quant_mass_kernel, mass_sig, common


def _token_variants():
    for bits in (4, 8):
        for prerope in (False, True):
            for zero in (False, True):
                sig = dict(q_ptr=P32, kc_ptr=P8, ks_ptr=P16, kz_ptr=P16, vc_ptr=P8, vs_ptr=P16, vz_ptr=P16,
                           shift_ptr=P32, cscale_ptr=P32, pos_ptr="*i32" if prerope else P32, freq_ptr=P32,
                           valid_ptr="*i8", m_ptr=P32, l_ptr=P32, acc_ptr=P32, n_tok=I32, kv_heads=I32,
                           tokens_per_split=I32, kc_row=I32, vc_row=I32, stats_batched=I32, pos_batched=I32,
                           rope_scaling="fp32")
                yield triton_tokens._token_attn_kernel, sig, dict(
                    HAS_VALID=True, PREROPE=prerope, M_PAD=16, D=64, BLOCK=64, K_BITS=bits, V_BITS=bits,
                    K_GROUP=32 if bits == 4 else 64, V_GROUP=32 if bits == 4 else 64, K_ZERO=zero, V_ZERO=zero,
                    DOT_F32=False)


def _pack_variants():
    for bits in (2, 3, 4, 8):
        for x in (P32, P16, "*bf16"):
            yield kivi_pack._keys_kernel, dict(x_ptr=x, c_ptr=P8, s_ptr=P16, z_ptr=P16, n_tok=I32, c_row=I32), dict(
                D=64, GROUP=32, BITS=bits)
            yield kivi_pack._values_kernel, dict(x_ptr=x, c_ptr=P8, s_ptr=P16, z_ptr=P16, n_rows=I32, c_row=I32), dict(
                BLOCK_R=16, D=64, GROUP=32, BITS=bits)


def _quick_variants():
    """One variant per kernel and code path: bit fields (4-bit, masked, fp16 dot), byte-straddling codes (3-bit, fp32);
    the per-token kernel with pre-RoPE keys."""
    wanted = {
        ("_quant_attn_kernel", 4, True, False), ("_quant_attn_kernel", 3, False, True),
        ("_quant_mass_kernel", 4, True, False), ("_quant_mass_kernel", 3, False, True),
        ("_keys_kernel", 4, None, None), ("_keys_kernel", 3, None, None),
        ("_values_kernel", 4, None, None), ("_values_kernel", 3, None, None),
    }
    tokens = [v for v in _token_variants() if v[2]["K_BITS"] == 4 and v[2]["PREROPE"] and not v[2]["K_ZERO"]]
    picked = {}
    for fn, sig, c in list(_decode_variants()) + list(_pack_variants()):
        key = (fn.__name__, c.get("BITS", c.get("K_BITS")), c.get("HAS_VALID"), c.get("DOT_F32"))
        if key in wanted and key not in picked and c.get("V_BITS", c.get("K_BITS")) == c.get("K_BITS"):
            picked[key] = (fn, sig, c)
    return list(picked.values()) + tokens


def compile_all(target: GPUTarget = GPUTarget("cuda", 90, 32), quick: bool = False) -> list[str]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter does not compile")
    done = []
    variants = _quick_variants() if quick else [*_decode_variants(), *_token_variants(), *_pack_variants()]
    for fn, sig, constexprs in variants:
        signature = {**sig, **{name: "constexpr" for name in constexprs}}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target)
        if "cubin" not in compiled.asm:
            raise RuntimeError(f"{fn.__name__} produced no cubin")
        done.append(f"{fn.__name__} {constexprs}")
    return done


if __name__ == "__main__":
    names = compile_all(quick="--quick" in sys.argv)
    print(f"compiled {len(names)} kernel variants for sm_90")
    sys.exit(0)
