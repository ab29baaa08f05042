"""GPU readiness without a GPU: every Triton kernel variant the library launches, compiled for Hopper (sm_90), with
its registers, spills, shared memory and theoretical H100 occupancy; plus a bytes-read roofline of the fused decode
step at long contexts for the tiered (and KIVI) layouts against an fp16 cache.

    python -m hf_kvcache.eval.kernel_report                     # every variant + roofline, markdown on stdout
    python -m hf_kvcache.eval.kernel_report --quick --json r.json
    hf-kvcache kernel-report --head-dims 128 --no-roofline

No GPU is needed: `triton.compile` builds the cubin with the ptxas Triton ships, and the resources are read from that
cubin with Triton's bundled `cuobjdump -res-usage` (a CompiledKernel only gets `n_regs`/`n_spills` when a driver loads
it). Compiles run in worker processes with TRITON_INTERPRET removed from their environment (the interpreter does not
compile), so the report also runs from a process where it is set (the tests).

Variants (read off the launch sites, `kernels/triton_decode.py`, `kernels/triton_tokens.py`,
`kernels/triton_subspace.py` and `kernels/kivi_pack.py`):
- `_quant_attn_kernel`: one launch per quantized segment of every fused attention call on CUDA
  (`decode_attention` -> `quant_partial_triton`). D = head_dim; (K_BITS = V_BITS, K_GROUP) = (bits, group) of a tier:
  tiered archive (2, 64), tiered warm (4, 32), KIVI (2, 32), and the other widths the options allow;
  V_GROUP = min(group, D) (the tiered layer's default value group); BLOCK = 64; M_PAD = max(16, pow2(query heads per
  KV head x query positions)) = 16 for decode with up to 16 query heads per KV head; HAS_VALID: True where a mask or
  the sink overlay hides columns (the archive under its sinks), else False (then valid_ptr is the u8 code pointer).
  DOT_F32 = (q.dtype == float32), and `decode_attention` always hands the kernel fp32 queries, so every launch today
  takes DOT_F32=True (the ieee fp32 dot); `--fp16-dot` adds the DOT_F32=False (fp16 MMA) variants for comparison.
  The model's fp16/bf16 does not reach this kernel's signature (q is fp32, scales fp16, codes u8).
- `_quant_mass_kernel`: the per-key attention mass (`decode_attention(return_mass=True)`), same constexprs less V_*.
- `_token_attn_kernel`: the uniform caches' per-token codes (`token_partial_triton`): int4 g32 / int8 per head,
  symmetric, keys pre-RoPE or as they come, HAS_VALID both ways, M_PAD = 16, DOT_F32 both ways (fp32 models / fp16
  and bf16 models), tiles and warps of `triton_tokens.token_launch` (64 tokens on 4 warps for fp16 dots at head dims
  up to 128, else 16 on 8).
- `_subspace_attn_kernel`: a tiered archive coded in fitted bases (`triton_subspace.coefficient_partial`): full-rank
  bases (KR = VR = D, the widest tiles), key groups of 64, keys pre-RoPE or as they come, HAS_VALID both ways,
  M_PAD = 16, DOT_F32 both ways, tiles and warps of `triton_subspace.subspace_launch`.
- `_keys_kernel` / `_values_kernel`: fused KIVI quantize + pack (`quant.kivi.kivi_key_codes` / `kivi_value_codes` on CUDA tensors), for
  x in fp16 and bf16; keys GROUP = tokens per group, values GROUP = min(group, D) channels, BLOCK_R = 16.
Pointer arguments are compiled as 16-byte aligned and the integer arguments that are multiples of 16 at every real
launch (token counts of a tier, tokens per split, packed row bytes) as divisible by 16, as Triton's launcher
specializes them. num_warps is each launch site's (4; the token kernel's from `token_launch`); num_stages Triton's default (3).

Occupancy (per SM, H100: 65536 registers, 228 KiB shared of which at most 227 KiB per block, 2048 threads, 32 blocks,
64 warps): registers are allocated per warp in units of 256, shared memory per block is the dynamic shared memory
Triton asks for + the cubin's static shared memory + the 1 KiB the driver reserves per block, in units of 128 bytes;
blocks/SM = the minimum over the four limits, occupancy = active warps / 64. `n_spills` follows Triton's definition
(local memory bytes per thread / 4, here the cubin's stack frame + local size).

Roofline: the bytes one decode step must read from HBM for the KV cache of one sequence (batch 1), from the real
layout: a one-layer, one-KV-head cache of the model's head_dim is filled with N tokens (the last one as a decode step)
and the tensors of its `attention_segments()` (what the fused attention reads: codes, fp16 scales and zeros, the fp16
tail and sink overlay) are summed, then scaled by KV heads and layers; `layout_bytes` computes the same from the layout
formulas and the report checks that they agree. fp16 KV (what SDPA over a DynamicCache reads) is N x head_dim x 2 x
2 bytes per KV head and layer. Time lower bound = bytes / HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s).
Not counted: the query, the (m, l, acc) partials the split kernel writes and merges, the rotations; and the
weights, which the "incl. weights" columns add (fp16 parameters) to show what the whole step gains.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from hf_kvcache.kernels.variants import (
    ARCH, BITS, DTYPES, GROUPS, HEAD_DIMS, KERNELS, X_DTYPES, Variant, all_variants, compile_kernel, quick_variants,
)

# ---- the device ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SMLimits:
    name: str = "H100 (sm_90)"
    regs_per_sm: int = 65536
    shared_per_sm: int = 228 * 1024
    shared_per_block: int = 227 * 1024  # the most one block may use (opt-in)
    reserved_shared_per_block: int = 1024  # what the driver keeps per block on sm_80+
    shared_granularity: int = 128
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    warps_per_sm: int = 64
    reg_granularity: int = 256  # registers, allocated per warp
    max_regs_per_thread: int = 255
    warp_size: int = 32


H100 = SMLimits()
BANDWIDTHS = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s: H100 SXM HBM3, H200 HBM3e


def occupancy(n_regs: int, num_warps: int, shared_bytes: int, static_shared: int = 0,
              limits: SMLimits = H100) -> dict:
    """Theoretical occupancy of a kernel: blocks per SM under each limit, the binding one, active warps / max."""
    threads = num_warps * limits.warp_size
    regs_per_warp = -(-n_regs * limits.warp_size // limits.reg_granularity) * limits.reg_granularity
    block_shared = shared_bytes + static_shared + limits.reserved_shared_per_block
    block_shared = -(-block_shared // limits.shared_granularity) * limits.shared_granularity
    by = {
        "registers": limits.regs_per_sm // (regs_per_warp * num_warps) if regs_per_warp else limits.blocks_per_sm,
        "shared": limits.shared_per_sm // block_shared,
        "threads": limits.threads_per_sm // threads,
        "blocks": limits.blocks_per_sm,
    }
    if n_regs > limits.max_regs_per_thread or regs_per_warp * num_warps > limits.regs_per_sm:
        by["registers"] = 0
    if shared_bytes + static_shared > limits.shared_per_block:
        by["shared"] = 0
    limiter = min(by, key=lambda k: by[k])
    blocks = by[limiter]
    return {
        "blocks_per_sm": blocks,
        "limiter": limiter,
        "active_warps": blocks * num_warps,
        "occupancy": blocks * num_warps / limits.warps_per_sm,
        "shared_per_block": block_shared,
        "blocks_by": by,
    }


# ---- compiling ------------------------------------------------------------------------------------------------------
_RES = re.compile(r"([A-Z]+(?:\[\d+\])?):(\d+)")


def cubin_resources(cubin: bytes, name: str) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL ... of kernel `name` in `cubin`, from `cuobjdump -res-usage` (Triton's copy)."""
    from triton import knobs

    tool = knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f"Function {name}:" and i + 1 < len(lines):
            return {k: int(v) for k, v in _RES.findall(lines[i + 1])}
    raise RuntimeError(f"cuobjdump reported no resources for {name}:\n{text}")


