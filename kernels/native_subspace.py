"""Attention over a subspace archive on the CPU in one C call (`native_subspace.c`). `coefficient_partial`: the whole
softmax partial from the packed codes (each key's coefficients unpacked -- a row of up to 64 bytes by one byte
permutation where the CPU has AVX-512 VBMI, else a subspace at a time: the same integers --, rebuilt into the
model's key, turned by RoPE when pre-RoPE and dotted with the query rows while it sits in L1; the values'
coefficients weighted by the probabilities in their whitened basis); `prerope_scores`: the scores alone from
dequantized coefficients (the torch path's blocks and the attention mass). The torch path of `from_subspace` writes
and rereads every unpacked code and rebuilt key. Built like the decode kernel (`build.compile_library`, -O3
-march=native -ffast-math -fopenmp); the angles' cos and sin come from torch (`KeyRotation.cos_sin_at`), so RoPE is
the torch path's. Unavailable (None from `prerope_scores`) where no compiler works, off the CPU, with
`HF_KVCACHE_NATIVE=0` or inside `native.turned_off()`; callers then keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import math
import weakref
from pathlib import Path

import torch

from hf_kvcache.quant.packing import packed_length
from hf_kvcache.quant.subspace import SubspaceRows, gaussian_step
from hf_kvcache.rope import KeyRotation

from .blockwise import PerRope, combine, position_table, scratch
from .build import LibraryBuild, compile_library
from .native import FLAGS, NEG, _split, enabled
from .segments import SubspaceSegment

SOURCE = Path(__file__).with_name("native_subspace.c")
MAX_DIM = 256
MAX_ROWS = 16  # query rows per KV head the kernel takes (grouped heads x positions)
ABI = 2  # `subspace_abi()` of the source this module calls (2: fp16 scales and zeros)
SCALAR_CODES_FLAGS = FLAGS + ("-DHF_KVCACHE_SCALAR_CODES",)  # codes read a subspace at a time (`_compile`)

_build = LibraryBuild()
_tables = PerRope()  # (n, cos, sin) of positions 0..n-1 per RoPE: see `_angles`


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (after one warning) where it cannot be built or is off."""
    if not enabled():
        return None
    return _build.load(_compile, "the native CPU subspace kernel (the fused attention uses its torch path)")


def _compile(flags: tuple[str, ...] = FLAGS, source: Path = SOURCE) -> ctypes.CDLL:
    """The kernel built with `flags` (`SCALAR_CODES_FLAGS`: the build that reads codes a subspace at a time, which the
    tests and `benchmarks/subspace_codes.py` hold the vector reading to) from `source` (another version of it:
    `benchmarks/subspace_builds.py`)."""
    lib = compile_library(source, flags)
    if not hasattr(lib, "subspace_abi") or lib.subspace_abi() != ABI:
        raise RuntimeError(f"{source} is a source of the subspace kernel before fp16 scales (ABI {ABI}): its build "
                           "would read this module's arguments as other types")
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.subspace_rope_scores.restype = i
    lib.subspace_rope_scores.argtypes = [p, p, p, p, p, p, p, i, i, i, i, i, i, ctypes.c_float, i]
    lib.subspace_partial.restype = i
    lib.subspace_partial.argtypes = [p, i, i, i, i, i, p, i, p, i, i, i, p, p, p, p, p, p, ctypes.c_float,
                                     p, i, p, i, i, p, p, p, p, i, i, p, p, p, p, i]
    return lib


