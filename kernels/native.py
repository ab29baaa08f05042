"""The CPU decode kernel compiled from C (`native_decode.c`): attention over a quantized segment straight from its
packed codes, with no float copy of the codes in memory (the torch path of `from_codes` unpacks each block into
scratch first and so reads and writes as many bytes as a full-precision cache would).

The source is compiled once per machine (`build.compile_library`: the system C compiler, `$CC` else `cc`) at
`-O3 -march=native -ffast-math -fopenmp` into `~/.cache/hf-kvcache/native/` (`$HF_KVCACHE_NATIVE_DIR` to move it),
keyed by the source, the flags and the CPU, and loaded with `ctypes` (a foreign call releases the GIL). OpenMP
resolves to the `libgomp` that torch already loaded, so both share one thread pool; the kernel runs on
`torch.get_num_threads()` threads. Where no compiler works the kernel is unavailable (`available()` says why, once,
as a warning) and the fused attention keeps its torch path; `HF_KVCACHE_NATIVE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from .blockwise import PerRope, position_table, scratch
from .build import LibraryBuild as _Build, compile_library, switched_off
from .segments import QuantSegment, TokenSegment
from hf_kvcache.quant.uniform import FP8_DTYPES
from hf_kvcache.rope import version_of


SOURCE = Path(__file__).with_name("native_decode.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
# with several threads: tokens per task at least (tasks run on the threads; their chunks merge by log-sum-exp)
CHUNK_TOKENS = 1024
NEG = -3.0e38  # the C kernels' score of a masked key and maximum of a row with none (no infinities: -ffast-math)

_build = _Build()
_off = threading.local()  # `turned_off()` sets `.depth` in this thread


def _compile() -> ctypes.CDLL:
    lib = compile_library(SOURCE, FLAGS)
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.quant_partial.restype = i
    lib.quant_partial.argtypes = [p, i, i, i, i, i, p, i64, i64, i64, i, i, p, p, p, i64, i64, i64, i, i, p, p, p,
                                  i, i, p, p, p, p, p, p, p]
    lib.native_supports.restype = i
    lib.native_supports.argtypes = [i] * 6
    lib.token_partial.restype = i
    f = ctypes.c_float
    lib.token_partial.argtypes = [p, i, i, i, i, i, p, i64, i64, i64, i, i, p, p, i64, i64, i64, f,
                                  p, i64, i64, i64, i, i, p, p, i64, i64, i64, f,
                                  p, p, i64, p, p, i64, i64, p, p, p, p, p, p, p, i, i, i, i, p, p, p, p, p, p, p]
    lib.token_supports.restype = i
    lib.token_supports.argtypes = [i] * 6
    lib.token_tile.restype = i
    lib.token_tile.argtypes = []
    lib.token_max_dense.restype = i
    lib.token_max_dense.argtypes = []
    return lib


@contextmanager
def turned_off():
    """Within the block (this thread), the fused attention keeps its torch path (benchmarks compare the two)."""
    _off.depth = getattr(_off, "depth", 0) + 1
    try:
        yield
    finally:
        _off.depth -= 1


def enabled() -> bool:
    """Whether the compiled CPU kernels may run in this thread (not `turned_off`, not `HF_KVCACHE_NATIVE=0`)."""
    return not switched_off() and not getattr(_off, "depth", 0)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (after one warning) where it cannot be built or is off."""
    if not enabled():
        return None
    return _build.load(_compile, "the native CPU decode kernel (the fused attention uses its torch path)")


def available() -> tuple[bool, str]:
    """(whether the kernel can run here, why not)."""
    lib = library()
    if lib is None:
        return False, _build.error or "turned off by HF_KVCACHE_NATIVE=0"
    return True, ""


def supports(q: torch.Tensor, seg: QuantSegment) -> bool:
    """Whether the kernel takes these grouped queries [B, H, M, D] over this segment (CPU, M <= 16 rows, head_dim
    64 / 128 / 256, 2, 4 or 8 bits, key groups a multiple of 16 tokens)."""
    if q.device.type != "cpu" or seg.k_codes.device.type != "cpu":
        return False
    return library() is not None and _has_variant("native_supports", q.shape[2], q.shape[3], seg.k_bits, seg.v_bits,
                                                  seg.k_group, seg.v_group)


