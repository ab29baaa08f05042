"""One decode step's attention on CUDA in few launches: the quantized segments' Triton kernels leave their per-split
partials unmerged, and one kernel here merges them, brings the values back from their rotation, attends the
full-precision pieces (tail, sinks, the new token) and writes the normalized output in the model's dtype.

The general path (`decode_attention`) merges partials with about ten torch operations each and copies every
full-precision piece into a float32 buffer: at one query position that is some fifty launches a layer, whose host
time exceeds the kernels' own at every length measured on an H200 (docs/gpu/README.md). This path serves the common
case, a one-position step with no attention mask and no mass asked for, and says None for anything else, which
then takes the general path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .native_step import value_rotation_matrix
from .triton_decode import _online_step, interpreting

MAX_SETS = 2  # partial sets (quantized segments) one launch merges
MAX_PIECES = 3  # full-precision pieces one launch attends
BLOCK_N = 32  # full-precision tokens per tile
MAX_ROTATED_DIM = 128  # R^T of a wider head does not fit a program's shared memory: those steps take the general path


@triton.jit
def _merge_set(m_i, l_i, acc, m_ptr, l_ptr, a_ptr, n_split, bh, s_bh, s_sp, a_bh, a_sp, a_row, rows, cols,
               ROW_STRIDE: tl.constexpr):
    """Merge the `n_split` partials (m, l [M_PAD], acc [M_PAD, D]) of one program's rows into the running state."""
    for s in range(0, n_split):
        mp = tl.load(m_ptr + bh * s_bh + s * s_sp + rows * ROW_STRIDE)
        lp = tl.load(l_ptr + bh * s_bh + s * s_sp + rows * ROW_STRIDE)
        ap = tl.load(a_ptr + bh * a_bh + s * a_sp + rows[:, None] * a_row + cols[None, :])
        m_new = tl.maximum(m_i, mp)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        beta = tl.exp(mp - m_safe)
        l_i = l_i * alpha + lp * beta
        acc = acc * alpha[:, None] + ap * beta[:, None]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_piece(m_i, l_i, acc, q, k_ptr, v_ptr, n, b, h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, cols,
                  BLOCK: tl.constexpr, DOT_F32: tl.constexpr):
    """Online softmax of the rows `q` [M_PAD, D] over `n` full-precision tokens of KV head (b, h); `DOT_F32`: IEEE
    fp32 dots, else operands in the pieces' own dtype (fp16 / bf16, as SDPA takes them) with fp32 accumulation."""
    kb = k_ptr + b * sk_b + h * sk_h
    vb = v_ptr + b * sv_b + h * sv_h
    for t0 in range(0, n, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tmask = t < n
        k = tl.load(kb + t[:, None] * sk_t + cols[None, :], mask=tmask[:, None], other=0.0)
        v = tl.load(vb + t[:, None] * sv_t + cols[None, :], mask=tmask[:, None], other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            v = v.to(tl.float32)
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, v, tmask, DOT_F32, True)
    return m_i, l_i, acc


@triton.jit
def _step_kernel(
    q_ptr, out_ptr, rot_ptr,
    m0, l0, a0, n0, s0_bh, s0_sp, a0_bh, a0_sp, a0_row,
    m1, l1, a1, n1, s1_bh, s1_sp, a1_bh, a1_sp, a1_row,
    k0, v0, t0, k0_b, k0_h, k0_t, v0_b, v0_h, v0_t,
    k1, v1, t1, k1_b, k1_h, k1_t, v1_b, v1_h, v1_t,
    k2, v2, t2, k2_b, k2_h, k2_t, v2_b, v2_h, v2_t,
    kv_heads, n_rows,
    SETS: tl.constexpr, ROW0: tl.constexpr, ROW1: tl.constexpr, HAS_ROT: tl.constexpr, PIECES: tl.constexpr,
    M_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, DOT_F32: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // kv_heads
    h = bh % kv_heads
    rows = tl.arange(0, M_PAD)
    cols = tl.arange(0, D)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    if SETS > 0:
        m_i, l_i, acc = _merge_set(m_i, l_i, acc, m0, l0, a0, n0, bh, s0_bh, s0_sp, a0_bh, a0_sp, a0_row, rows, cols,
                                   ROW0)
    if SETS > 1:
        m_i, l_i, acc = _merge_set(m_i, l_i, acc, m1, l1, a1, n1, bh, s1_bh, s1_sp, a1_bh, a1_sp, a1_row, rows, cols,
                                   ROW1)
    if HAS_ROT:  # the quantized values were stored as v @ R: their output comes back by R^T (`rot` holds R,
        # row-major, read transposed), applied to the normalized output (bounded by the values' range), on tf32
        # operands unless DOT_F32
        rot = tl.load(rot_ptr + cols[None, :] * D + cols[:, None])
        l_safe = tl.maximum(l_i, 1e-30)
        if DOT_F32:
            acc = tl.dot(acc / l_safe[:, None], rot, input_precision="ieee") * l_safe[:, None]
        else:
            acc = tl.dot(acc / l_safe[:, None], rot, input_precision="tf32") * l_safe[:, None]
    q = tl.load(q_ptr + bh * n_rows * D + rows[:, None] * D + cols[None, :], mask=(rows < n_rows)[:, None], other=0.0)
    if PIECES > 0:
        m_i, l_i, acc = _attend_piece(m_i, l_i, acc, q, k0, v0, t0, b, h, k0_b, k0_h, k0_t, v0_b, v0_h, v0_t, cols,
                                      BLOCK, DOT_F32)
    if PIECES > 1:
        m_i, l_i, acc = _attend_piece(m_i, l_i, acc, q, k1, v1, t1, b, h, k1_b, k1_h, k1_t, v1_b, v1_h, v1_t, cols,
                                      BLOCK, DOT_F32)
    if PIECES > 2:
        m_i, l_i, acc = _attend_piece(m_i, l_i, acc, q, k2, v2, t2, b, h, k2_b, k2_h, k2_t, v2_b, v2_h, v2_t, cols,
                                      BLOCK, DOT_F32)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + bh * n_rows * D + rows[:, None] * D + cols[None, :], out, mask=(rows < n_rows)[:, None])


def step_attention(q: torch.Tensor, partial_sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                   pieces: list[tuple[torch.Tensor, torch.Tensor]], v_rotation, out_dtype: torch.dtype) -> torch.Tensor:
    """The normalized attention output of `q` over the quantized segments' unmerged partials and the full-precision
    pieces, in one launch.

    Args:
        q: `[B, Hkv, M, D]` float32 queries, already scaled (the partials' rows, M <= 128).
        partial_sets: up to `MAX_SETS` of (m, l `[B*Hkv, S, M_PAD]`, acc `[B*Hkv, S, M_PAD, D]`) float32 views
            with unit stride along D, all in the basis of `v_rotation`.
        pieces: up to `MAX_PIECES` full-precision (keys, values) `[B, Hkv, N, D]` (any float dtype, unit stride along
            D), every token visible to every row.
        v_rotation: None, or the rotation the quantized values were stored in (a `HadamardRotation` or a matrix R;
            read as `native_step.value_rotation_matrix` gives it, shared with the CPU step).
        out_dtype: the output's dtype.
    Returns:
        `[B, Hkv, M, D]` in `out_dtype`.
    """
    b, h, m, d = q.shape
    if len(partial_sets) > MAX_SETS or len(pieces) > MAX_PIECES:
        raise ValueError(f"step_attention takes at most {MAX_SETS} partial sets and {MAX_PIECES} pieces")
    m_pad = max(16, triton.next_power_of_2(m))
    q = q.float().contiguous()
    out = torch.empty(b, h, m, d, device=q.device, dtype=out_dtype)
    sets = []
    for mm, ll, aa in partial_sets:
        if mm.shape[-1] != m_pad or aa.stride(-1) != 1 or mm.stride() != ll.stride():
            raise ValueError("partials must be [B*Hkv, S, M_PAD] (m, l with equal strides) and acc with unit stride")
        sets += [mm, ll, aa, mm.shape[1], mm.stride(0), mm.stride(1), aa.stride(0), aa.stride(1), aa.stride(2)]
    row_strides = [mm.stride(2) for mm, _, _ in partial_sets]
    sets += [q, q, q, 0, 0, 0, 0, 0, 0] * (MAX_SETS - len(partial_sets))
    row_strides += [1] * (MAX_SETS - len(partial_sets))
    args = []
    for k, v in pieces:
        if k.shape[-1] != d or k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("full-precision pieces must be [B, Hkv, N, D] with unit stride along D")
        kb, vb = (k.stride(0) if k.shape[0] > 1 else 0), (v.stride(0) if v.shape[0] > 1 else 0)
        args += [k, v, k.shape[2], kb, k.stride(1), k.stride(2), vb, v.stride(1), v.stride(2)]
    args += [q, q, 0, 0, 0, 0, 0, 0, 0] * (MAX_PIECES - len(pieces))
    if v_rotation is not None and partial_sets and d > MAX_ROTATED_DIM:
        raise ValueError(f"step_attention rotates values of head dims up to {MAX_ROTATED_DIM}; this one is {d}")
    rot = q
    if v_rotation is not None and partial_sets:
        matrix = value_rotation_matrix(v_rotation, d)
        if matrix is None:
            raise ValueError(f"step_attention takes a [{d}, {d}] rotation or a Hadamard transform of size {d}")
        rot = matrix[0]
    dot_f32 = interpreting() or any(k.dtype == torch.float32 for k, _ in pieces) or not pieces
    _step_kernel[(b * h,)](
        q, out, rot, *sets, *args, h, m,
        SETS=len(partial_sets), ROW0=row_strides[0], ROW1=row_strides[1],
        HAS_ROT=v_rotation is not None and bool(partial_sets), PIECES=len(pieces), M_PAD=m_pad, D=d, BLOCK=BLOCK_N,
        DOT_F32=dot_f32, num_warps=4,
    )
    return out
