"""One-shot GPU check (`hf-kvcache gpu-check --out DIR`): everything the library needs to know from one short lease of
a CUDA GPU, written as `gpu_check.json` and a markdown table `gpu_check.md` into DIR after every section (a run cut
off by its time limit still leaves what it measured).

Sections, in order, each bounded by a share of `--budget-s`:
  environment  versions, device, SMs, memory
  bandwidth    device-to-device copy (bytes read + written / time): the ceiling the decode kernels are read against
  correctness  every Triton kernel the library launches against its torch reference (the same codes, dequantized, and
               softmax attention in fp32 on the CPU): KIVI-layout segments (2 / 4 / 8 bits, groups 32 / 64, head dims
               64 / 128 / 256, GQA 1 / 4 / 8, with and without a key mask, the attention mass), per-token segments
               (int4 / int8, keys as they come or pre-RoPE), the KIVI pack kernels against the torch quantizer
  decode       decode attention (one query position) of the tiered / int4 / int8 / KIVI caches, filled with random
               bf16 keys and values in 4K-token chunks, against SDPA over the bf16 cache (flash backend where it takes
               the shape): 4K / 32K / 128K tokens, batch 1 and 8, head dims 64 and 128, 8 KV heads x 4 query heads
               each; milliseconds (median of CUDA-event timings), bytes read, GB/s and its share of the copy bandwidth
  sweep        the KIVI-layout decode kernel's launch knobs (tokens per tile, warps, fp16 dots, programs per SM) at 32K
  generate     `generate` tokens/s in bf16 with a random-weight model of a zoo architecture (speed does not depend on
               the weights' values) and a long random prompt, per cache, prefill and decode timed apart

Without CUDA the command fails with a ValueError (nothing is skipped silently); `--dry-run` runs the same sections
with tiny sizes on the CPU (no Triton: the torch paths), so the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

# architectures of zoo models (the values their GGUF headers carry), for the random-weight generate timing
ARCHITECTURES = {
    "qwen2.5-coder-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True),
}


@dataclass
class CheckOptions:
    """What the check runs; the defaults are the one-shot run on a GPU (about 6 minutes on an H100-class card, the budget)."""

    out: Path
    budget_s: float = 360.0
    dry_run: bool = False
    lengths: tuple[int, ...] = (32768, 4096, 131072)  # 32K first: the target
    batches: tuple[int, ...] = (1, 8)
    head_dims: tuple[int, ...] = (128, 64)
    caches: tuple[str, ...] = ("tiered", "int4", "int8", "kivi")
    kv_heads: int = 8
    group: int = 4
    iters: int = 20
    model: str = "qwen2.5-coder-0.5b"
    prompt_tokens: int = 32768
    new_tokens: int = 32
    generate_caches: tuple[str, ...] = ("dynamic", "int8", "int4", "tiered", "kivi")
    # the share of the budget each section may use (what is left over passes on to the next)
    shares: dict[str, float] = field(default_factory=lambda: dict(
        environment=0.01, bandwidth=0.02, correctness=0.22, decode=0.33, sweep=0.14, generate=0.28))

    @classmethod
    def dry(cls, out: Path) -> "CheckOptions":
        """Tiny sizes for a run on the CPU (tests, and the dry run of the command)."""
        return cls(out=out, budget_s=120.0, dry_run=True, lengths=(256,), batches=(1,), head_dims=(64,),
                   iters=2, model="smollm2-135m", prompt_tokens=128, new_tokens=3,
                   generate_caches=("dynamic", "int4"))


class Report:
    """Sections of results, written to `out` after every change."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, object] = {}

    def put(self, section: str, value: object) -> None:
        self.data[section] = value
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "gpu_check.md").write_text(render_markdown(self.data))


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Median milliseconds of `iters` calls after two warm-up calls (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- environment and bandwidth ----------------------------------------------------------------------------------------
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


# ---- moving segments --------------------------------------------------------------------------------------------------
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


# ---- correctness ------------------------------------------------------------------------------------------------------
def kivi_case(b: int, h: int, t: int, d: int, bits: int, group: int, seed: int):
    """A KIVI-layout `QuantSegment` (CPU, torch quantizer) of random keys with channel offsets, and a full tail."""
    from hf_kvcache.kernels.kivi_pack import kivi_keys_reference, kivi_values_reference
    from hf_kvcache.kernels.segments import FullSegment, QuantSegment

    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=g) + 3 * torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(b, h, t, d, generator=g)
    kc, ks, kz = kivi_keys_reference(k, bits, group)
    vc, vs, vz = kivi_values_reference(v, bits, min(group, d))
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


