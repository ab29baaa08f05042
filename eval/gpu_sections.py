"""The sections of `hf-kvcache gpu-check` (see `hf_kvcache.eval.gpu_check`): environment, copy bandwidth, kernel
correctness against the torch reference, decode-attention timing per cache against SDPA and the launch-knob sweep
(`generate` tokens/s: `gpu_generate`). Each takes the device, the check's options and a `Deadline`, and returns rows (dicts)."""

from __future__ import annotations

import dataclasses
import math
import platform
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .suites.kernels import time_ms

class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- environment and bandwidth --------------------------------------------------------------------------------------
def environment(device: str) -> dict:
    import transformers

    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               device=device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError as exc:
        env["triton"] = f"not importable: {exc}"
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                   capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
    return env


def copy_bandwidth(device: str, dry: bool) -> dict:
    """Device-to-device copy of a buffer several times the L2: (bytes read + written) / time."""
    n = (1 << 20) if dry else (1 << 30)  # bytes per buffer
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), 5 if dry else 20, device)
    return dict(bytes=n, ms=ms, gb_per_s=2 * n / ms / 1e6)


# ---- moving segments ------------------------------------------------------------------------------------------------
def to_device(obj, device: str):
    """A copy of a segment (nested dataclasses of tensors) with every tensor on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                   if f.init and _holds_tensor(getattr(obj, f.name))}
        return dataclasses.replace(obj, **changes) if changes else obj
    if hasattr(obj, "__dict__") and _holds_tensor(obj):  # a small non-dataclass holder (a rotation, a RoPE)
        import copy

        clone = copy.copy(obj)
        for k, v in vars(obj).items():
            if _holds_tensor(v):
                setattr(clone, k, to_device(v, device))
        return clone
    return obj


def _holds_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_holds_tensor(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return any(isinstance(v, torch.Tensor) for v in vars(obj).values())
    return False


def segment_bytes(segments) -> int:
    """Bytes a decode step reads from `segments` (codes, scales, zeros, full-precision tokens)."""
    from hf_kvcache.kernels.segments import FullSegment, QuantSegment

    total = 0
    for s in segments:
        if isinstance(s, FullSegment):
            total += s.keys.nbytes + s.values.nbytes
        elif isinstance(s, QuantSegment):
            total += s.nbytes()
        else:
            total += sum(t.nbytes for t in (*s.keys.tensors(), *s.values.tensors()))
    return total


# ---- correctness ----------------------------------------------------------------------------------------------------
def kivi_case(b: int, h: int, t: int, d: int, bits: int, group: int, seed: int):
    """A KIVI-layout `QuantSegment` (CPU, torch quantizer) of random keys with channel offsets, and a full tail."""
    from hf_kvcache.quant.kivi import kivi_key_codes, kivi_value_codes
    from hf_kvcache.kernels.segments import FullSegment, QuantSegment

    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=g) + 3 * torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(b, h, t, d, generator=g)
    kc, ks, kz = kivi_key_codes(k, bits, group, use_triton=False)
    vc, vs, vz = kivi_value_codes(v, bits, min(group, d), use_triton=False)
    seg = QuantSegment(kc, ks, kz, vc, vs, vz, bits, bits, group, min(group, d), d)
    tail = FullSegment(torch.randn(b, h, 5, d, generator=g), torch.randn(b, h, 5, d, generator=g))
    return seg, tail


def token_case(b: int, h: int, t: int, d: int, dtype: str, prerope: bool, seed: int):
    """A per-token `TokenSegment` of the uniform cache's format (CPU), keys pre-RoPE when `prerope`."""
    from hf_kvcache.caches.uniform import UniformPreRopeKeys, UniformQuantOptions
    from hf_kvcache.kernels.segments import TokenSegment
    from hf_kvcache.rope import KeyRotation

    g = torch.Generator().manual_seed(seed)
    options = UniformQuantOptions(dtype=dtype)
    options.validate()
    k = torch.randn(b, h, t, d, generator=g) + 4 * torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(b, h, t, d, generator=g)
    if not prerope:
        return TokenSegment(options.quantize(k), options.quantize(v))
    rope = KeyRotation(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), attention_scaling=1.0)
    codec = UniformPreRopeKeys(rope, options.bits, scale_power=0.5, per_row=True, options=options)
    positions = torch.arange(t).view(1, 1, t)
    pre = codec.derotate(k, positions)
    codec.fit(pre)
    return TokenSegment(codec.quantize_pre(pre), options.quantize(v), codec, positions)