@functools.lru_cache(maxsize=None)
def _has_variant(check: str, *shape: int) -> bool:
    """The library's answer to `check` (`native_supports` / `token_supports`) for these shape numbers, asked once."""
    return bool(getattr(library(), check)(*shape))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def as_float32(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` as contiguous float32 (itself when it is: no dispatch for the no-op conversions of a decode step)."""
    if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
        return t
    return t.float().contiguous()


def blocks_of(t: torch.Tensor, inner: int) -> int:
    """How many blocks of `inner` elements the contiguous `t` holds (its batch size, read without a reshape); 0 when
    they do not divide it."""
    return 0 if t.numel() % inner else t.numel() // inner


def _bytes_strides(codes: torch.Tensor) -> torch.Tensor:
    return codes if codes.stride(-1) == 1 else codes.contiguous()


def kivi_operands(seg: QuantSegment, half_scales: bool = False) -> tuple[torch.Tensor, ...]:
    """A KIVI-layout segment as the kernel reads it: key and value codes as row-contiguous bytes, then the key scale
    and zero and the value scale and zero, contiguous: float32, or (`half_scales`, where all four are fp16) as the
    fp16 they are stored in (the decode step's call reads those)."""
    kc, vc = _bytes_strides(seg.k_codes), _bytes_strides(seg.v_codes)
    scales = (seg.k_scale, seg.k_zero, seg.v_scale, seg.v_zero)
    if half_scales and all(x.dtype == torch.float16 for x in scales):
        return (kc, vc, *(x.contiguous() for x in scales))
    return (kc, vc, *(as_float32(x) for x in scales))


def quant_partial_native(q: torch.Tensor, seg: QuantSegment, key_valid: torch.Tensor | None,
                         chunks: int | None = None):
    """Softmax partial (row max, row sum, unnormalized output) of grouped, scaled queries `q` [B, H, M, D] (in the
    segment's key basis) over the segment, as `from_codes.quant_partial_codes`; `key_valid` [B, T] boolean (one
    key mask for every row) or None. `chunks`: how many token chunks the work splits into (default: two tasks per
    thread where the tokens allow, one per row and head on one thread). Call only where `supports` says so."""
    b, h, m, d = q.shape
    t = seg.tokens
    threads, chunks = _split(t, b * h, chunks)
    q = q.float().contiguous()
    kc, vc, ks, kz, vs, vz = kivi_operands(seg)
    valid = None if key_valid is None else key_valid.to(torch.uint8).contiguous()
    work, (cmx, csum, cacc), (mx, total, acc) = _outputs(b, h, m, d, t, chunks)
    rc = library().quant_partial(
        _ptr(q), b, h, m, d, t, _ptr(kc), *kc.stride()[:3], seg.k_bits, seg.k_group, _ptr(ks), _ptr(kz),
        _ptr(vc), *vc.stride()[:3], seg.v_bits, seg.v_group, _ptr(vs), _ptr(vz), _ptr(valid), chunks, threads,
        _ptr(work), _ptr(cmx), _ptr(csum), _ptr(cacc), _ptr(mx), _ptr(total), _ptr(acc),
    )
    if rc:
        raise ValueError(f"the native kernel has no variant for this segment ({seg.k_bits}/{seg.v_bits} bits, "
                         f"head_dim {d}, {m} rows, key group {seg.k_group}): check `supports` first")
    return mx, total, acc


def supports_tokens(q: torch.Tensor, seg: TokenSegment) -> bool:
    """Whether `token_partial_native` takes these grouped queries [B, H, M, D] over this per-token segment (CPU,
    integer codes of 2, 4 or 8 bits or fp8 codes with fp16 scales, M <= 16 rows, head_dim 64 / 128 / 256 for keys and
    values alike)."""
    k, v = seg.keys, seg.values
    if q.device.type != "cpu" or k.codes.device.type != "cpu":
        return False
    if any(t is not None and t.dtype != torch.float16 for t in (k.scale, k.zero, v.scale, v.zero)):
        return False
    if k.n != q.shape[3] or v.n != q.shape[3]:
        return False
    return library() is not None and _has_variant("token_supports", q.shape[2], q.shape[3], k.bits, v.bits,
                                                  k.group_size, v.group_size)


def _half_scales(x) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int, int], float]:
    """The fp16 scales and zeros (None: none stored) of per-token codes `[B, H, T, groups]` as the per-token kernel
    reads them, their element strides (batch, head, token; the last dim contiguous, the zeros' the same), and the
    factor that gives a zero from its scale where none is stored (a symmetric integer format's -offset, 0 for fp8)."""
    scale, zero = x.scale, x.zero
    if scale.stride(-1) != 1 or (zero is not None and zero.stride() != scale.stride()):
        scale, zero = scale.contiguous(), None if zero is None else zero.contiguous()
    offset = 0.0 if x.fmt in FP8_DTYPES or zero is not None else -float(2 ** (x.bits - 1) - 1)
    return scale, zero, tuple(scale.stride()[:3]), offset


_FP8_TABLES: dict[str, torch.Tensor] = {}


def _codes_and_table(x) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The codes as bytes (row-contiguous) and, for fp8, the float32 value of each of the 256 codes."""
    if x.fmt not in FP8_DTYPES:
        return _bytes_strides(x.codes), None
    table = _FP8_TABLES.get(x.fmt)
    if table is None:
        table = _FP8_TABLES[x.fmt] = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPES[x.fmt]).float()
    return _bytes_strides(x.codes.view(torch.uint8)), table


def _outputs(b: int, h: int, m: int, d: int, t: int, chunks: int):
    """Scratch for the scores (`[b h m t]` floats, reused), the chunk partials (max, sum `[b, h, chunks, m]`, output
    `[b, h, chunks, m, d]`; `chunks` counts every partial slot of a row) and the merged partial (`[b, h, m]` twice,
    `[b, h, m, d]`) a kernel call writes."""
    work = scratch("native_scores", b * h * m * t, torch.float32, torch.device("cpu"))
    rows = b * h * m
    sizes = (*_chunk_sizes(rows, chunks, d), rows, rows, rows * d)
    cmx, csum, cacc, mx, total, acc = torch.empty(sum(sizes)).split(sizes)  # one allocation, six views
    chunk = cmx.view(b, h, chunks, m), csum.view(b, h, chunks, m), cacc.view(b, h, chunks, m, d)
    return work, chunk, (mx.view(b, h, m), total.view(b, h, m), acc.view(b, h, m, d))


def _chunk_sizes(rows: int, chunks: int, d: int) -> tuple[int, int, int]:
    """Floats of the chunk partials a kernel call writes: max and sum `[rows, chunks]`, output `[rows, chunks, d]`."""
    return rows * chunks, rows * chunks, rows * chunks * d


def _step_outputs(b: int, h: int, m: int, d: int, t: int, chunks: int) -> tuple[list[int], torch.Tensor]:
    """`_outputs` for a call that returns only the normalized output: the pointers of the scores, chunk partials and
    row max / sum (one scratch buffer of this thread, nothing allocated once it is large enough) and the output
    `[b, h, m, d]` (a new tensor)."""
    rows = b * h * m
    sizes = (rows * t, *_chunk_sizes(rows, chunks, d), rows, rows)
    base = scratch("native_step", sum(sizes), torch.float32, torch.device("cpu")).data_ptr()
    ptrs = []
    for size in sizes:
        ptrs.append(base)
        base += 4 * size
    return ptrs, torch.empty(b, h, m, d)


def _split(t: int, rows: int, chunks: int | None) -> tuple[int, int]:
    """(threads, token chunks) of a call over `t` tokens and `rows` (batch row, head) pairs: by default two tasks per
    thread where the tokens allow, one per row and head on one thread."""
    threads = torch.get_num_threads()
    if chunks is None:
        chunks = 1 if threads == 1 else max(1, min(-(-t // CHUNK_TOKENS), -(-2 * threads // rows)))
    return threads, chunks


_angle_tables = PerRope()  # (n, cos, sin) of positions 0..n-1 per RoPE: see `_angles`
_last_angles = PerRope()  # (positions, their version, a copy, cos, sin) per RoPE: see `_angles`
_tile_angles = PerRope()  # (cos, sin) `[D / 2, tile]` of positions 0..tile-1, no attention scaling: see `_angles`
_last_columns = PerRope()  # (start, tokens, composed, `_angles`' answer) of the last consecutive positions per RoPE


# The widest key codes whose angles the kernel composes at any position (`_angles`): the composition's rounding grows
# with the position and stays far below what 4-bit codes lose. Wider (8-bit) codes compose while every position is
# below COMPOSED_WIDE_POSITIONS, where the rounding stays under a tenth of what their own codes lose on the output;
# past it they read every column (docs/results/speed.md has the figures).
COMPOSED_MAX_BITS = 4
COMPOSED_WIDE_POSITIONS = 32768


def _tile_table(rope) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[D / 2, tile]` (contiguous, no attention scaling) of positions `0..tile-1`, `tile` the C
    kernel's tokens per tile: a tile at position p turns its keys by these and its query rows by p's angles."""
    held = _tile_angles.get(rope)
    if held is None:
        tile = library().token_tile()
        held = _tile_angles.put(rope, tuple(t[0].transpose(0, 1).contiguous()
                                            for t in rope.cos_sin_at(torch.arange(tile).view(1, -1))))
    return held


def _angles(rope, positions: torch.Tensor, tokens: int, compose_below: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, int, tuple | None]:
    """cos and sin `[B or 1, D / 2, T]` of RoPE at `positions` (`[T]`, or `[B, 1, T]`: `T = tokens`), times its
    attention scaling, their row stride (elements), and the tile table (`_tile_table`) where the kernel may compose
    the angles (None: it reads every column). `compose_below`: compose only while every position is below it (None:
    at any position).

    Consecutive positions shared by every row (a layer holding the newest tokens: every layer of every decode step)
    are columns of this thread's table of positions `0..` kept per RoPE object (`[1, D / 2, capacity]`, grown to the
    next power of two when asked past its end): no angle is computed again as the steps go, and the kernel reads one
    column a tile (the tile's first position p), turning the tile's keys by the angles of `0..tile-1` instead
    (R(p + t) = R(p) R(t): the same rotation up to float rounding, not the same bits). Other positions (per-row
    padding, the slots an evicting cache kept) get a table of their own, reused while the same RoPE asks at the same
    positions (the layers of one decode step), every column read. The answer for consecutive positions is given
    again while the same RoPE asks for the same ones (the layers of a decode step)."""
    start = _consecutive_start(positions)
    if start is not None:
        composed = compose_below is None or start + tokens <= compose_below
        last = _last_columns.get(rope)
        if last is not None and last[:3] == (start, tokens, composed):
            return last[3]
        n, cos, sin = position_table(_angle_tables, rope, start + tokens, _position_columns)
        answer = (cos[:, :, start : start + tokens], sin[:, :, start : start + tokens], n,
                  _tile_table(rope) if composed else None)
        return _last_columns.put(rope, (start, tokens, composed, answer))[3]
    last = _last_angles.get(rope)
    if last is not None and (
        (last[0] is positions and last[1] == version_of(positions))
        or (last[2].shape == positions.shape and torch.equal(last[2], positions))
    ):
        return last[3], last[4], tokens, None
    cos, sin = _angle_table(rope, positions.reshape(-1, tokens))
    _last_angles.put(rope, (positions, version_of(positions), positions.clone(), cos, sin))
    return cos, sin, tokens, None


def _position_columns(rope, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_angle_table` of positions `0..n-1`: `[1, D / 2, n]` each."""
    return _angle_table(rope, torch.arange(n).view(1, -1))


def _angle_table(rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[B, D / 2, T]` (contiguous) of `positions [B, T]`, times the RoPE's attention scaling."""
    return tuple(t.mul(rope.scaling).transpose(1, 2).contiguous() for t in rope.cos_sin_at(positions))


_last_start = threading.local()  # (positions, their version, `_consecutive_start` of them) of the last call


def _consecutive_start(positions: torch.Tensor) -> int | None:
    """The first of `positions` when they are `[T]` integers counting up by one from a position >= 0, else None; the
    last answer given again while the same tensor asks unchanged (the layers of a decode step share it)."""
    last = getattr(_last_start, "value", None)
    if last is not None and last[0] is positions and last[1] == version_of(positions):
        return last[2]
    start = None
    if positions.dim() == 1 and positions.numel() > 0 and not positions.is_floating_point():
        first = int(positions[0])
        if first >= 0 and (positions.numel() == 1 or bool((positions.diff() == 1).all())):
            start = first
    _last_start.value = (positions, version_of(positions), start)
    return start


def max_dense() -> int:
    """How many full-precision tokens `token_partial_native` takes beside the codes (the C source's MAXDENSE; 0
    where the kernel is unavailable)."""
    return 0 if library() is None else _library_max_dense()


@functools.lru_cache(maxsize=None)
def _library_max_dense() -> int:
    return int(library().token_max_dense())


def token_partial_native(q: torch.Tensor, seg: TokenSegment, key_valid: torch.Tensor | None,
                         chunks: int | None = None, dense: tuple[torch.Tensor, torch.Tensor] | None = None):
    """`quant_partial_native` for a `TokenSegment`: the softmax partial of grouped, scaled queries `q` [B, H, M, D]
    over its per-token codes (fp8 codes read through a table of their values), pre-RoPE keys rotated back tile by tile
    (the angles folded with the RoPE's attention scaling). `dense`: keys and values `[B, H, n, D]` (float32,
    contiguous, n <= `max_dense()`) of full-precision tokens every row sees (a decode step's new tokens), attended in
    the same call: the partial covers codes and them. Call only where `supports_tokens` says so."""
    b, h, m, d = q.shape
    t = seg.tokens
    chunks = _split(t, b * h, chunks)[1]
    nd = 0 if dense is None else dense[0].shape[2]
    work, (cmx, csum, cacc), (mx, total, acc) = _outputs(b, h, m, d, t, chunks + (nd > 0))
    _token_call(q, seg, key_valid, chunks, dense, False, [_ptr(x) for x in (work, cmx, csum, cacc, mx, total)], acc)
    return mx, total, acc


def token_output_native(q: torch.Tensor, seg: TokenSegment, key_valid: torch.Tensor | None,
                        dense: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`token_partial_native`'s normalized output `[B, H, M, D]` float32 (acc / max(sum, 1e-30), the same bits),
    the partial itself left in scratch: a decode step's whole answer over one segment and its new tokens."""
    b, h, m, d = q.shape
    chunks = _split(seg.tokens, b * h, None)[1]
    nd = 0 if dense is None else dense[0].shape[2]
    ptrs, out = _step_outputs(b, h, m, d, seg.tokens, chunks + (nd > 0))  # the slots `token_partial` fills
    _token_call(q, seg, key_valid, chunks, dense, True, ptrs, out)
    return out


def _token_call(q: torch.Tensor, seg: TokenSegment, key_valid: torch.Tensor | None, chunks: int,
                dense: tuple[torch.Tensor, torch.Tensor] | None, normalize: bool, ptrs: list[int],
                acc: torch.Tensor) -> None:
    """One `token_partial` call of the library writing into `ptrs` (scores, chunk max / sum / output, row max /
    sum) and `acc`."""
    b, h, m, d = q.shape
    t = seg.tokens
    dk, dv = dense if dense is not None else (None, None)
    nd = 0 if dk is None else dk.shape[2]
    q = as_float32(q)
    (kc, klut), (vc, vlut) = _codes_and_table(seg.keys), _codes_and_table(seg.values)
    ks, kz, k_st, k_off = _half_scales(seg.keys)
    vs, vz, v_st, v_off = _half_scales(seg.values)
    shift = scale = cos = sin = tile = None
    cs_sb = r_sb = r_st = 0
    codec = seg.key_codec
    if codec is not None:  # shift, scale [B or 1, H, 1, D]
        shift, scale = as_float32(codec.shift), as_float32(codec.scale)
        cs_sb = h * d if blocks_of(shift, h * d) > 1 else 0
        wide = seg.keys.bits > COMPOSED_MAX_BITS  # 8-bit codes: composed at the first positions only
        cos, sin, r_st, tile = _angles(codec.rope, seg.positions, t, COMPOSED_WIDE_POSITIONS if wide else None)
        r_sb = (d // 2) * r_st if cos.shape[0] > 1 else 0  # [B or 1, D / 2, T] of rows r_st apart
    valid = None if key_valid is None else key_valid.to(torch.uint8).contiguous()
    tile_ptrs = (None, None) if tile is None else (_ptr(tile[0]), _ptr(tile[1]))
    rc = library().token_partial(
        _ptr(q), b, h, m, d, t, _ptr(kc), *kc.stride()[:3], seg.keys.bits, seg.keys.group_size, _ptr(ks), _ptr(kz),
        *k_st, k_off, _ptr(vc), *vc.stride()[:3], seg.values.bits, seg.values.group_size, _ptr(vs), _ptr(vz), *v_st,
        v_off,
        _ptr(shift), _ptr(scale), cs_sb, _ptr(cos), _ptr(sin), r_sb, r_st, *tile_ptrs, _ptr(valid), _ptr(klut), _ptr(vlut),
        _ptr(dk), _ptr(dv), nd, chunks, torch.get_num_threads(), int(normalize), *ptrs, acc.data_ptr(),
    )
    if rc:
        raise ValueError(f"the native kernel has no variant for this per-token segment ({seg.keys.bits}/"
                         f"{seg.values.bits} bits, head_dim {d}, {m} rows, {nd} full-precision tokens): check "
                         f"`supports_tokens` first and pass at most {max_dense()} dense tokens")


__all__ = ["available", "library", "quant_partial_native", "supports", "supports_tokens", "token_output_native",
           "token_partial_native", "turned_off", "enabled"]