def correctness(device: str, opts: CheckOptions, deadline: Deadline) -> list[dict]:
    rows: list[dict] = []
    dims = opts.head_dims if opts.dry_run else (128, 64, 256)
    t = 96 if opts.dry_run else 1000
    for i, d in enumerate(dims):  # every kernel at the first head dim before the others
        for block in (_kivi_cases, _token_cases, _pack_cases):
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


def _pack_cases(device: str, d: int, t: int, deadline: Deadline, seed: int) -> list[dict]:
    return pack_correctness(device, (d,), t)



def pack_correctness(device: str, dims, t: int) -> list[dict]:
    """The KIVI pack kernels on `device` against the torch quantizer: share of codes that differ, max scale error."""
    from hf_kvcache.kernels.kivi_pack import (kivi_keys_reference, kivi_quantize_keys, kivi_quantize_values,
                                              kivi_values_reference)

    rows = []
    for d in dims:
        for bits, group in ((2, 64), (4, 32)):
            x = torch.randn(1, 2, t - t % group, d, generator=torch.Generator().manual_seed(d + bits))
            for what, fast, ref, grp in (("keys", kivi_quantize_keys, kivi_keys_reference, group),
                                         ("values", kivi_quantize_values, kivi_values_reference, min(group, d))):
                def run(fast=fast, ref=ref, grp=grp):
                    got = [y.cpu() for y in fast(x.to(device, torch.bfloat16), bits, grp)]
                    want = ref(x.to(torch.bfloat16), bits, grp)
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


# ---- decode timing ----------------------------------------------------------------------------------------------------
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


def fill_cache(name: str, k: torch.Tensor, v: torch.Tensor, chunk: int = 4096):
    """A cache of ours named `name`, its layer 0 fed `k`, `v` in chunks (a chunked prefill), and the layer."""
    from hf_kvcache.registry import build_cache

    cache = build_cache(name)
    for s in range(0, k.shape[2], chunk):
        cache.update(k[:, :, s : s + chunk], v[:, :, s : s + chunk], 0)
    return cache, cache.layers[0]


def decode_timing(device: str, opts: CheckOptions, deadline: Deadline, copy_gbps: float | None) -> list[dict]:
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
                    rows.append(dict(base, cache=f"sdpa bf16 ({backend})", ms=sdpa_ms, bytes=nbytes,
                                     gb_per_s=nbytes / sdpa_ms / 1e6, vs_sdpa=1.0,
                                     bw_share=_share(nbytes, sdpa_ms, copy_gbps)))
                except Exception as exc:
                    sdpa_ms = None
                    rows.append(dict(base, cache="sdpa bf16", error=f"{type(exc).__name__}: {exc}"[:300]))
                new_k = torch.randn(batch, opts.kv_heads, 1, d, generator=g, device=device, dtype=dtype)
                new_v = torch.randn_like(new_k)
                for name in opts.caches:
                    if deadline.passed():
                        break
                    try:
                        cache, layer = fill_cache(name, k, v)
                        segments = [*layer.attention_segments(), FullSegment(new_k, new_v)]
                        ms = time_ms(lambda: decode_attention(q, segments), opts.iters, device)
                        nbytes = segment_bytes(segments)
                        rows.append(dict(base, cache=name, ms=ms, bytes=nbytes, gb_per_s=nbytes / ms / 1e6,
                                         vs_sdpa=None if sdpa_ms is None else sdpa_ms / ms,
                                         bw_share=_share(nbytes, ms, copy_gbps),
                                         segments=" + ".join(_describe(s) for s in segments)))
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
    from hf_kvcache.kernels.segments import FullSegment, QuantSegment

    if isinstance(seg, QuantSegment):
        return f"kivi{seg.k_bits}/{seg.k_group}x{seg.tokens}"
    if isinstance(seg, FullSegment):
        return f"full{'@' + str(seg.overlay_at) if seg.overlay_at is not None else ''}x{seg.tokens}"
    return f"tok{seg.keys.bits}{'pre' if seg.key_codec is not None else ''}x{seg.tokens}"