def subspace_case(b: int, h: int, t: int, d: int, prerope: bool, seed: int, device: str = "cpu"):
    """A `SubspaceSegment` (on `device`) of the tiered archive's shape: keys per channel in groups of 64 tokens
    (pre-RoPE when `prerope`), values per token, four subspaces each of 2-4 bits, ranks below the head dim; and a full
    tail."""
    from hf_kvcache.kernels.segments import FullSegment, SubspaceSegment
    from hf_kvcache.quant.subspace import fit_subspace, quantize_subspace_rows
    from hf_kvcache.rope import KeyRotation

    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=g, device=device) * torch.linspace(0.2, 3.0, d, device=device)
    v = torch.randn(b, h, t, d, generator=g, device=device)
    rk, rv = d - d // 4, d - d // 2
    keys = quantize_subspace_rows(k, fit_subspace(k, rank=rk), (4, 3, 2, 2), rk // 4, rank=rk, axis="channel")
    values = quantize_subspace_rows(v, fit_subspace(v, rank=rv), (3, 2, 2, 2), rv // 4, rank=rv, axis="token")
    rope = KeyRotation(1.0 / 10000 ** (torch.arange(0, d, 2, device=device).float() / d)) if prerope else None
    tail = FullSegment(*torch.randn(2, b, h, 5, d, generator=g, device=device))
    return SubspaceSegment(keys, values, rope, start=0), tail


def _compare(query, segments, device: str, qdtype: torch.dtype, mask=None, mass: bool = False) -> dict:
    """decode_attention on `device` vs reference_attention on the CPU (fp32): max abs errors of output and mass."""
    from hf_kvcache.kernels.decode_attention import decode_attention, reference_attention

    ref_out, ref_mass = reference_attention(query.float(), segments, mask)
    dev = [to_device(s, device) for s in segments]
    out, got_mass = decode_attention(query.to(device, qdtype), dev, None if mask is None else mask.to(device),
                                     return_mass=mass)
    row = dict(out_err=float((out.float().cpu() - ref_out).abs().max()),
               out_scale=float(ref_out.abs().max()))
    if mass:
        row["mass_err"] = float((got_mass.cpu() - ref_mass).abs().max())
    return row


def correctness(device: str, opts, deadline: Deadline) -> list[dict]:
    rows: list[dict] = []
    dims = opts.head_dims if opts.dry_run else (128, 64, 256)
    t = 96 if opts.dry_run else 1000
    for i, d in enumerate(dims):  # every kernel at the first head dim before the others
        for block in (_kivi_cases, _token_cases, _subspace_cases, _pack_cases):
            if deadline.passed():
                rows.append(dict(case="(budget spent: the remaining cases were not run)"))
                return rows
            rows += block(device, d, t, deadline, seed=100 * i)
    return rows


def _kivi_cases(device: str, d: int, t: int, deadline: Deadline, seed: int) -> list[dict]:
    """KIVI-layout segments of every width / group at head dim `d`: a plain decode, a padded batch with the mass, a
    wide GQA group (queries alternate bf16 / fp16)."""
    rows = []
    formats = [(2, 64), (4, 32), (2, 32), (8, 32)]  # archive, warm, KIVI-2, 8-bit option
    shapes = ((1, False, False), (4, True, True), (8, False, False))
    for bits, group in formats:
        for gqa, masked, mass in shapes:
            if deadline.passed():
                return rows
            seed += 1
            tq = t - t % group
            seg, tail = kivi_case(2, 2, tq, d, bits, group, seed)
            q = torch.randn(2, 2 * gqa, 1, d, generator=torch.Generator().manual_seed(seed))
            mask = None
            if masked:
                mask = torch.ones(2, 1, 1, tq + tail.tokens, dtype=torch.bool)
                mask[1, ..., : tq // 3] = False  # left padding of the second row
            qdtype = torch.bfloat16 if seed % 2 else torch.float16
            case = dict(case=f"kivi d={d} bits={bits} group={group} gqa={gqa} mask={masked} mass={mass}",
                        qdtype=str(qdtype).removeprefix("torch."))
            rows.append(_run_case(case, lambda: _compare(q, [seg, tail], device, qdtype, mask, mass=mass)))
    return rows


def _token_cases(device: str, d: int, t: int, deadline: Deadline, seed: int) -> list[dict]:
    """Per-token segments (int4 / int8, keys as they come or pre-RoPE) at head dim `d`."""
    rows = []
    for dtype in ("int4", "int8"):
        for prerope in (False, True):
            if deadline.passed():
                return rows
            seed += 1
            seg = token_case(2, 2, t, d, dtype, prerope, seed)
            q = torch.randn(2, 8, 1, d, generator=torch.Generator().manual_seed(seed))
            case = dict(case=f"tokens d={d} {dtype} prerope={prerope}", qdtype="bfloat16")
            rows.append(_run_case(case, lambda: _compare(q, [seg], device, torch.bfloat16)))
    return rows


def _subspace_cases(device: str, d: int, t: int, deadline: Deadline, seed: int) -> list[dict]:
    """Subspace archives (`triton_subspace`; keys pre-RoPE or as they come) with a full tail at head dim `d`, a plain
    decode and a left-padded batch."""
    rows = []
    for prerope in (True, False):
        for masked in (False, True):
            if deadline.passed():
                return rows
            seed += 1
            tq = t - t % 64
            seg, tail = subspace_case(2, 2, tq, d, prerope, seed)
            q = torch.randn(2, 6, 1, d, generator=torch.Generator().manual_seed(seed))
            mask = None
            if masked:
                mask = torch.ones(2, 1, 1, tq + tail.tokens, dtype=torch.bool)
                mask[1, ..., : tq // 3] = False
            case = dict(case=f"subspace d={d} prerope={prerope} mask={masked}", qdtype="bfloat16")
            rows.append(_run_case(case, lambda: _compare(q, [seg, tail], device, torch.bfloat16, mask)))
    return rows


def _pack_cases(device: str, d: int, t: int, deadline: Deadline, seed: int) -> list[dict]:
    return pack_correctness(device, (d,), t)



def pack_correctness(device: str, dims, t: int) -> list[dict]:
    """The KIVI pack kernels on `device` against the torch quantizer: share of codes that differ, max scale error."""
    from hf_kvcache.quant.kivi import kivi_key_codes, kivi_value_codes

    rows = []
    for d in dims:
        for bits, group in ((2, 64), (4, 32)):
            x = torch.randn(1, 2, t - t % group, d, generator=torch.Generator().manual_seed(d + bits))
            for what, fast, grp in (("keys", kivi_key_codes, group), ("values", kivi_value_codes, min(group, d))):
                def run(fast=fast, grp=grp):
                    got = [y.cpu() for y in fast(x.to(device, torch.bfloat16), bits, grp)]
                    want = fast(x.to(torch.bfloat16), bits, grp, use_triton=False)
                    return dict(codes_differ=float((got[0] != want[0]).float().mean()),
                                scale_err=float((got[1].float() - want[1].float()).abs().max()))
                rows.append(_run_case(dict(case=f"pack {what} d={d} bits={bits} group={grp}", qdtype="bfloat16"),
                                      run))
    return rows


def _run_case(case: dict, fn: Callable[[], dict]) -> dict:
    try:
        case.update(fn())
        case["ok"] = case.get("out_err", 0.0) <= 2e-2 * max(1.0, case.get("out_scale", 1.0)) and \
            case.get("mass_err", 0.0) <= 1e-2 and case.get("codes_differ", 0.0) <= 1e-3
    except Exception as exc:  # a kernel that does not compile or run is a result, not the end of the check
        case.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
    return case


# ---- decode timing --------------------------------------------------------------------------------------------------
def sdpa_call(q, k, v):
    """SDPA over the bf16 cache, on the flash backend where it takes the shape; (function, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            fn()
            return fn, backend.name.lower()
        except RuntimeError:
            continue
    return (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)), "default"


def graph_ms(fn: Callable[[], object], iters: int, calls: int = 10) -> float:
    """Milliseconds of GPU time one call of `fn` takes: `calls` calls captured in one CUDA graph, replayed `iters`
    times (median of CUDA-event timings, divided by `calls`). The host's launch work is left out, as in a decode
    loop run under CUDA graphs; raises where `fn` cannot be captured (a host synchronization, a host-to-device copy)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: kernels compiled, caches filled
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = time_ms(graph.replay, iters, "cuda") / calls
    del graph
    return ms


def _graph_or_error(fn: Callable[[], object], iters: int) -> dict:
    """{"graph_ms": ...} or {"graph_error": ...} (a call that cannot be captured says why)."""
    try:
        return dict(graph_ms=graph_ms(fn, iters))
    except Exception as exc:
        return dict(graph_error=f"{type(exc).__name__}: {exc}"[:200])


def fill_cache(name: str, k: torch.Tensor, v: torch.Tensor, chunk: int = 4096):
    """A cache of ours named `name`, its layer 0 fed `k`, `v` in chunks (a chunked prefill), and the layer."""
    from hf_kvcache.registry import build_cache

    cache = build_cache(name)
    for s in range(0, k.shape[2], chunk):
        cache.update(k[:, :, s : s + chunk], v[:, :, s : s + chunk], 0)
    return cache, cache.layers[0]


SUBSPACE_ARCHIVE = "subspace archive"  # a row of `decode_timing` timed on a segment built here, not on a cache


def decode_timing(device: str, opts, deadline: Deadline, copy_gbps: float | None) -> list[dict]:
    from hf_kvcache.kernels.decode_attention import decode_attention
    from hf_kvcache.kernels.segments import FullSegment

    rows: list[dict] = []
    dtype = torch.bfloat16
    for tokens in opts.lengths:
        for d in opts.head_dims:
            for batch in opts.batches:
                if deadline.passed():
                    rows.append(dict(cache="(budget spent: the remaining cases were not run)"))
                    return rows
                g = torch.Generator(device=device).manual_seed(tokens + d)
                shape = (batch, opts.kv_heads, tokens, d)
                k = torch.randn(shape, generator=g, device=device, dtype=dtype)
                v = torch.randn(shape, generator=g, device=device, dtype=dtype)
                q = torch.randn(batch, opts.kv_heads * opts.group, 1, d, generator=g, device=device, dtype=dtype)
                base = dict(head_dim=d, batch=batch, tokens=tokens)
                try:
                    fn, backend = sdpa_call(q, k, v)
                    sdpa_ms = time_ms(fn, opts.iters, device)
                    nbytes = k.nbytes + v.nbytes
                    sdpa_graph = _graph_or_error(fn, opts.iters) if device.startswith("cuda") else {}
                    rows.append(dict(base, cache=f"sdpa bf16 ({backend})", ms=sdpa_ms, bytes=nbytes,
                                     gb_per_s=nbytes / sdpa_ms / 1e6, vs_sdpa=1.0,
                                     bw_share=_share(nbytes, sdpa_ms, copy_gbps), **sdpa_graph))
                except Exception as exc:
                    sdpa_ms, sdpa_graph = None, {}
                    rows.append(dict(base, cache="sdpa bf16", error=f"{type(exc).__name__}: {exc}"[:300]))
                new_k = torch.randn(batch, opts.kv_heads, 1, d, generator=g, device=device, dtype=dtype)
                new_v = torch.randn_like(new_k)
                for name in opts.caches:
                    if deadline.passed():
                        break
                    try:
                        if name == SUBSPACE_ARCHIVE:  # the tiered archive in fitted bases, pre-RoPE keys (no cache)
                            cache = layer = None
                            archive = subspace_case(batch, opts.kv_heads, tokens // 64 * 64, d, True, tokens, device)[0]
                            segments = [archive, FullSegment(new_k, new_v)]
                        else:
                            cache, layer = fill_cache(name, k, v)
                            segments = [*layer.attention_segments(), FullSegment(new_k, new_v)]
                        call = lambda q=q, segments=segments: decode_attention(q, segments)  # noqa: E731
                        ms = time_ms(call, opts.iters, device)
                        nbytes = segment_bytes(segments)
                        row = dict(base, cache=name, ms=ms, bytes=nbytes, gb_per_s=nbytes / ms / 1e6,
                                   vs_sdpa=None if sdpa_ms is None else sdpa_ms / ms,
                                   bw_share=_share(nbytes, ms, copy_gbps),
                                   segments=" + ".join(_describe(s) for s in segments))
                        if device.startswith("cuda"):
                            row.update(_graph_or_error(call, opts.iters))
                            if "graph_ms" in row:
                                row["graph_gb_per_s"] = nbytes / row["graph_ms"] / 1e6
                                row["graph_bw_share"] = _share(nbytes, row["graph_ms"], copy_gbps)
                                if "graph_ms" in sdpa_graph:
                                    row["graph_vs_sdpa"] = sdpa_graph["graph_ms"] / row["graph_ms"]
                        rows.append(row)
                        del cache, layer, segments
                    except Exception as exc:
                        rows.append(dict(base, cache=name, error=f"{type(exc).__name__}: {exc}"[:300],
                                         trace=traceback.format_exc(limit=4)[-800:]))
                del k, v, q
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
    return rows


def _share(nbytes: int, ms: float, copy_gbps: float | None) -> float | None:
    """The achieved read bandwidth as a share of the measured copy bandwidth (bytes read + written per second)."""
    return None if not copy_gbps else (nbytes / ms / 1e6) / copy_gbps


def _describe(seg) -> str:
    from hf_kvcache.kernels.segments import FullSegment, QuantSegment, SubspaceSegment

    if isinstance(seg, QuantSegment):
        return f"kivi{seg.k_bits}/{seg.k_group}x{seg.tokens}"
    if isinstance(seg, SubspaceSegment):
        return f"subspacex{seg.tokens}"
    if isinstance(seg, FullSegment):
        return f"full{'@' + str(seg.overlay_at) if seg.overlay_at is not None else ''}x{seg.tokens}"
    return f"tok{seg.keys.bits}{'pre' if seg.key_codec is not None else ''}x{seg.tokens}"


# ---- launch-knob sweep ----------------------------------------------------------------------------------------------
def kernel_sweep(device: str, opts, deadline: Deadline) -> list[dict]:
    """The KIVI-layout decode kernels at 32K tokens, head dim 128, under each launch setting (the general kernel as it
    launched before, the row-wise kernel's warps / programs per SM / dots); errors against the general fp32 launch."""
    rows: list[dict] = []
    if not device.startswith("cuda"):
        return [dict(setting="(needs CUDA: the sweep launches the Triton kernel directly)")]
    from hf_kvcache.quant.kivi import kivi_key_codes, kivi_value_codes
    from hf_kvcache.kernels.segments import QuantSegment
    from hf_kvcache.kernels.triton_decode import quant_partial_triton
    from hf_kvcache.kernels.triton_quant import quant_partial_rows

    rows += token_sweep(device, opts, deadline)
    # the general kernel's launch as it was, then the row-wise kernel under each setting
    settings = [dict(kernel="general", block=64, num_warps=4, dot_f32=True, waves=2),
                dict(kernel="general", block=64, num_warps=4, dot_f32=False, waves=2)]
    settings += [dict(kernel="rows", num_warps=w, dot_f32=False, waves=wv) for w in (4, 8) for wv in (2, 4, 1, 8)]
    settings += [dict(kernel="rows", num_warps=2, dot_f32=False, waves=wv) for wv in (4, 8, 16)]
    settings += [dict(kernel="rows", num_warps=w, dot_f32=False, waves=8, num_stages=st) for w in (2, 4) for st in (2, 4)]
    settings += [dict(kernel="rows", num_warps=w, dot_f32=True, waves=2) for w in (4, 8)]
    cases = []
    for bits, group in ((4, 32), (2, 64), (2, 32)):
        for batch in (1, 8):
            d = 128
            g = torch.Generator(device=device).manual_seed(d * bits + batch)
            shape = (batch, opts.kv_heads, 32768, d)
            k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
            v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
            seg = QuantSegment(*kivi_key_codes(k, bits, group), *kivi_value_codes(v, bits, min(group, d)),
                               bits, bits, group, min(group, d), d)
            q = torch.randn(batch, opts.kv_heads, opts.group, d, generator=g, device=device) / math.sqrt(d)
            cases.append((dict(head_dim=d, bits=bits, group=group, batch=batch), seg, q,
                          quant_partial_triton(q, seg, None)))
            del k, v
    for s in settings:  # every case under one setting before the next, so a cut-off run still compares settings
        for base, seg, q, ref in cases:
            if deadline.passed():
                rows.append(dict(setting="(budget spent)"))
                return rows
            row = dict(base, **s)
            knobs = {k: v for k, v in s.items() if k != "kernel"}
            fn = quant_partial_triton if s["kernel"] == "general" else quant_partial_rows
            try:
                got = fn(q, seg, None, **knobs)
                row["max_err"] = _output_error(got, ref)
                row["ms"] = time_ms(lambda: fn(q, seg, None, **knobs), opts.iters, device)
                row["gb_per_s"] = seg.nbytes() / row["ms"] / 1e6
                row.update(_graph_or_error(lambda: fn(q, seg, None, **knobs), opts.iters))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows


def _output_error(got, ref) -> float:
    """Largest difference of the normalized outputs (acc / l) of two partials (m, l, acc)."""
    return float(((got[2] / got[1].unsqueeze(-1)) - (ref[2] / ref[1].unsqueeze(-1))).abs().max())


TOKEN_SETTINGS = tuple(dict(block=bl, num_warps=w, waves=wv) for bl in (16, 32, 64) for w in (2, 4, 8) for wv in (2, 8))
TOKEN_CASES = tuple(dict(head_dim=128, dtype="int4", batch=b, prerope=p) for p in (False, True) for b in (1, 8))


def token_sweep(device: str, opts, deadline: Deadline, settings=TOKEN_SETTINGS, cases=TOKEN_CASES,
                tokens: int = 32768) -> list[dict]:
    """The per-token kernel (`triton_tokens`) at `tokens` tokens under each launch setting of `settings` (dicts of
    `token_partial_triton`'s block / num_warps / waves, and `num_stages`) for each case of `cases` (dicts of
    head_dim, dtype, batch, prerope): GPU time of the kernel alone (its split partials left unmerged, replayed from a
    CUDA graph) and errors against the default launch."""
    from hf_kvcache.kernels.triton_tokens import token_launch, token_partial_triton

    built = []
    for c in cases:
        seg = to_device(token_case(c["batch"], opts.kv_heads, tokens, c["head_dim"], c["dtype"], c["prerope"],
                                   c["batch"]), device)
        q = torch.randn(c["batch"], opts.kv_heads, opts.group, c["head_dim"], device=device) / math.sqrt(c["head_dim"])
        built.append((dict(c, tokens=tokens), seg, q, token_partial_triton(q, seg, None, dot_f32=False)))
    rows: list[dict] = []
    for s in settings:
        for base, seg, q, ref in built:
            if deadline.passed():
                rows.append(dict(setting="(budget spent)"))
                return rows
            block, warps, waves = token_launch(base["head_dim"], False)
            row = dict(base, kernel="tokens", dot_f32=False,
                       default=s == dict(block=block, num_warps=warps, waves=waves), **s)
            try:
                got = token_partial_triton(q, seg, None, dot_f32=False, **s)
                row["max_err"] = _output_error(got, ref)
                row["ms"] = graph_ms(lambda: token_partial_triton(q, seg, None, dot_f32=False, merged=False, **s),
                                     opts.iters)
                row["gb_per_s"] = segment_bytes([seg]) / row["ms"] / 1e6
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows
