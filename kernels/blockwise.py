"""The torch path of the fused decode attention over a `QuantSegment` (CPU, or any device without Triton).

Tokens are read `block` at a time: the codes of a block are unpacked into reusable scratch buffers, dequantized in
place, and folded into an online-softmax partial, so the extra memory is O(block) whatever the cache length, and no
large tensor is allocated per step (fresh multi-megabyte allocations cost page faults on every decode step, which on
CPU took longer than the attention itself).
"""

from __future__ import annotations

import threading

import torch

from .segments import QuantSegment
from hf_kvcache.quant.rotation import rotate, unrotate

NEG_INF = float("-inf")


class _Scratch(threading.local):
    """Per-thread scratch buffers, grown on demand and reused across calls (`scratch_bytes` says how much is held)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        buf = self.buffers.get((name, device))
        if buf is None or buf.numel() < nbytes:  # grown with headroom, so a cache growing by a group rarely reallocates
            buf = torch.empty(nbytes + nbytes // 4 + 64, dtype=torch.uint8, device=device)
            self.buffers[(name, device)] = buf
        return buf[:nbytes].view(dtype)


_SCRATCH = _Scratch()


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D scratch tensor of this thread (valid until the next request of the same name)."""
    return _SCRATCH.get(name, numel, dtype, device)


def scratch_bytes() -> int:
    """Bytes held by this thread's scratch buffers."""
    return sum(b.numel() for b in _SCRATCH.buffers.values())


def dequantize_block(seg: QuantSegment, start: int, stop: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 keys and values of tokens [start, stop) (in the stored basis): written into `out` (two
    `[B, H, stop - start, D]` views, e.g. rows of a bigger buffer) or into scratch buffers valid until the next call.
    `start` is a multiple of the segment's key group."""
    if out is None:
        b, h, d = *seg.k_codes.shape[:2], seg.head_dim
        n = b * h * (stop - start) * d
        out = tuple(_SCRATCH.get(name, n, torch.float32, seg.k_codes.device).view(b, h, stop - start, d)
                    for name in ("k", "v"))
    return seg.slice(start, stop).dequantize(out=out)


def _steps(seg: QuantSegment, block: int):
    step = max(seg.k_group, block - block % seg.k_group)
    for start in range(0, seg.tokens, step):
        yield start, min(start + step, seg.tokens)


# torch's CPU flash attention returns the log-sum-exp beside the output: one call gives a mergeable partial
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def dense_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_mask: torch.Tensor | None):
    """Softmax partial (row max, row sum, unnormalized output) of already-scaled `q` [B, H, M, D] over float32 `k`,
    `v` [B, H, n, D]; `row_mask` [B|1, 1|H, M, n] boolean (True = attend) or None. A fully masked row gives
    (-inf, 0, 0)."""
    if _FLASH_CPU is not None and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32:
        bias = None
        if row_mask is not None:
            bias = torch.zeros(row_mask.shape, dtype=q.dtype).masked_fill_(~row_mask, NEG_INF)
        out, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=bias, scale=1.0)
        if row_mask is not None:  # the kernel reports 0 for a row with no key: make it an empty partial
            lse = lse.masked_fill(~row_mask.any(-1), NEG_INF)
        return lse, torch.ones_like(lse), out
    s = torch.matmul(q, k.transpose(-1, -2))
    if row_mask is not None:
        s.masked_fill_(~row_mask, NEG_INF)
    m = s.amax(-1)
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    p = s.sub_(m_safe.unsqueeze(-1)).exp_()
    return m, p.sum(-1), torch.matmul(p, v)


def rows_mask(mask: torch.Tensor | None, group: int) -> torch.Tensor | None:
    """Column mask [B|1, 1, L, T] -> [B|1, 1, group * L, T], matching the grouped query rows."""
    return None if mask is None else mask.repeat(1, 1, group, 1)


def finish(state) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax partial -> (normalized output, log-sum-exp of each row)."""
    m, l, acc = state
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    l = l.clamp_min(1e-30)
    return acc / l.unsqueeze(-1), m_safe + torch.log(l)


def combine(a, b):
    """Two softmax partials over disjoint keys -> one."""
    m = torch.maximum(a[0], b[0])
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    wa, wb = torch.exp(a[0] - m_safe), torch.exp(b[0] - m_safe)
    return m, a[1] * wa + b[1] * wb, a[2] * wa.unsqueeze(-1) + b[2] * wb.unsqueeze(-1)


def _patch(k: torch.Tensor, v: torch.Tensor, patches: list[tuple] | None, start: int, stop: int) -> None:
    """Write each (offset, keys, values) patch's part inside tokens [start, stop) over the block `k`, `v`."""
    for offset, pk, pv in patches or ():
        lo, hi = max(start, offset), min(stop, offset + pk.shape[2])
        if lo < hi:
            k[:, :, lo - start : hi - start] = pk[:, :, lo - offset : hi - offset]
            v[:, :, lo - start : hi - start] = pv[:, :, lo - offset : hi - offset]