# ---- launch-knob sweep ------------------------------------------------------------------------------------------------
def kernel_sweep(device: str, opts: CheckOptions, deadline: Deadline) -> list[dict]:
    """The KIVI-layout decode kernels at 32K tokens, head dim 128, under each launch setting (the general kernel as it
    launched before, the row-wise kernel's warps / programs per SM / dots); errors against the general fp32 launch."""
    rows: list[dict] = []
    if not device.startswith("cuda"):
        return [dict(setting="(needs CUDA: the sweep launches the Triton kernel directly)")]
    from hf_kvcache.kernels.kivi_pack import kivi_quantize_keys, kivi_quantize_values
    from hf_kvcache.kernels.segments import QuantSegment
    from hf_kvcache.kernels.triton_decode import quant_partial_triton
    from hf_kvcache.kernels.triton_quant import quant_partial_rows

    # the general kernel's launch as it was, then the row-wise kernel under each setting
    settings = [dict(kernel="general", block=64, num_warps=4, dot_f32=True, waves=2),
                dict(kernel="general", block=64, num_warps=4, dot_f32=False, waves=2)]
    settings += [dict(kernel="rows", num_warps=w, dot_f32=False, waves=wv) for w in (4, 8) for wv in (2, 4, 1, 8)]
    settings += [dict(kernel="rows", num_warps=w, dot_f32=True, waves=2) for w in (4, 8)]
    cases = []
    for bits, group in ((4, 32), (2, 64)):
        for batch in (1, 8):
            d = 128
            g = torch.Generator(device=device).manual_seed(d * bits + batch)
            shape = (batch, opts.kv_heads, 32768, d)
            k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
            v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
            seg = QuantSegment(*kivi_quantize_keys(k, bits, group), *kivi_quantize_values(v, bits, min(group, d)),
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
                row["max_err"] = float(((got[2] / got[1].unsqueeze(-1)) - (ref[2] / ref[1].unsqueeze(-1))).abs().max())
                row["ms"] = time_ms(lambda: fn(q, seg, None, **knobs), opts.iters, device)
                row["gb_per_s"] = seg.nbytes() / row["ms"] / 1e6
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows


# ---- generate ---------------------------------------------------------------------------------------------------------
def random_model(name: str, device: str, dtype: torch.dtype):
    """A model of the zoo architecture `name` with random weights (seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHITECTURES[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def generate_timing(device: str, opts: CheckOptions, deadline: Deadline) -> list[dict]:
    import hf_kvcache  # noqa: F401  (registers the cache names with generate)

    dtype = torch.bfloat16
    model = random_model(opts.model, device, dtype)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, opts.prompt_tokens), generator=torch.Generator().manual_seed(1)).to(device)
    rows = []
    for name in opts.generate_caches:
        if deadline.passed():
            rows.append(dict(cache="(budget spent)"))
            break
        kwargs = {} if name == "dynamic" else dict(cache_implementation=name)
        try:  # compiles this cache's kernels outside the timings (a short prompt, a few decode steps)
            with torch.no_grad():
                model.generate(ids[:, :300], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                               **kwargs)
        except Exception:
            pass  # the timed calls below report the error
        row = dict(model=f"{opts.model} architecture, random weights, bf16", prompt=opts.prompt_tokens, cache=name)
        try:
            def gen(n):
                with torch.no_grad():
                    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                          pad_token_id=0, **kwargs)
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync(device)
            t0 = time.perf_counter()
            gen(1)
            sync(device)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = gen(opts.new_tokens + 1)
            sync(device)
            total = time.perf_counter() - t0
            row.update(prefill_s=prefill, decode_tok_s=opts.new_tokens / max(total - prefill, 1e-9),
                       new_tokens=int(out.shape[1] - ids.shape[1]))
            if device.startswith("cuda"):
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {exc}"[:300], trace=traceback.format_exc(limit=6)[-1200:])
        rows.append(row)
    base = next((r for r in rows if r.get("cache") == "dynamic" and "decode_tok_s" in r), None)
    for r in rows:
        if base and "decode_tok_s" in r:
            r["vs_dynamic"] = r["decode_tok_s"] / base["decode_tok_s"]
    return rows


# ---- the run ----------------------------------------------------------------------------------------------------------
def run(opts: CheckOptions) -> dict:
    """Run every section within the budget; returns the report's data (also written to `opts.out`)."""
    device = "cpu" if opts.dry_run else "cuda"
    if not opts.dry_run and not torch.cuda.is_available():
        raise ValueError("gpu-check needs a CUDA GPU and torch built with CUDA; none is visible here (use --dry-run "
                         "to run the script with tiny sizes on the CPU)")
    report = Report(opts.out)
    start = time.monotonic()
    spent_share = 0.0
    copy_gbps = None
    for section in ("environment", "bandwidth", "correctness", "decode", "sweep", "generate"):
        spent_share += opts.shares[section]
        deadline = Deadline(start + opts.budget_s * spent_share - time.monotonic())
        t0 = time.monotonic()
        try:
            if section == "environment":
                result = environment(device)
            elif section == "bandwidth":
                result = copy_bandwidth(device, opts.dry_run)
                copy_gbps = result["gb_per_s"]
            elif section == "correctness":
                result = correctness(device, opts, deadline)
            elif section == "decode":
                result = decode_timing(device, opts, deadline, copy_gbps)
            elif section == "sweep":
                result = kernel_sweep(device, opts, deadline) if not opts.dry_run else []
            else:
                result = generate_timing(device, opts, deadline)
        except Exception as exc:
            result = dict(error=f"{type(exc).__name__}: {exc}"[:500], trace=traceback.format_exc(limit=8)[-2000:])
        report.put(section, result)
        report.put(f"{section}_seconds", round(time.monotonic() - t0, 1))
        print(f"[gpu-check] {section}: {time.monotonic() - t0:.1f} s", flush=True)
    return report.data


# ---- rendering --------------------------------------------------------------------------------------------------------
def _table(rows: list[dict], columns: list[str]) -> str:
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return "(none)\n"
    columns = [c for c in columns if any(c in r for r in rows)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x).replace("|", "/").replace("\n", " ")


def render_markdown(data: dict) -> str:
    parts = ["# hf-kvcache gpu-check\n"]
    env = data.get("environment")
    if isinstance(env, dict):
        parts.append(", ".join(f"{k} {v}" for k, v in env.items()) + "\n")
    bw = data.get("bandwidth")
    if isinstance(bw, dict) and "gb_per_s" in bw:
        parts.append(f"Copy bandwidth (read + written): {bw['gb_per_s']:,.0f} GB/s\n")
    for name, cols in (("correctness", ["case", "qdtype", "ok", "out_err", "out_scale", "mass_err", "codes_differ",
                                        "scale_err", "error"]),
                       ("decode", ["head_dim", "batch", "tokens", "cache", "ms", "vs_sdpa", "bytes", "gb_per_s",
                                   "bw_share", "segments", "error"]),
                       ("sweep", ["head_dim", "bits", "group", "batch", "kernel", "block", "num_warps", "dot_f32", "waves", "ms",
                                  "gb_per_s", "max_err", "error", "setting"]),
                       ("generate", ["model", "prompt", "cache", "prefill_s", "decode_tok_s", "vs_dynamic",
                                     "peak_gib", "new_tokens", "error"])):
        value = data.get(name)
        if value is None:
            continue
        parts.append(f"\n## {name} ({data.get(f'{name}_seconds', '?')} s)\n")
        parts.append(_table(value, cols) if isinstance(value, list) else f"```\n{json.dumps(value, indent=1)}\n```\n")
    return "\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--budget-s", type=float, default=360.0, help="seconds for the whole check (default 360)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: tests the script, measures nothing")


def main_args(args: argparse.Namespace) -> int:
    opts = CheckOptions.dry(args.out) if args.dry_run else CheckOptions(out=args.out, budget_s=args.budget_s)
    data = run(opts)
    print((args.out / "gpu_check.md").read_text())
    failed = [r for r in data.get("correctness", []) if isinstance(r, dict) and r.get("ok") is False]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hf_kvcache.eval.gpu_check`: the same as `hf-kvcache gpu-check`, importing nothing else of the CLI
    (a GPU machine may lack the codec's packages)."""
    p = argparse.ArgumentParser(prog="python -m hf_kvcache.eval.gpu_check", description=__doc__.split("\n")[0])
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
