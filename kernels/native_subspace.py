"""Scores against a subspace archive's pre-RoPE keys on the CPU in one C call (`native_subspace.c`): each key rebuilt
from its coefficients, turned by RoPE and dotted with the query rows while it sits in L1 (the torch path of
`from_subspace` writes and rereads every rebuilt and turned key). Built like the decode kernel
(`native.compile_library`, -O3 -march=native -ffast-math -fopenmp); the angles' cos and sin come from torch
(`KeyRotation.cos_sin_at`), so RoPE is the torch path's. Unavailable (None from `prerope_scores`) where no compiler
works, off the CPU, with `HF_KVCACHE_NATIVE=0` or inside `native.turned_off()`; callers then keep the torch path.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from hf_kvcache.rope import KeyRotation

from .native import FLAGS, _Build, compile_library, enabled

SOURCE = Path(__file__).with_name("native_subspace.c")
MAX_DIM = 256

_build = _Build()
_last_angles = threading.local()  # (rope, start, tokens, cos, sin): the layers of one decode step share them


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (after one warning) where it cannot be built or is off."""
    if not enabled():
        return None
    return _build.load(_compile, "the native CPU subspace kernel (the fused attention uses its torch path)")


def _compile() -> ctypes.CDLL:
    lib = compile_library(SOURCE, FLAGS)
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.subspace_rope_scores.restype = i
    lib.subspace_rope_scores.argtypes = [p, p, p, p, p, p, p, i, i, i, i, i, i, ctypes.c_float, i]
    return lib


def _angles(rope: KeyRotation, start: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[tokens, D / 2]` of positions `start..`; the last table is reused while the same RoPE asks for the
    same positions (the layers of one decode step)."""
    last = getattr(_last_angles, "value", None)
    if last is not None and last[0] is rope and last[1:3] == (start, tokens):
        return last[3], last[4]
    positions = torch.arange(start, start + tokens, dtype=torch.float32)
    cos, sin = (t.contiguous() for t in rope.cos_sin_at(positions))
    _last_angles.value = (rope, start, tokens, cos, sin)
    return cos, sin


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
