"""A decode step over several quantized segments and the full-precision tokens after them in one native call (the
tiered layer's step: archive and warm tier, each with its own key and value rotations, then the sinks, the tail and
the new token), `segments_step` of `native_decode.c`.

The step's grouped queries are rotated here once per distinct key rotation (a small matmul); everything else -- the
chunks of every segment on the OpenMP threads, their merge, the value rotation of each segment's output back to the
model's basis, the full-precision partial and the final normalization -- runs in C, with no partial, log-sum-exp or
mask tensor built in Python. `step` is the entry point; `decode_attention` calls it where it applies.
"""

from __future__ import annotations

import ctypes

import torch

from . import native
from .blockwise import scratch
from .segments import QuantSegment
from hf_kvcache.quant.rotation import HadamardRotation, Rotation

_p, _i, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class StepSegment(ctypes.Structure):
    """`struct step_segment` of `native_decode.c` (field for field)."""

    _fields_ = [("q", _p), ("T", _i), ("kbits", _i), ("kgroup", _i), ("vbits", _i), ("vgroup", _i),
                ("kc", _p), ("kc_sb", _i64), ("kc_sh", _i64), ("kc_st", _i64), ("ks", _p), ("kz", _p),
                ("vc", _p), ("vc_sb", _i64), ("vc_sh", _i64), ("vc_st", _i64), ("vs", _p), ("vz", _p),
                ("valid", _p), ("vrot", _p), ("vrot_sh", _i64), ("ksh", _p), ("kzh", _p), ("vsh", _p), ("vzh", _p)]


_DENSE_HADAMARD: dict[tuple, torch.Tensor] = {}


def _function():
    """`segments_step` with its argument types, or None where the kernel is unavailable."""
    lib = native.library()
    if lib is None:
        return None
    fn = lib.segments_step
    if fn.argtypes is None:
        fn.restype = _i
        fn.argtypes = [ctypes.POINTER(StepSegment), _i, _i, _i, _i, _i, _p, _p, _p, _i, _p, _i, _i, _p, _p, _p, _p,
                       _p, _p, _p, _p]
    return fn


def value_rotation_matrix(r: Rotation | None, d: int) -> tuple[torch.Tensor | None, int] | None:
    """The value rotation as the kernel reads it: (float32 `[d, d]` row-major R, its head stride 0: every KV head
    shares it), (None, 0) without one, None for a rotation it does not take (`rotation.rotate` takes `[d, d]`
    matrices and Hadamard transforms)."""
    if r is None:
        return None, 0
    if isinstance(r, HadamardRotation):
        key = (r.n, r.seed, r.signs.device)
        m = _DENSE_HADAMARD.get(key)
        if m is None:
            m = _DENSE_HADAMARD[key] = r.matrix().contiguous()  # [n, n], shared like the rotation itself
        return (m, 0) if r.n == d else None
    if r.shape != (d, d):
        return None
    return r.float().contiguous(), 0


def step(q: torch.Tensor, quant: list[tuple[torch.Tensor, QuantSegment, torch.Tensor | None]],
         dense: tuple[torch.Tensor, torch.Tensor] | None, dense_valid: torch.Tensor | None = None,
         chunks: int | None = None, extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
         ) -> torch.Tensor | None:
    """The normalized attention output `[B, H, M, D]` float32 of grouped, scaled queries `q` (the model's basis) over
    the quantized segments `quant` (in key order: each `(q_seg, seg, key_valid)`, `q_seg` the queries times the
    segment's key rotation, `key_valid [B, T]` bool or None) followed by the full-precision keys and values `dense`
    (`[B, H, n, D]` float32 contiguous) or None, of which a row sees those `dense_valid [B, n]` (bool; None: all),
    and `extra`, a softmax partial over other keys computed before (row max, row sum `[B, H, M]`, unnormalized output
    `[B, H, M, D]` in the model's basis: a subspace archive's, `native_subspace.step_partial`), its row max finite as
    the C kernels write it (`native.NEG` where a row sees no key: -ffast-math has no infinities), or None.
    None where the kernel is unavailable or has no variant (the caller then takes the general path)."""
    fn = _function()
    if fn is None or not (quant or extra):
        return None
    b, h, m, d = q.shape
    keep: list[torch.Tensor] = []  # every tensor the call reads stays alive until it returns
    descs = (StepSegment * len(quant))()
    for desc, (q_seg, seg, key_valid) in zip(descs, quant):
        rot = value_rotation_matrix(seg.v_rotation, d)
        if rot is None or not native.supports(q_seg, seg):
            return None
        kc, vc, ks, kz, vs, vz = native.kivi_operands(seg, half_scales=True)
        qs = native.as_float32(q_seg)
        valid = None if key_valid is None else key_valid.to(torch.uint8).contiguous()
        keep += [qs, kc, vc, ks, kz, vs, vz] + [t for t in (valid, rot[0]) if t is not None]
        half = ks.dtype == torch.float16  # `kivi_operands` gives all four in fp16 or all in float32
        desc.q, desc.T, desc.kbits, desc.kgroup = qs.data_ptr(), seg.tokens, seg.k_bits, seg.k_group
        desc.vbits, desc.vgroup = seg.v_bits, seg.v_group
        desc.kc, (desc.kc_sb, desc.kc_sh, desc.kc_st) = kc.data_ptr(), kc.stride()[:3]
        desc.vc, (desc.vc_sb, desc.vc_sh, desc.vc_st) = vc.data_ptr(), vc.stride()[:3]
        scales = (ks.data_ptr(), kz.data_ptr(), vs.data_ptr(), vz.data_ptr())
        desc.ks, desc.kz, desc.vs, desc.vz = (None,) * 4 if half else scales
        desc.ksh, desc.kzh, desc.vsh, desc.vzh = scales if half else (None,) * 4
        desc.valid = None if valid is None else valid.data_ptr()
        desc.vrot, desc.vrot_sh = (None if rot[0] is None else rot[0].data_ptr()), rot[1]
    dk, dv = dense if dense is not None else (None, None)
    nd = 0 if dk is None else dk.shape[2]
    longest = max((seg.tokens for _, seg, _ in quant), default=1)
    threads, chunks = native._split(longest, b * h, chunks)
    slots = len(quant) * chunks + 1
    work = scratch("native_scores", b * h * m * max(longest, nd, 1), torch.float32, torch.device("cpu"))
    rows = b * h * m
    sizes = (rows * slots, rows * slots, rows * slots * d)
    cmx, csum, cacc = scratch("step_partials", sum(sizes), torch.float32, torch.device("cpu")).split(sizes)
    out = torch.empty(b, h, m, d)
    qf = native.as_float32(q)
    dvalid = None if dense_valid is None else dense_valid.expand(b, nd).to(torch.uint8).contiguous()
    xmx = xsum = xacc = None
    if extra is not None:
        xmx, xsum, xacc = (native.as_float32(x) for x in extra)
        keep += [xmx, xsum, xacc]
    ptr = lambda x: None if x is None else x.data_ptr()  # noqa: E731
    rc = fn(descs, len(quant), b, h, m, d, qf.data_ptr(), ptr(dk), ptr(dv), nd, ptr(dvalid), chunks, threads,
            work.data_ptr(), cmx.data_ptr(), csum.data_ptr(), cacc.data_ptr(), ptr(xmx), ptr(xsum), ptr(xacc),
            out.data_ptr())
    return None if rc else out