def compile_variant(v: Variant, arch: int = ARCH) -> dict:
    """Compile `v` for sm_`arch` and read its resources (run where TRITON_INTERPRET is unset)."""
    sig, consts = dict(v.signature), v.params
    row = {"kernel": v.kernel, "variant": v.label(), "use": v.use, "constexprs": consts,
           "x_dtype": sig.get("x_ptr", "").lstrip("*") or None}
    t0 = time.perf_counter()
    try:
        k = compile_kernel(v, arch)
        res = cubin_resources(k.asm["cubin"], k.metadata.name)
    except Exception as exc:  # a variant that does not compile is a finding, not a crash of the report
        row.update(error=f"{type(exc).__name__}: {str(exc)[:500]}", compile_s=time.perf_counter() - t0)
        return row
    md = k.metadata
    row.update(
        n_regs=res["REG"],
        n_spills=(res.get("STACK", 0) + res.get("LOCAL", 0)) // 4,
        stack_bytes=res.get("STACK", 0),
        local_bytes=res.get("LOCAL", 0),
        shared=md.shared,
        static_shared=res.get("SHARED", 0),
        num_warps=md.num_warps,
        num_stages=md.num_stages,
        compile_s=time.perf_counter() - t0,
    )
    row.update(occupancy(row["n_regs"], md.num_warps, md.shared, row["static_shared"]))
    return row


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said explicitly (no warning)


