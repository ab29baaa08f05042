"""Attention computed from a `QuantSegment`'s codes, its scales and zeros folded into the query and the probabilities
(the CPU path of the fused decode attention).

Keys are quantized per channel in groups of `k_group` tokens: k[t, d] = c[t, d] * s[g, d] + z[g, d], so

    q . k[t] = (q * s[g]) . c[t] + q . z[g]

and the scores of a group are one small matmul of its integer codes (as float) with the scaled query, plus one number
per group and query row. Values are quantized per token in groups of `v_group` channels: v[t, d] = c[t, d] *
s[t, j] + z[t, j] (j = d // v_group), so

    sum_t p[t] v[t, d] = sum_t (p[t] s[t, j]) c[t, d] + sum_t p[t] z[t, j]

is one matmul of the probabilities times the value scales with the codes, plus one matmul with the zeros. No
dequantized key or value is ever written: per block the codes are unpacked once into float scratch (`unpack_lanes`,
whose lane factors, exact powers of two, fold into the key scales and into the output channels), and every other pass
is over `rows x tokens` or `groups x channels`, which are small next to `tokens x channels`. A block is `block`
tokens (a multiple of the key group), so the scratch is O(block) whatever the cache length.
"""

from __future__ import annotations

from typing import Callable

import torch

from hf_kvcache.quant.packing import lane_factors, unpack_lanes

from .blockwise import NEG_INF, combine, scratch
from .segments import QuantSegment


