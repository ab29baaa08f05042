"""The attention recent queries give the held slots, recomputed at eviction time: `window_logits`, `window_attention`,
and `removal_error` (how far each query's output moves without a slot). Window policies read it through
`SlotView.window`; the query ring (`policy.ring`) and CPAC use it too. `pool_scores`: scores pooled over
neighbouring slots (SnapKV's `pool`, the `Pooled` wrapper)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..options import check_choice, check_positive_int

INF = float("inf")
POOL_MODES = ("max", "avg")  # pool_scores: a slot scores as the best or the mean of its neighbours


def window_logits(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    query_valid: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
    in_dtype: bool = False,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of recent queries over the held keys, per KV head: `[batch, kv_heads, group, W, slots]` float32, `-inf`
    where a query does not see a key.

    `queries [batch, heads, W, head_dim]` (heads a multiple of kv_heads, grouped as GQA does), `query_positions [W]`,
    `query_valid [batch, W]` (False: padding or not seen yet: sees nothing), `keys [batch, kv_heads, slots, head_dim]`,
    `key_positions` / `key_valid [batch, kv_heads, slots]`. A query sees the valid keys at positions up to its own.
    `in_dtype`: the logits are computed in the queries' dtype (keys of the same dtype), then in float32, as the
    `"hf_kvcache"` attention computes them. `key_bias [batch, kv_heads, slots]` is added to every logit of its slot
    (the log weight of a slot that stands for several merged tokens, `policy.wrappers.Merge`)."""
    b, heads, w, d = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    g = heads // kv_heads
    if in_dtype:
        logits = torch.matmul(queries.reshape(b, kv_heads, g * w, d), keys.transpose(-1, -2)).float()
    else:
        logits = torch.matmul(queries.float().reshape(b, kv_heads, g * w, d), keys.float().transpose(-1, -2))
    logits = logits.mul_(scaling).view(b, kv_heads, g, w, slots)
    if key_bias is not None:
        logits += key_bias[:, :, None, None, :].to(logits.device, torch.float32)
    visible = key_valid[:, :, None, :] & (key_positions[:, :, None, :] <= query_positions[None, None, :, None])
    visible = visible & query_valid[:, None, :, None]
    return logits.masked_fill_(~visible[:, :, None], -INF)


def window_attention(logits: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of recent queries over the held keys, per KV head: `[batch, kv_heads, W, slots]` float32, from their
    logits `[batch, kv_heads, group, W, slots]` (`window_logits`): each query head's softmax over the keys it sees,
    the heads of a group summed; a query that sees no key (padding, not seen yet) gives a row of 0.
    With `values [batch, kv_heads, slots, value_dim]`: each slot's `removal_error` instead of its attention."""
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    return probs.sum(2) if values is None else removal_error(probs, values)


def removal_error(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """How far each query's attention output moves if a slot is removed, summed over the query heads of the group:
    `[batch, kv_heads, W, slots]` float32 from attention `probs [batch, kv_heads, group, W, slots]` and the held
    `values [batch, kv_heads, slots, value_dim]`.

    Removing slot j from a softmax renormalizes the rest, so the output `o = sum_i p_i v_i` becomes
    `(o - p_j v_j) / (1 - p_j)`: it moves by `p_j / (1 - p_j) * |v_j - o|`. Unlike the attention `p_j` alone (or
    `p_j |v_j|`), a token whose value is close to what the head outputs anyway costs little to drop (the criterion of
    CAOTE, Goel et al. 2025)."""
    b, h, g, w, n = probs.shape
    v = values.float()
    out = torch.matmul(probs.reshape(b, h, g * w, n), v)  # [b, h, g*w, d]
    dots = torch.matmul(out, v.transpose(-1, -2))  # [b, h, g*w, n]: o . v_j
    far = (v.square().sum(-1)[:, :, None] - 2 * dots + out.square().sum(-1, keepdim=True)).clamp_min_(0.0).sqrt_()
    moved = probs / (1 - probs).clamp_min(1e-6) * far.view(b, h, g, w, n)
    return moved.sum(2)


def pool_scores(scores: torch.Tensor, valid: torch.Tensor | None, pool: int, mode: str) -> torch.Tensor:
    """`scores [batch, kv_heads, slots]` (slots in order of position) pooled over `pool` neighbouring slots: the
    maximum or the mean of the finite scores of real slots in the window; other slots (`+-inf`, padding) keep
    their score and give none to their neighbours.

    Args:
        scores: float32 priorities, `+inf` for protected slots.
        valid: bool `[batch, kv_heads, slots]`, False for padding; None: every slot real.
        pool: odd window width; mode: "max" or "avg" (`POOL_MODES`).
    Returns:
        float32 `[batch, kv_heads, slots]`.
    """
    if pool <= 1:
        return scores
    b, h, n = scores.shape
    usable = scores.isfinite() if valid is None else scores.isfinite() & valid
    if mode == "avg" and bool(usable.all()):  # no slot to leave out: the plain mean over the slots in range
        pooled = F.avg_pool1d(scores.reshape(b * h, 1, n), pool, 1, pool // 2, count_include_pad=False)
    elif mode == "max":
        filled = torch.where(usable, scores, torch.finfo(scores.dtype).min).reshape(b * h, 1, n)
        pooled = F.max_pool1d(filled, pool, stride=1, padding=pool // 2)
    else:
        total = F.avg_pool1d(torch.where(usable, scores, 0.0).reshape(b * h, 1, n), pool, 1, pool // 2)
        count = F.avg_pool1d(usable.to(scores.dtype).reshape(b * h, 1, n), pool, 1, pool // 2)
        pooled = total / count.clamp_min(torch.finfo(scores.dtype).tiny)
    return torch.where(usable, pooled.view(b, h, n), scores)


def check_pool(pool: int, mode: str, mode_option: str = "mode") -> None:
    """ValueError unless `pool` is an odd positive width and `mode` one of `POOL_MODES` (named `mode_option`)."""
    check_positive_int("pool", pool)
    if pool % 2 == 0:
        raise ValueError(f"pool must be odd (centred on the slot), got {pool}; e.g. pool={pool + 1}")
    check_choice(mode_option, mode, POOL_MODES)
