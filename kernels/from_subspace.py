"""Attention over a `SubspaceSegment` (an archive coded in fitted bases) from its codes: the torch path of the fused
decode attention for the subspace archive.

Per KV head the keys are `k = (z_k * sigma_k) @ B_k^T + mean_k` and the values `v = (z_v * sigma_v) @ B_v^T +
mean_v`, with `z` the quantized whitened coefficients (`quant.subspace`). Values fold for any key layout: the
probabilities weight the coefficients, and the basis comes out once a step,

    sum_t p[t] v[t] = ((sum_t p[t] z_v[t]) * sigma_v) @ B_v^T + (sum_t p[t]) mean_v,

so a token costs `rank` multiply-adds, not `head_dim x rank`. Keys coded as the model hands them over fold the query
into the basis once a step, `q . k[t] = ((q @ B_k) * sigma_k) . z_k[t] + q . mean_k`, and each subspace of directions
(its own width) is unpacked into one buffer and scored with the per-direction scales like KIVI keys
(`from_codes.scores_of_codes`). Pre-RoPE keys cannot fold (RoPE turns each position by its own angle between the basis
and the query): they are rebuilt block by block, RoPE put back, and dotted (on the CPU in one C call,
`native_subspace.prerope_scores`). Blocks of tokens as in `from_codes`. On the CPU `decode_attention` runs the whole
partial in C instead where it serves (`native_subspace.coefficient_partial`); this path serves the rest.
"""

from __future__ import annotations

import torch

from hf_kvcache.quant.packing import lane_factors, unpack_lanes
from hf_kvcache.quant.subspace import SubspaceRows

from . import native_subspace
from .blockwise import scratch
from .from_codes import blockwise_mass, blockwise_partial, scores_of_codes, values_of_codes
from .segments import SubspaceSegment


def _unpacked(rows: SubspaceRows, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every subspace's codes, each at its own width, as float32 `[B, H, T, rank]` in this thread's scratch `name`,
    and the lane factors `[rank]` to multiply them by (`quant.packing.unpack_lanes`)."""
    parts = rows.split()
    b, h, t, _ = rows.codes.shape
    out = scratch(name, b * h * t * rows.rank, torch.float32, rows.codes.device).view(b, h, t, rows.rank)
    factors = []
    for codes, (lo, hi), bits in zip(parts.codes, parts.bounds, parts.bits):
        work = scratch("lanes", codes.numel() * 8 // bits, torch.uint8, codes.device)
        _, shifted = unpack_lanes(codes, bits, hi - lo, out[..., lo:hi], work=work)
        ones = torch.ones(hi - lo, device=codes.device)
        factors.append(lane_factors(bits, hi - lo, codes.device) if shifted else ones)
    return out, torch.cat(factors)


def subspace_scores(q: torch.Tensor, seg: SubspaceSegment) -> torch.Tensor:
    """Scores `[B, H, M, T]` of grouped, scaled queries `q` [B, H, M, D] against the segment's keys."""
    k, basis = seg.keys, seg.keys.basis
    codes, factors = _unpacked(k, "codes_k")
    scale, zero = k.scale.float() * factors, k.zero.float()  # [B, H, T // group, rank]
    if seg.rope is not None:  # rebuilt: coefficients times sigma times the basis, plus the mean, RoPE put back
        b, h, t, r = codes.shape
        z = codes.view(b, h, t // k.token_group, k.token_group, r).mul(scale.unsqueeze(3)).add_(zero.unsqueeze(3))
        weights, mean = native_subspace.basis_weights(k)
        z = z.view(b, h, t, r)
        s = native_subspace.prerope_scores(q, z, weights, mean, seg.rope, seg.start)  # the key stays in L1
        if s is not None:
            return s
        keys = torch.matmul(z, weights).add_(mean.unsqueeze(-2))
        return torch.matmul(q, seg.rope.rotate(keys, seg.start).transpose(-1, -2))
    folded = torch.matmul(q, basis.basis[:, :, : k.rank].float()) * basis.sigma[:, None, : k.rank].float()
    s = scores_of_codes(folded, codes, scale, zero, k.token_group)
    return s + torch.matmul(q, basis.mean.float().unsqueeze(-1))  # + q . mean, the same for every token


def subspace_coefficients(p: torch.Tensor, values: SubspaceRows) -> torch.Tensor:
    """`p` [B, H, M, T] (unnormalized probabilities) times the values' quantized coefficients: `[B, H, M, rank]`
    (whitened: multiply by sigma and the basis to get values). Each subspace holds per-token codes with one scale,
    read as a value group of that scale times the width's step and of zero `-(levels / 2 - 1/2)` steps."""
    codes, factors = _unpacked(values, "codes_v")
    steps, mids = (x.to(p.device) for x in native_subspace.value_levels(values.bits))
    scale = values.scale.float() * steps  # [B, H, T, subspaces]
    return values_of_codes(p, codes, scale, -scale * mids, list(values.bounds), factors)


def subspace_partial(q: torch.Tensor, seg: SubspaceSegment, mask: torch.Tensor | None, block: int | None = None,
                     coefficients: tuple | None = None):
    """Softmax partial (row max, row sum, unnormalized output `[B, H, M, D]` in the model's basis) of grouped, scaled
    queries `q` [B, H, M, D] over the segment. `mask`: [B|1, 1, M|1, T] boolean (True = attend) or None.
    `coefficients`: the partial with its output in the values' coefficients where a kernel computed it
    (`native_subspace.coefficient_partial`); else computed here block by block."""
    m, l, coeff = coefficients or blockwise_partial(q, seg, mask, block, subspace_scores,
                                                    lambda p, part: subspace_coefficients(p, part.values))
    return m, l, in_model_basis(seg.values, coeff, l)


def in_model_basis(values: SubspaceRows, coeff: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """An unnormalized output in the values' whitened coefficients `[..., H, M, rank]` (row sums `total` `[..., H,
    M]`) taken to the model's basis: times sigma and the basis, plus the row sums times the mean. `[..., H, M, D]`."""
    weights, mean = native_subspace.basis_weights(values)  # [H, r, D] (sigma times the basis), [H, D]
    return torch.matmul(coeff, weights) + total.unsqueeze(-1) * mean[:, None]


def subspace_mass(q: torch.Tensor, seg: SubspaceSegment, mask: torch.Tensor | None, lse: torch.Tensor,
                  block: int | None = None) -> torch.Tensor:
    """Attention probability of each key of the segment (`lse` [B, H, M]: the rows' log-sum-exp over all keys),
    summed over the rows: [B, H, T]."""
    return blockwise_mass(q, seg, mask, lse, block, subspace_scores)
