"""Softmax partials for the torch path of the fused decode attention (CPU, or any device without Triton): per-thread
scratch buffers, the partial over full-precision keys, and merging partials by their log-sum-exp.

A partial is (row max `m`, row sum `l`, unnormalized output `acc`); partials over disjoint keys merge exactly
(`combine`). Scratch buffers are reused across calls: fresh multi-megabyte allocations cost page faults on every
decode step, which on CPU took longer than the attention itself.
"""

from __future__ import annotations

import threading

import torch


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


class PerRope(threading.local):
    """This thread's values kept per RoPE object (angle tables), emptied before it would hold a fifth: a model has
    one RoPE per layer type, the others are an earlier model's."""

    def __init__(self) -> None:
        self.values: dict[int, tuple] = {}

    def get(self, rope):
        """The value kept for `rope`, or None."""
        held = self.values.get(id(rope))
        return held[1] if held is not None and held[0] is rope else None

    def put(self, rope, value):
        """Keep `value` for `rope`; returns it."""
        if id(rope) not in self.values and len(self.values) >= 4:
            self.values.clear()
        self.values[id(rope)] = (rope, value)
        return value


def position_table(store: PerRope, rope, end: int, build) -> tuple:
    """(n, *tables) of `rope`'s positions `0..n-1` kept in `store`, n a power of two >= `end`: `build(rope, n)` makes
    the tables when none covers `end` yet (the layers of a step and the steps of a decode then share them)."""
    held = store.get(rope)
    if held is None or held[0] < end:
        n = 1 << max(end - 1, 1).bit_length()
        held = store.put(rope, (n, *build(rope, n)))
    return held


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


def normalized(state) -> torch.Tensor:
    """A softmax partial -> its normalized output (a row with no key gives 0)."""
    _, l, acc = state
    return acc / l.clamp_min(1e-30).unsqueeze(-1)


def finish(state) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax partial -> (normalized output, log-sum-exp of each row)."""
    m, l, _ = state
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    return normalized(state), m_safe + torch.log(l.clamp_min(1e-30))


def combine(a, b):
    """Two softmax partials over disjoint keys -> one."""
    m = torch.maximum(a[0], b[0])
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    wa, wb = torch.exp(a[0] - m_safe), torch.exp(b[0] - m_safe)
    return m, a[1] * wa + b[1] * wb, a[2] * wa.unsqueeze(-1) + b[2] * wb.unsqueeze(-1)