def _angles(rope: KeyRotation, start: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[tokens, D / 2]` of positions `start..` (contiguous row slices of this thread's table of positions
    `0..`, kept per RoPE object and grown to the next power of two when a layer asks past its end: the layers of a
    step and the steps of a decode share it; the same numbers as computed for these positions alone)."""
    _, cos, sin = position_table(_tables, rope, start + tokens, _angle_rows)
    return cos[start : start + tokens], sin[start : start + tokens]


def _angle_rows(rope: KeyRotation, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[n, D / 2]` (contiguous) of positions `0..n-1`."""
    return tuple(t.contiguous() for t in rope.cos_sin_at(torch.arange(n, dtype=torch.float32)))


def prerope_scores(q: torch.Tensor, coefficients: torch.Tensor, weights: torch.Tensor, mean: torch.Tensor,
                   rope: KeyRotation, start: int) -> torch.Tensor | None:
    """Scores `[B, H, M, T]` of grouped, scaled queries `q` [B, H, M, D] against the keys
    `rope.rotate(coefficients @ weights + mean, start)`, or None where the kernel does not serve (see the module
    docstring).

    Args:
        coefficients: `[B, H, T, rank]` float32, the keys' dequantized coefficients.
        weights: `[H, rank, D]` float32, the basis (transposed) times sigma.
        mean: `[H, D]` float32.
        rope: the layer's RoPE; start: the position of the first token.
    """
    b, h, m, d = q.shape
    if q.device.type != "cpu" or d % 2 or d > MAX_DIM:
        return None
    lib = library()
    if lib is None:
        return None
    t, rank = coefficients.shape[2], coefficients.shape[3]
    cos, sin = _angles(rope, start, t)
    q, z = q.float().contiguous(), coefficients.float().contiguous()
    weights, mean = weights.float().contiguous(), mean.float().contiguous()
    out = torch.empty(b, h, m, t)
    rc = lib.subspace_rope_scores(z.data_ptr(), weights.data_ptr(), mean.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                  q.data_ptr(), out.data_ptr(), b * h, h, t, rank, d, m, rope.scaling,
                                  torch.get_num_threads())
    if rc:
        raise RuntimeError(f"native subspace kernel failed ({rc}) for head_dim {d}")
    return out


@functools.lru_cache(maxsize=64)
def _layout(bounds: tuple, bits: tuple, row_bytes: int) -> torch.Tensor:
    """int32 `[subspaces * 4]`: each subspace's first direction, last + 1, bits and first byte in a token's row."""
    meta, byte = [], 0
    for (lo, hi), width in zip(bounds, bits):
        meta += [lo, hi, width, byte]
        byte += packed_length(hi - lo, width)
    if byte != row_bytes:
        raise RuntimeError(f"subspace codes of {row_bytes} bytes a token, the layout says {byte}")
    return torch.tensor(meta, dtype=torch.int32)


@functools.lru_cache(maxsize=64)
def value_levels(bits: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value subspace (float32 CPU `[subspaces]`): the step of its width and its middle code; a coefficient is
    `(code - middle) * scale * step`."""
    return (torch.tensor([gaussian_step(width) for width in bits]),
            torch.tensor([2**width // 2 - 0.5 for width in bits]))


# float32 weights per basis and rank, by the id of the basis's `basis` tensor with a weak reference to it (dropped when
# the tensor goes: `weakref.finalize`): see `basis_weights`
_weights: dict[int, tuple[weakref.ref, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}


def basis_weights(rows: SubspaceRows) -> tuple[torch.Tensor, torch.Tensor]:
    """The basis times sigma `[H, rank, D]` and the mean `[H, D]`, float32 and contiguous: computed on a basis's first
    use at a rank and kept while the basis lives (a basis is fitted once and never written; every decode step of
    every layer reads its weights). The copies are the kernels' working memory, like the scratch buffers, not bytes
    the cache holds: `held_weight_bytes` says how many."""
    basis = rows.basis
    entry = _weights.get(id(basis.basis))
    if entry is None or entry[0]() is not basis.basis:
        entry = _weights[id(basis.basis)] = (weakref.ref(basis.basis), {})
        weakref.finalize(basis.basis, _weights.pop, id(basis.basis), None)
    held = entry[1].get(rows.rank)
    if held is None:
        w = basis.sigma[:, : rows.rank, None].float() * basis.basis[:, :, : rows.rank].float().transpose(-1, -2)
        held = entry[1][rows.rank] = (w.contiguous(), basis.mean.float().contiguous())
    return held


def held_weight_bytes() -> int:
    """Bytes of the float32 weights `basis_weights` keeps for the bases alive now."""
    return sum(w.nbytes + m.nbytes for _, per_rank in list(_weights.values()) for w, m in per_rank.values())


def serves(q: torch.Tensor, seg: SubspaceSegment) -> bool:
    """Whether `coefficient_partial` has a variant for the shape (the kernel may still be unavailable)."""
    b, h, m, d = q.shape
    k, v = seg.keys, seg.values
    return (q.device.type == "cpu" and d % 2 == 0 and d <= MAX_DIM and m <= MAX_ROWS and k.axis == "channel"
            and v.axis == "token" and k.tokens % k.token_group == 0 and k.rank <= MAX_DIM and v.rank <= MAX_DIM
            and k.scale.dtype == k.zero.dtype == v.scale.dtype == torch.float16)


def coefficient_partial(q: torch.Tensor, seg: SubspaceSegment, key_valid: torch.Tensor | None):
    """The softmax partial of grouped, scaled queries `q` [B, H, M, D] over the segment, its output in the values'
    whitened coefficients: (row max [B, H, M], row sum [B, H, M], `[B, H, M, rank]` = the unnormalized
    probabilities times the coefficients; `from_subspace.subspace_partial` takes it to the model's basis), or None
    where the kernel does not serve (`serves`, the module docstring).

    Args:
        key_valid: `[B, T]` bool (False: the key is masked for every row) or None.
    """
    chunked = launch(q, seg, key_valid)
    return None if chunked is None else _merged(chunked, q.shape[:3])


def step_partial(q: torch.Tensor, seg: SubspaceSegment, key_valid: torch.Tensor | None):
    """`coefficient_partial` as the tiered step's native call takes it: the row max finite (`NEG` where a row sees no
    key, as the C kernels write it), the three float32 and contiguous; one chunk's outputs as the kernel wrote them
    (no merge, no copy). None where the kernel does not serve."""
    chunked = launch(q, seg, key_valid)
    if chunked is None:
        return None
    b, h, m, _ = q.shape
    mx, total, acc = chunked
    if mx.shape[1] == 1:
        return mx.view(b, h, m), total.view(b, h, m), acc.view(b, h, m, acc.shape[-1])
    mx, total, acc = _merged(chunked, (b, h, m))
    return mx.masked_fill(torch.isinf(mx), NEG), total.contiguous(), acc.contiguous()


def _merged(chunked: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: tuple[int, int, int]):
    """`launch`'s chunks merged by their log-sum-exp (a chunk's row that sees no key at -inf): row max and row sum
    `[B, H, M]`, output `[B, H, M, rank]` (`rows`: B, H, M)."""
    mx, total, acc = chunked
    mx = mx.masked_fill_(mx <= 0.5 * NEG, -math.inf)
    state = functools.reduce(combine, [(mx[:, c], total[:, c], acc[:, c]) for c in range(mx.shape[1])])
    return state[0].view(*rows), state[1].view(*rows), state[2].view(*rows, acc.shape[-1])


def launch(q: torch.Tensor, seg: SubspaceSegment, key_valid: torch.Tensor | None):
    """The kernel's call: per token chunk (row max, `NEG` where a chunk's row sees no key; row sum; the unnormalized
    output in the values' coefficients), `[B * H, chunks, M]`, `[B * H, chunks, M]`, `[B * H, chunks, M, rank]`; None
    where the kernel does not serve (`coefficient_partial`'s arguments)."""
    if not serves(q, seg):
        return None
    lib = library()
    if lib is None:
        return None
    b, h, m, d = q.shape
    k, v, t = seg.keys, seg.values, seg.tokens
    threads, chunks = _split(t, b * h, None)
    g = k.token_group
    per = -(-t // chunks // g) * g if t else g  # whole key groups a chunk
    chunks = max(1, -(-t // per))
    w, mean = basis_weights(k)
    cos = sin = None
    if seg.rope is not None:
        cos, sin = _angles(seg.rope, seg.start, t)
    steps, vmid = value_levels(v.bits)
    valid = None if key_valid is None else key_valid.to(torch.uint8).contiguous()
    q, kc, vc = q.float().contiguous(), k.codes.contiguous(), v.codes.contiguous()
    kscale, kzero, vscale = k.scale.contiguous(), k.zero.contiguous(), v.scale.contiguous()  # fp16, read in C
    kmeta, vmeta = (_layout(x.bounds, x.bits, x.codes.shape[-1]) for x in (k, v))
    mx, total = torch.empty(b * h, chunks, m), torch.empty(b * h, chunks, m)
    acc = torch.empty(b * h, chunks, m, v.rank)
    work = scratch("subspace_scores", b * h * chunks * m * per, torch.float32, q.device)
    ptr = lambda x: None if x is None else x.data_ptr()  # noqa: E731
    rc = lib.subspace_partial(
        q.data_ptr(), b * h, h, t, d, m, kc.data_ptr(), kc.shape[-1], kmeta.data_ptr(), len(k.bits), k.rank,
        k.token_group, kscale.data_ptr(), kzero.data_ptr(), w.data_ptr(), mean.data_ptr(), ptr(cos), ptr(sin),
        seg.rope.scaling if seg.rope is not None else 1.0, vc.data_ptr(), vc.shape[-1], vmeta.data_ptr(),
        len(v.bits), v.rank, vscale.data_ptr(), steps.data_ptr(), vmid.data_ptr(), ptr(valid), chunks, per, mx.data_ptr(),
        total.data_ptr(), acc.data_ptr(), work.data_ptr(), threads)
    if rc:
        raise RuntimeError(f"native subspace kernel failed ({rc}) for head_dim {d}, {m} rows")
    return mx, total, acc
