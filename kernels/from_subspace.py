"""Attention over a `SubspaceSegment` (an archive coded in fitted bases) from its codes: the torch path of the fused
decode attention for the subspace archive.

Per KV head the keys are `k = (z_k * sigma_k) @ B_k^T + mean_k` and the values `v = (z_v * sigma_v) @ B_v^T +
mean_v`, with `z` the quantized whitened coefficients (`quant.subspace`). Values fold for any key layout: the
probabilities weight the coefficients, and the basis comes out once a step,

    sum_t p[t] v[t] = ((sum_t p[t] z_v[t]) * sigma_v) @ B_v^T + (sum_t p[t]) mean_v,

so a token costs `rank` multiply-adds, not `head_dim x rank`. Keys coded as the model hands them over fold the query
into the basis once a step, `q . k[t] = ((q @ B_k) * sigma_k) . z_k[t] + q . mean_k`, and each subspace of directions
(its own width, per-direction scales over token groups) is scored from its codes like a KIVI key group
(`from_codes.channel_scores`). Pre-RoPE keys cannot fold (RoPE turns each position by its own angle between the basis
and the query): they are rebuilt block by block, RoPE put back, and dotted. Blocks of tokens as in `from_codes`.
"""

from __future__ import annotations

import torch

from hf_kvcache.quant.kivi import KIVIQuantized
from hf_kvcache.quant.subspace import SubspaceRows, dequantize_subspace_rows, gaussian_step

from .blockwise import combine
from .from_codes import _masked, blocks, channel_scores, token_values
from .segments import SubspaceSegment


def subspace_scores(q: torch.Tensor, seg: SubspaceSegment) -> torch.Tensor:
    """Scores `[B, H, M, T]` of grouped, scaled queries `q` [B, H, M, D] against the segment's keys."""
    if seg.rope is not None:
        keys = seg.rope.rotate(dequantize_subspace_rows(seg.keys), seg.start)
        return torch.matmul(q, keys.transpose(-1, -2))
    k, basis = seg.keys, seg.keys.basis
    folded = torch.matmul(q, basis.basis[:, :, : k.rank].float()) * basis.sigma[:, None, : k.rank].float()
    s = torch.matmul(q, basis.mean.float().unsqueeze(-1))  # [B, H, M, 1]: q . mean, the same for every token
    parts = k.split()
    for i, ((lo, hi), bits) in enumerate(zip(parts.bounds, parts.bits)):
        sub = KIVIQuantized(parts.codes[i], parts.scale[i], parts.zero[i], bits, k.token_group, "channel", hi - lo)
        s = s + channel_scores(folded[..., lo:hi].contiguous(), sub)
    return s


def subspace_coefficients(p: torch.Tensor, values: SubspaceRows) -> torch.Tensor:
    """`p` [B, H, M, T] (unnormalized probabilities) times the values' quantized coefficients: `[B, H, M, rank]`
    (whitened: multiply by sigma and the basis to get values). Each subspace is per-token codes with one scale, read
    as a KIVI value group (scale `s * step`, zero `-(levels / 2 - 1/2) * s * step`)."""
    parts, out = values.split(), []
    for i, ((lo, hi), bits) in enumerate(zip(parts.bounds, parts.bits)):
        step = parts.scale[i].float() * gaussian_step(bits)  # [B, H, T, 1]
        zero = step * -(2 ** bits // 2 - 0.5)
        out.append(token_values(p, KIVIQuantized(parts.codes[i], step, zero, bits, hi - lo, "token", hi - lo)))
    return torch.cat(out, -1)


def subspace_partial(q: torch.Tensor, seg: SubspaceSegment, mask: torch.Tensor | None, block: int | None = None):
    """Softmax partial (row max, row sum, unnormalized output `[B, H, M, D]` in the model's basis) of grouped, scaled
    queries `q` [B, H, M, D] over the segment. `mask`: [B|1, 1, M|1, T] boolean (True = attend) or None."""
    state = None
    for start, stop, part in blocks(seg, q.shape[2], block):
        s = _masked(subspace_scores(q, part), mask, start, stop)
        mx = s.amax(-1)
        m_safe = torch.where(torch.isinf(mx), 0.0, mx)
        p = s.sub_(m_safe.unsqueeze(-1)).exp_()
        res = (mx, p.sum(-1), subspace_coefficients(p, part.values))
        state = res if state is None else combine(state, res)
    m, l, coeff = state
    v = seg.values
    basis = v.basis.basis[:, :, : v.rank].float()  # [H, D, r]
    acc = torch.matmul(coeff * v.basis.sigma[:, None, : v.rank].float(), basis.transpose(-1, -2))
    return m, l, acc + l.unsqueeze(-1) * v.basis.mean.float()[:, None]


def subspace_mass(q: torch.Tensor, seg: SubspaceSegment, mask: torch.Tensor | None, lse: torch.Tensor,
                  block: int | None = None) -> torch.Tensor:
    """Attention probability of each key of the segment (`lse` [B, H, M]: the rows' log-sum-exp over all keys),
    summed over the rows: [B, H, T]."""
    cols = []
    for start, stop, part in blocks(seg, q.shape[2], block):
        s = _masked(subspace_scores(q, part), mask, start, stop)
        cols.append(s.sub_(lse.unsqueeze(-1)).exp_().sum(2))
    return torch.cat(cols, -1)