def compile_variants(variants: list[Variant], jobs: int = 2, arch: int = ARCH, progress=None) -> list[dict]:
    """Compile every variant in `jobs` spawned processes whose environment has no TRITON_INTERPRET."""
    saved = os.environ.pop("TRITON_INTERPRET", None)  # spawned children copy the environment
    try:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max(1, jobs), mp_context=ctx, initializer=_worker_init) as pool:
            rows = []
            for row in pool.map(compile_variant, variants, [arch] * len(variants)):
                rows.append(row)
                if progress is not None:
                    progress(len(rows), len(variants), row)
            return rows
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


# ---- roofline -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    params: int  # for the "incl. weights" columns (fp16)


MODELS = (
    ModelShape("SmolLM2-135M", 30, 3, 9, 64, 134_515_008),
    ModelShape("8B-like (Llama-3-8B)", 32, 8, 32, 128, 8_030_261_248),
)
CONTEXTS = (32768, 131072)
LAYOUTS = ("tiered", "kivi-2")


def layout_options(layout: str):
    """The default options of a layout, as `TieredQuantOptions` (rotation off: it adds no bytes to what is read)."""
    from hf_kvcache.caches.tiered import KIVIOptions, TieredQuantOptions

    if layout == "tiered":
        return TieredQuantOptions(rotation="none")
    if layout == "kivi-2":
        return KIVIOptions(bits=2).as_tiered()
    raise ValueError(f"unknown layout {layout!r}; choose one of {list(LAYOUTS)}")


def _tier_tokens(n: int, keep: int, group: int) -> int:
    """Tokens a tier keeps of the `n` that reached it when it sends its oldest whole groups on once it holds
    `keep + group`."""
    return n if n < keep + group else keep + (n - keep) % group