def quant_partial_blockwise(q: torch.Tensor, seg: QuantSegment, key_valid: torch.Tensor | None, block: int = 1024,
                            patches: list[tuple] | None = None):
    """Softmax partial of grouped, scaled queries `q` [B, H, M, D] over the segment; `key_valid` [B, T] (True =
    attend) or None; `patches`: (offset, keys, values) written over the dequantized tokens (full-precision sinks)."""
    state = None
    for start, stop in _steps(seg, block):
        k, v = dequantize_block(seg, start, stop)
        _patch(k, v, patches, start, stop)
        valid = None if key_valid is None else key_valid[:, start:stop]
        row_mask = None if valid is None or bool(valid.all()) else valid[:, None, None, :]
        part = dense_partial(q, k, v, row_mask)
        state = part if state is None else combine(state, part)
    return state


def quant_mass_blockwise(q: torch.Tensor, seg: QuantSegment, key_valid: torch.Tensor | None, lse: torch.Tensor,
                         block: int = 1024, patches: list[tuple] | None = None) -> torch.Tensor:
    """Attention probability of each key of the segment, summed over the rows: [B, H, T]."""
    cols = []
    for start, stop in _steps(seg, block):
        k, v = dequantize_block(seg, start, stop)
        _patch(k, v, patches, start, stop)
        s = torch.matmul(q, k.transpose(-1, -2))
        if key_valid is not None:
            s.masked_fill_(~key_valid[:, None, None, start:stop], NEG_INF)
        cols.append(s.sub_(lse.unsqueeze(-1)).exp_().sum(2))
    return torch.cat(cols, -1)


def packed_attention(q: torch.Tensor, segments: list, overlays: list, column_mask, group: int, block: int = 2048):
    """Attention of grouped, scaled queries `q` [B, H, M, D] over every segment at once: their rows are written, in
    key order and in one common basis, into a scratch buffer of at most `block` rows (up to 25 % more when that
    avoids a second pass), quantized segments dequantized straight into it, overlays written over the rows they
    replace; each full buffer is one flash-attention call, and the calls are merged by their log-sum-exp.

    `column_mask(start, stop)` gives the boolean [B|1, 1, L, stop - start] mask of key columns (or None). Returns the
    output [B, H, M, D] in the model's basis, or None when the quantized segments do not share one rotation (then
    the caller attends segment by segment)."""
    quant = [s for s in segments if isinstance(s, QuantSegment)]
    rk = quant[0].k_rotation if quant else None
    rv = quant[0].v_rotation if quant else None
    if any(s.k_rotation is not rk or s.v_rotation is not rv for s in quant):
        return None
    b, h, _, d = q.shape
    total = sum(s.tokens for s in segments)
    cap = total if total <= block + block // 4 else block
    keys = _SCRATCH.get("rows_k", b * h * cap * d, torch.float32, q.device).view(b, h, cap, d)
    values = _SCRATCH.get("rows_v", b * h * cap * d, torch.float32, q.device).view(b, h, cap, d)
    q = q if rk is None else rotate(q.float(), rk)
    state, fill, first = None, 0, 0  # rows filled; position of row 0

    def put(rows_k: torch.Tensor, rows_v: torch.Tensor, at: int) -> None:
        n = rows_k.shape[2]
        rows_k, rows_v = rows_k.float(), rows_v.float()
        keys[:, :, at : at + n] = rows_k if rk is None else rotate(rows_k, rk)
        values[:, :, at : at + n] = rows_v if rv is None else rotate(rows_v, rv)

    def flush() -> None:
        nonlocal state, fill, first
        for o in overlays:
            lo, hi = max(first, o.overlay_at), min(first + fill, o.overlay_at + o.tokens)
            if lo < hi:
                put(o.keys[:, :, lo - o.overlay_at : hi - o.overlay_at],
                    o.values[:, :, lo - o.overlay_at : hi - o.overlay_at], lo - first)
        cmask = column_mask(first, first + fill)
        row_mask = rows_mask(cmask, group)
        part = dense_partial(q, keys[:, :, :fill], values[:, :, :fill], row_mask)
        state = part if state is None else combine(state, part)
        first, fill = first + fill, 0

    for seg in segments:
        s0 = 0
        while s0 < seg.tokens:
            room = cap - fill
            if isinstance(seg, QuantSegment):
                n = min(seg.tokens - s0, room - room % seg.k_group)
                if n:
                    dequantize_block(seg, s0, s0 + n, out=(keys[:, :, fill : fill + n], values[:, :, fill : fill + n]))
            else:
                n = min(seg.tokens - s0, room)
                if n:
                    put(seg.keys[:, :, s0 : s0 + n], seg.values[:, :, s0 : s0 + n], fill)
            if n == 0:
                flush()
            fill, s0 = fill + n, s0 + n
    if fill:
        flush()
    out, _ = finish(state)
    return out if rv is None else unrotate(out, rv)