def _codes(packed: torch.Tensor, bits: int, dim: int, name: str) -> tuple[torch.Tensor, bool]:
    """Float codes `[B, H, T, dim]` of `packed` in this thread's scratch `name`, and the lane-factor flag."""
    b, h, t, _ = packed.shape
    out = scratch(name, b * h * t * dim, torch.float32, packed.device).view(b, h, t, dim)
    return unpack_lanes(packed, bits, dim, out, work=scratch("lanes", packed.numel() * 8 // bits, torch.uint8, packed.device))


def block_scores(q: torch.Tensor, seg: QuantSegment) -> torch.Tensor:
    """Scores `[B, H, M, T]` of grouped, scaled queries `q` [B, H, M, D] (in the segment's key basis) against the
    segment's keys, from their codes."""
    codes, shifted = _codes(seg.k_codes, seg.k_bits, q.shape[-1], "codes_k")
    scale = seg.k_scale.float()  # [B, H, G, D]
    if shifted:
        scale = scale * lane_factors(seg.k_bits, q.shape[-1], q.device)
    return scores_of_codes(q, codes, scale, seg.k_zero.float(), seg.k_group)


def scores_of_codes(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group: int) -> torch.Tensor:
    """Scores `[B, H, M, T]` of `q` [B, H, M, D] against keys `codes * scale + zero` quantized per channel in groups
    of `group` tokens (`codes` float `[B, H, T, D]`, `scale` and `zero` float `[B, H, T // group, D]`): one small
    matmul per key group with the query times the group's scales, plus the query times the group's zeros."""
    b, h, m, d = q.shape
    t = codes.shape[2]
    qs = q.unsqueeze(2) * scale.unsqueeze(3)  # [B, H, G, M, D]
    bias = torch.matmul(zero, q.transpose(-1, -2))  # [B, H, G, M]
    s = torch.baddbmm(bias.view(-1, m, 1), qs.view(-1, m, d), codes.view(-1, group, d).transpose(1, 2))
    return s.view(b, h, -1, m, group).transpose(2, 3).reshape(b, h, m, t)


def block_values(p: torch.Tensor, seg: QuantSegment) -> torch.Tensor:
    """`p` [B, H, M, T] (unnormalized probabilities) times the segment's values, from their codes: [B, H, M, D]."""
    d, vg = seg.head_dim, seg.v_group
    codes, shifted = _codes(seg.v_codes, seg.v_bits, d, "codes_v")
    factors = lane_factors(seg.v_bits, d, p.device) if shifted else None
    bounds = [(j * vg, (j + 1) * vg) for j in range(d // vg)]
    return values_of_codes(p, codes, seg.v_scale.float(), seg.v_zero.float(), bounds, factors)


def values_of_codes(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    bounds: list[tuple[int, int]], factors: torch.Tensor | None = None) -> torch.Tensor:
    """`p` [B, H, M, T] times values `codes * scale + zero` quantized per token in groups of channels (`codes` float
    `[B, H, T, D]` times `factors` [D] when given; group `j` is channels `bounds[j]`, its scale and zero float
    `[B, H, T, j]`): one matmul per group with the probabilities times its scales, plus one with the zeros.
    Returns `[B, H, M, D]`."""
    b, h, m, t = p.shape
    out = torch.empty(b, h, m, codes.shape[-1], dtype=p.dtype, device=p.device)
    scale = scale.transpose(-1, -2)  # [B, H, J, T]
    for j, (lo, hi) in enumerate(bounds):  # one matmul per value group (one in all when a group spans the head)
        torch.matmul(p * scale[..., j : j + 1, :], codes[..., lo:hi], out=out[..., lo:hi])
    if factors is not None:
        out.mul_(factors)
    zeros = torch.matmul(p, zero)  # [B, H, M, J]
    sizes = {hi - lo for lo, hi in bounds}
    if len(sizes) == 1:
        return out.add_(zeros.repeat_interleave(sizes.pop(), -1))
    widths = torch.tensor([hi - lo for lo, hi in bounds], device=p.device)
    return out.add_(zeros.repeat_interleave(widths, -1))


# a block's largest float32 buffers (the unpacked codes [B, H, block, D], the scores and the scaled queries, both of
# [B, H, block, M] elements for a key group of D tokens) hold at most BLOCK_ELEMENTS elements each (8 MiB)
BLOCK_ELEMENTS = 1 << 21


def blocks(seg: QuantSegment, rows: int, block: int | None):
    """(start, stop, the segment's slice) of at most `block` tokens each (None: as many as keep every buffer within
    `BLOCK_ELEMENTS` for `rows` query rows), multiples of the key group."""
    if block is None:
        b, h = seg.k_codes.shape[:2]
        block = BLOCK_ELEMENTS // (b * h * max(seg.head_dim, rows * max(1, seg.head_dim // seg.k_group)))
    step = max(seg.k_group, block - block % seg.k_group)
    for start in range(0, seg.tokens, step):
        stop = min(start + step, seg.tokens)
        yield start, stop, seg if (start, stop) == (0, seg.tokens) else seg.slice(start, stop)


def _masked(s: torch.Tensor, mask: torch.Tensor | None, start: int, stop: int) -> torch.Tensor:
    """Scores [B, H, M, n] of tokens [start, stop) with -inf where `mask` ([B|1, 1, M|1, T] boolean, True = attend)
    is False."""
    if mask is not None:
        m = mask[..., start:stop]
        if not bool(m.all()):
            s.masked_fill_(~m, NEG_INF)
    return s


def quant_partial_codes(q: torch.Tensor, seg: QuantSegment, mask: torch.Tensor | None, block: int | None = None):
    """Softmax partial (row max, row sum, unnormalized output; see `blockwise.combine`) of grouped, scaled queries
    `q` [B, H, M, D] (in the segment's key basis) over the segment, from its codes; the output is in the segment's
    value basis. `mask`: [B|1, 1, M|1, T] boolean (True = attend) or None."""
    return blockwise_partial(q, seg, mask, block, block_scores, block_values)


def quant_mass_codes(q: torch.Tensor, seg: QuantSegment, mask: torch.Tensor | None, lse: torch.Tensor,
                     block: int | None = None) -> torch.Tensor:
    """Attention probability of each key of the segment (`lse` [B, H, M]: the rows' log-sum-exp over all keys),
    summed over the rows: [B, H, T]."""
    return blockwise_mass(q, seg, mask, lse, block, block_scores)


def blockwise_partial(q: torch.Tensor, seg, mask: torch.Tensor | None, block: int | None,
                      scores: Callable, values: Callable):
    """The softmax partial of `q` over `seg`, block by block (`blocks`): `scores(q, part)` `[B, H, M, n]` and
    `values(p, part)` (the unnormalized probabilities times the part's values), merged by log-sum-exp."""
    state = None
    for start, stop, part in blocks(seg, q.shape[2], block):
        s = _masked(scores(q, part), mask, start, stop)
        mx = s.amax(-1)
        m_safe = torch.where(torch.isinf(mx), 0.0, mx)
        p = s.sub_(m_safe.unsqueeze(-1)).exp_()
        res = (mx, p.sum(-1), values(p, part))
        state = res if state is None else combine(state, res)
    return state


def blockwise_mass(q: torch.Tensor, seg, mask: torch.Tensor | None, lse: torch.Tensor, block: int | None,
                   scores: Callable) -> torch.Tensor:
    """The attention probability of each key of `seg`, block by block (`scores(q, part)`), summed over the rows."""
    cols = []
    for start, stop, part in blocks(seg, q.shape[2], block):
        s = _masked(scores(q, part), mask, start, stop)
        cols.append(s.sub_(lse.unsqueeze(-1)).exp_().sum(2))
    return torch.cat(cols, -1)