def layout_bytes(opts, n_tokens: int, head_dim: int, elem_bytes: int = 2) -> dict:
    """Bytes of one KV head of one layer holding `n_tokens`, per tier, from the layout formulas (KIVI groups: keys
    per channel over `group` tokens, values per token over `value group` channels, fp16 scale and zero each; codes
    packed along the head dim; 16-bit tail and sink overlay)."""
    from hf_kvcache.quant.packing import packed_length

    if opts.key_axis != "channel" or opts.archive_quantizer != "kivi":
        raise ValueError("layout_bytes knows the KIVI layout (key_axis='channel', archive_quantizer='kivi') only")
    d, s = head_dim, 2  # fp16 scales and zeros
    tail = _tier_tokens(n_tokens, opts.tail_length, opts.group_size)
    quantized = n_tokens - tail
    if opts.warm_length:  # the warm tier keeps warm_length, or warm_fraction of the positions seen
        target = max(opts.warm_length, int(opts.warm_fraction * n_tokens) // opts.group_size * opts.group_size)
        warm = _tier_tokens(quantized, target, opts.archive_group)
    else:
        warm = 0
    archive = quantized - warm

    def quant(tokens: int, bits: int, group: int) -> int:
        vg = opts.value_group_size or min(group, d)
        codes = 2 * tokens * packed_length(d, bits)
        return codes + 2 * s * (tokens // group) * d + 2 * s * tokens * (d // vg)

    sinks = min(opts.sink_length, quantized)
    tiers = {
        "archive": {"tokens": archive, "bytes": quant(archive, opts.archive_bits, opts.archive_group)},
        "warm": {"tokens": warm, "bytes": quant(warm, opts.warm_bits, opts.group_size)},
        "tail": {"tokens": tail, "bytes": 2 * tail * d * elem_bytes},
        "sink": {"tokens": sinks, "bytes": 2 * sinks * d * elem_bytes},
    }
    return {"tiers": tiers, "bytes": sum(t["bytes"] for t in tiers.values()), "tokens": n_tokens}


def measured_bytes(layout: str, n_tokens: int, head_dim: int, chunk: int = 8192, seed: int = 0) -> dict:
    """Bytes the fused attention reads from a real one-layer, one-KV-head cache of `layout` holding `n_tokens` (the
    last one appended as a decode step): the tensors of its `attention_segments()`, per segment kind."""
    import torch
    from transformers import LlamaConfig

    from hf_kvcache.caches.tiered import KIVICache, TieredQuantCache
    from hf_kvcache.kernels.segments import FullSegment

    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, hidden_size=head_dim,
                      head_dim=head_dim, intermediate_size=4 * head_dim)
    layout_options(layout)  # checks the name
    cache = TieredQuantCache(config=cfg, rotation="none") if layout == "tiered" else KIVICache(config=cfg, bits=2)
    g = torch.Generator().manual_seed(seed)
    done = 0
    while done < n_tokens:
        step = min(chunk, n_tokens - 1 - done) if done < n_tokens - 1 else 1
        k = torch.randn(1, 1, step, head_dim, generator=g).to(torch.float16)
        v = torch.randn(1, 1, step, head_dim, generator=g).to(torch.float16)
        cache.update(k, v, 0)
        done += step
    segments = cache.layers[0].attention_segments() or []
    quant = [s for s in segments if not isinstance(s, FullSegment)]
    tail = [s for s in segments if isinstance(s, FullSegment) and s.overlay_at is None]
    sink = [s for s in segments if isinstance(s, FullSegment) and s.overlay_at is not None]
    layer = cache.layers[0]
    if hasattr(layer, "tier_stats"):  # which quantized tiers hold tokens, in key order
        names = [t for t in ("archive", "warm") if layer.tier_stats()[t]["tokens"]]
    else:
        names = ["archive", "warm"][: len(quant)]
    tiers = {name: {"tokens": s.tokens, "bytes": s.nbytes()} for name, s in zip(names, quant)}
    for name, segs in (("tail", tail), ("sink", sink)):
        tiers[name] = {"tokens": sum(s.tokens for s in segs),
                       "bytes": sum(s.keys.nbytes + s.values.nbytes for s in segs)}
    return {"tiers": tiers, "bytes": sum(t["bytes"] for t in tiers.values()), "tokens": cache.get_seq_length(),
            "held_bytes": cache.memory_stats()["bytes"]}


def fp16_bytes(n_tokens: int, head_dim: int) -> int:
    return 2 * n_tokens * head_dim * 2


def roofline(models=MODELS, contexts=CONTEXTS, layouts=LAYOUTS, bandwidths=BANDWIDTHS, measure: bool = True) -> list[dict]:
    """One row per (model, context, layout): KV bytes per decode step (batch 1), their time lower bound per
    bandwidth, and the speedup over reading an fp16 cache (KV only, and with the fp16 weights added)."""
    rows = []
    for m in models:
        for n in contexts:
            fp16 = fp16_bytes(n, m.head_dim) * m.kv_heads * m.layers
            weights = 2 * m.params
            base = {"model": m.name, "layers": m.layers, "kv_heads": m.kv_heads, "head_dim": m.head_dim,
                    "context": n}
            rows.append({**base, "layout": "fp16", "kv_bytes": fp16, "formula_bytes": fp16, "ratio": 1.0,
                         **_times(fp16, weights, fp16, bandwidths)})
            for layout in layouts:
                formula = layout_bytes(layout_options(layout), n, m.head_dim)
                per_head = formula["bytes"]
                row = {**base, "layout": layout, "tiers": formula["tiers"]}
                if measure:
                    real = measured_bytes(layout, n, m.head_dim)
                    per_head = real["bytes"]
                    row["formula_matches"] = real["bytes"] == formula["bytes"] and all(
                        real["tiers"].get(t, {"tokens": 0})["tokens"] == v["tokens"]
                        for t, v in formula["tiers"].items() if v["tokens"])
                    row["held_bytes_per_head_layer"] = real["held_bytes"]
                total = per_head * m.kv_heads * m.layers
                row.update(kv_bytes=total, formula_bytes=formula["bytes"] * m.kv_heads * m.layers,
                           bytes_per_token=total / n, ratio=fp16 / total, **_times(total, weights, fp16, bandwidths))
                rows.append(row)
    return rows


def _times(kv: int, weights: int, fp16: int, bandwidths: dict) -> dict:
    out = {"weights_bytes": weights}
    for name, bw in bandwidths.items():
        out[f"t_kv_us_{name}"] = kv / bw * 1e6
        out[f"t_step_us_{name}"] = (kv + weights) / bw * 1e6
    out["speedup_kv"] = fp16 / kv
    out["speedup_step"] = (fp16 + weights) / (kv + weights)
    return out


# ---- output ---------------------------------------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def format_kernel_table(rows: list[dict]) -> str:
    head = ("| kernel | D | bits | groups k/v | rows | valid | dot | x | regs | spills | stack B | smem B | warps | "
            "blocks/SM | limited by | occupancy | used for |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c = r["constexprs"]
        bits = c.get("K_BITS", c.get("BITS"))
        groups = (f"{c['K_GROUP']}/{c['V_GROUP']}" if "V_GROUP" in c else
                  str(c.get("K_GROUP", c.get("GROUP"))))
        dot = "" if "DOT_F32" not in c else ("fp32" if c["DOT_F32"] else "fp16")
        valid = "" if "HAS_VALID" not in c else ("yes" if c["HAS_VALID"] else "no")
        lead = (f"| {r['kernel']} | {c['D']} | {bits} | {groups} | {c.get('M_PAD', c.get('BLOCK_R', ''))} | {valid} | "
                f"{dot} | {r['x_dtype'] or ''} |")
        if "error" in r:
            lines.append(f"{lead} compile error: {r['error'][:120]} |" + " |" * 8)
            continue
        lines.append(f"{lead} {r['n_regs']} | {r['n_spills']} | {r['stack_bytes']} | {r['shared']} | "
                     f"{r['num_warps']} | {r['blocks_per_sm']} | {r['limiter']} | {r['occupancy']:.3f} | {r['use']} |")
    return "\n".join(lines)


def format_roofline_table(rows: list[dict], bandwidths=BANDWIDTHS) -> str:
    bw = list(bandwidths)
    head = ("| model | context | layout | KV MiB/step | bytes/token | vs fp16 | "
            + " | ".join(f"t_kv {b} (us)" for b in bw) + " | speedup KV | "
            + " | ".join(f"t_step {b} incl. weights (us)" for b in bw) + " | speedup step | formula = real |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ok = {True: "yes", False: "NO"}.get(r.get("formula_matches"), "")
        per_tok = r["kv_bytes"] / r["context"]
        lines.append(
            f"| {r['model']} | {r['context']:,} | {r['layout']} | {_mib(r['kv_bytes'])} | {per_tok:,.0f} | "
            f"{r['ratio']:.2f}x | " + " | ".join(f"{r[f't_kv_us_{b}']:,.1f}" for b in bw)
            + f" | {r['speedup_kv']:.2f}x | " + " | ".join(f"{r[f't_step_us_{b}']:,.1f}" for b in bw)
            + f" | {r['speedup_step']:.2f}x | {ok} |")
    return "\n".join(lines)


def summarize(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    bad = [r for r in rows if "error" in r]
    spilling = [r for r in ok if r["n_spills"]]
    lines = [f"{len(ok)} of {len(rows)} variants compiled for sm_{ARCH}; {len(spilling)} spill; "
             f"{len(bad)} failed."]
    for kernel in KERNELS:
        ks = [r for r in ok if r["kernel"] == kernel]
        if ks:
            occ = sorted({r["occupancy"] for r in ks})
            lines.append(f"- {kernel}: regs {min(r['n_regs'] for r in ks)}..{max(r['n_regs'] for r in ks)}, "
                         f"spills {min(r['n_spills'] for r in ks)}..{max(r['n_spills'] for r in ks)}, "
                         f"occupancy {occ[0]:.3f}..{occ[-1]:.3f}")
    return "\n".join(lines)


def _csv(kind):
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH", help="also write every row (kernels and roofline) here")
    p.add_argument("--quick", action="store_true",
                   help="one small variant per kernel (of --kernels) instead of every variant")
    p.add_argument("--head-dims", type=_csv(int), default=HEAD_DIMS, help="comma-separated (default 64,128,256)")
    p.add_argument("--bits", type=_csv(int), default=BITS, help="code widths (default 2,4,8)")
    p.add_argument("--groups", type=_csv(int), default=GROUPS, help="tokens per key group (default 32,64)")
    p.add_argument("--dtypes", type=_csv(str), default=DTYPES, help="input dtypes of the pack kernels (fp16,bf16)")
    p.add_argument("--kernels", type=_csv(str), default=KERNELS, help="which kernels (default: all)")
    p.add_argument("--m-pad", type=_csv(int), default=(16,),
                   help="query rows per tile of the decode kernels (16: decode; more: multi-token queries, slow)")
    p.add_argument("--fp16-dot", action="store_true",
                   help="also the DOT_F32=False decode variants, which no launch reaches today")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes")
    p.add_argument("--contexts", type=_csv(int), default=CONTEXTS, help="cached tokens for the roofline")
    p.add_argument("--no-compile", action="store_true", help="skip the compile report")
    p.add_argument("--no-roofline", action="store_true", help="skip the roofline")
    p.add_argument("--formula-only", action="store_true", help="roofline from the formulas, no real cache")


def main_args(args: argparse.Namespace) -> int:
    unknown = set(args.kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; choose from {list(KERNELS)}")
    bad_dtypes = set(args.dtypes) - set(X_DTYPES)
    if bad_dtypes:
        raise ValueError(f"unknown dtypes {sorted(bad_dtypes)}; choose from {list(X_DTYPES)}")
    out: dict = {"target": f"cuda sm_{ARCH}", "limits": dataclasses.asdict(H100), "bandwidths": BANDWIDTHS}
    if not args.no_compile:
        import triton

        if args.quick:
            variants = [v for v in quick_variants() if v.kernel in args.kernels]
        else:
            variants = all_variants(args.head_dims, args.bits, args.groups, args.dtypes, args.m_pad, args.fp16_dot,
                                    args.kernels)
        print(f"compiling {len(variants)} kernel variants for sm_{ARCH} (triton {triton.__version__}, "
              f"{args.jobs} processes)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()

        def progress(i, n, row):
            if i % 10 == 0 or i == n:
                print(f"  {i}/{n} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

        rows = compile_variants(variants, args.jobs, ARCH, progress)
        out["triton"] = triton.__version__
        out["kernels"] = rows
        print(f"## Triton kernels compiled for sm_{ARCH} (H100 limits: 64K regs, 228 KiB smem, 2048 threads, "
              f"32 blocks per SM)\n")
        print(format_kernel_table(rows))
        print()
        print(summarize(rows))
        print()
    if not args.no_roofline:
        rows = roofline(contexts=args.contexts, measure=not args.formula_only)
        out["roofline"] = rows
        print("## Decode-step KV bytes (batch 1) and their HBM time lower bound "
              f"(H100 {BANDWIDTHS['H100'] / 1e12} TB/s, H200 {BANDWIDTHS['H200'] / 1e12} TB/s)\n")
        print(format_roofline_table(rows))
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
