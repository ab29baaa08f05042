"""Folding evicted tokens into the kept ones (`policy.wrappers.Merge`) instead of dropping what they carried.

Each evicted token goes into the kept slot whose key points the most the same way (the highest cosine of the held,
post-RoPE keys, at least `similarity`; none: the token is just dropped). The kept slot's value becomes the average
of its own and those folded into it, weighted by the attention each received from the layer's last queries (the
ring): `(a_j v_j + sum_e a_e v_e) / (a_j + sum_e a_e)`.

Two modes:
* `"value"`: only the value moves; the slot's key and logit stay, so the attention mass of the evicted tokens is
  shared out over what is kept, as plain eviction does.
* `"mass"`: the slot also stands for the tokens folded into it: `log_weight_j` (the log of that count, weighted) grows
  by `log(1 + sum_e a_e / a_j)` and the attention adds it to the slot's logit, so for the last queries the merged slot
  keeps the attention mass the evicted tokens had (`W_j exp(q.k_j)` with `W_j = exp(log_weight_j)`). Exact when the
  folded keys equal the kept one.

A target slot must be seen by every one of the last queries that sees the evicted token, and the evicted token by at
least two query rows (each query head of the KV group counts; a token newer than every query but the last, with a
single query head per group, is simply dropped).
"""

from __future__ import annotations

import torch

INF = float("inf")
MERGE_MODES = ("value", "mass")


def fold_evicted(
    logits: torch.Tensor,
    query_positions: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    keep: torch.Tensor,
    evicted: torch.Tensor,
    values: torch.Tensor,
    log_weight: torch.Tensor | None,
    similarity: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New `(values, log_weight)` of the held slots with every `evicted` slot folded into a kept one (`log_weight`
    None: mode `"value"`; a tensor: mode `"mass"`, returned grown).

    `logits [batch, kv_heads, Q, slots]` float32: the last queries' logits (log weights included, `-inf` where a
    query does not see a slot: a query sees the valid slots at positions up to its own), `query_positions [Q]` the
    position of each logit row, `positions [batch, kv_heads, slots]` the slots' positions; `keys [batch, kv_heads,
    slots, head_dim]`; `keep` / `evicted [batch, kv_heads, slots]` bool: the slots kept, and the real tokens about to
    be evicted; `values [batch, kv_heads, slots, value_dim]`; `log_weight [batch, kv_heads, slots]` float32 or None;
    `similarity`: the lowest key cosine a fold accepts. Only kept slots change (the caller drops the evicted ones)."""
    count = int(evicted.sum(-1).max()) if evicted.numel() else 0
    if count == 0:
        return values, log_weight
    visible = logits > -INF
    mass = torch.softmax(logits, dim=-1).nan_to_num_(0.0).sum(2)  # [b, h, slots] attention from the Q queries
    # per slot: how many query rows see it, and the position of the first that does; a kept slot is seen by every
    # query that sees an evicted one when it is real and not newer than the evicted one's first query
    seen_by = visible.sum(2)
    never = torch.iinfo(torch.int64).max
    first = torch.where(visible, query_positions.long()[None, None, :, None], never).amin(2)
    index = evicted.float().topk(count, dim=-1).indices  # [b, h, E] (rows evicting fewer: `real` is False)
    real = evicted.gather(-1, index)
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    cosine = unit.gather(2, index[..., None].expand(*index.shape, unit.shape[-1])) @ unit.transpose(-1, -2)
    ok = (keep & (seen_by > 0))[:, :, None, :] & (positions.long()[:, :, None, :] <= first.gather(-1, index)[..., None])
    ok &= (seen_by.gather(-1, index) >= 2)[..., None] & (cosine >= similarity)
    best = cosine.masked_fill_(~ok, -INF).max(-1)  # [b, h, E]
    target, found = best.indices, best.values > -INF
    share = torch.where(real & found & (mass.gather(-1, target) > 0), mass.gather(-1, index), 0.0)
    added = torch.zeros_like(mass).scatter_add_(-1, target, share)  # [b, h, slots] attention folded into each slot
    v = values.float()
    brought = v.gather(2, index[..., None].expand(*index.shape, v.shape[-1])) * share[..., None]
    summed = torch.zeros_like(v).scatter_add_(2, target[..., None].expand(*target.shape, v.shape[-1]), brought)
    grown = added > 0
    tiny = torch.finfo(torch.float32).tiny
    merged = (mass[..., None] * v + summed) / (mass + added).clamp_min(tiny)[..., None]
    new_values = torch.where(grown[..., None], merged, v).to(values.dtype)
    if log_weight is None:
        return new_values, None
    return new_values, torch.where(grown, log_weight + torch.log1p(added / mass.clamp_min(tiny)), log_weight)
