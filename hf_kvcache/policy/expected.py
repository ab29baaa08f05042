"""`expected`: Expected Attention -- keep the keys the upcoming queries are expected to attend to.

The next queries are not known yet, so the policy models them from the last `window` queries of the layer
(post-RoPE, padding queries and the first `sink_length` positions left out): each is moved by RoPE to the next
`future` positions (its rotation averaged over them; `future=0` leaves them where they are), and their mean `mu` and
covariance `Sigma` per query head describe the next query `q` as a Gaussian. The logit `q.k / sqrt(d)` of a key `k`
is then normal with mean `mu.k / sqrt(d)` and variance `k^T Sigma k / d`, so `exp(logit)` has the expectation
`exp(mu.k / sqrt(d) + k^T Sigma k / (2 d))`. Normalized over the held keys (a softmax of these expected logits per
query head) and summed over the query heads of the KV group, it is the attention a key is expected to receive; with
`value_norm` (on by default here) it is multiplied by the norm of the key's value (`EvictionPolicy._ranked`: the
size of what it adds to the output). The idea is
Expected Attention (Devoto et al. 2025, NVIDIA kvpress's ExpectedAttentionPress); this is our own implementation.

With `W` recent queries `Sigma` has rank below `W`, so `k^T Sigma k` is the mean of `((q_i - mu) . k)^2` over them:
one window of logits (what snapkv computes), never a `[head_dim, head_dim]` matrix. The first `sink_length` tokens
(attention sinks) are always kept; no recent window by default (`recent_length` / `recent_ratio` add one).

`mass_share` s in [0, 1) blends in the attention the held tokens actually received (h2o's accumulated mass): the
priority is `(1 - s) E + s M`, E and M each normalized to sum 1 over the slots a row's head may evict (the sinks and
recent window left out, whose mass would swamp the rest). Off by default.

`sinks_in_softmax=False` leaves the sinks out of the softmax (kvpress's ExpectedAttentionPress scores the keys after
its sinks only): each query head then spreads a whole unit of expected attention over the evictable keys, so a head
that sends most of its attention to the sinks weighs as much in its group's sum as one that does not. By default
(True) the sinks take their share, as in the model's attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..options import check_bool, check_int, check_number
from .attention import removal_error
from .base import INF, SlotView
from .options import ObservationWindow, RingPolicy, WithSinks

DEFAULT_FUTURE = 512  # upcoming positions the modelled queries are spread over (kvpress's n_future_positions)


@dataclass(kw_only=True)
class ExpectedAttentionPolicy(ObservationWindow, WithSinks, RingPolicy):
    """Options: `window` (recent queries modelled, default 32), `sink_length` (default 4), `future` (default 512; 0
    keeps the queries where they are and needs no config), `mass_share` in [0, 1) (default 0), `sinks_in_softmax`
    (default True), `value_norm` (default True here) and `output_error` (`policy.options.RingPolicy`)."""

    name: ClassVar[str] = "expected"
    uses_keys: ClassVar[bool] = True
    uses_queries: ClassVar[bool] = True
    default_recent_share: ClassVar[float] = 0.0
    default_value_norm: ClassVar[bool] = True
    future: int = DEFAULT_FUTURE
    mass_share: float = 0.0
    sinks_in_softmax: bool = True

    def validate(self) -> None:
        super().validate()
        check_int("future", self.future, lo=0, hint=" (upcoming positions; 0 = no RoPE shift)")
        check_number("mass_share", self.mass_share, 0.0, 1.0, hi_open=True,
                     hint=" (the share of the received attention mass)")
        check_bool("sinks_in_softmax", self.sinks_in_softmax)

    @property
    def uses_mass(self) -> bool:
        return self.mass_share > 0  # the layer then accumulates the attention mass (`view.scores`)

    def needs_rope(self) -> bool:
        return self.future > 0

    def priority(self, view: SlotView, budget: int) -> torch.Tensor:
        sinks, recent = self.split(budget)
        mean, spread = query_statistics(
            view.queries, view.query_positions, view.query_valid, view.seen, self.future,
            view.rope if self.future > 0 else None, skip_before=self.sink_length,
        )
        protected = view.first(sinks) | view.last(recent)
        attended = view.valid if self.sinks_in_softmax else view.valid & ~view.first(sinks)
        values = view.values if self.output_error else None
        score = expected_attention(mean, spread, view.keys, attended, view.scaling, view.key_bias, values)
        if self.mass_share > 0:
            free = view.valid & ~protected
            score = (1 - self.mass_share) * _share(score, free) + self.mass_share * _share(view.scores, free)
        return score.masked_fill(protected, INF)


def _share(score: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """`score [batch, kv_heads, slots]` on the `free` slots as fractions of their sum per row and head (0 elsewhere)."""
    score = score.float().masked_fill(~free, 0.0)
    return score / score.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def query_statistics(
    queries: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    seen: int,
    future: int,
    rope=None,
    skip_before: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean `[batch, heads, 1, head_dim]` and scaled deviations `[batch, heads, W, head_dim]` of the recent queries
    `queries [batch, heads, W, head_dim]` (positions `positions [W]`, `valid [batch, W]`), fp32.

    With `rope` (a `KeyRotation`) each query is first moved to the positions `seen .. seen + future - 1`, its
    rotation averaged over them. Queries at positions below `skip_before` (the attention sinks' outliers) and padding
    queries are left out (a row with no other query keeps its valid ones). The deviations are `(q_i - mean) /
    sqrt(n)` (0 for queries left out), so `sum_i (dev_i . k)^2` is `k^T Sigma k` for the covariance `Sigma` of the
    n queries used."""
    q = queries.float()
    if rope is not None and future > 0:
        ahead = seen + torch.arange(future, device=positions.device)
        q = rope.mean_rotate(q, ahead[None, :] - positions[:, None].long())
    use = valid & (positions >= skip_before).to(valid.device)[None]
    use = torch.where(use.any(-1, keepdim=True), use, valid)
    w = use.to(q.dtype)[:, None, :, None]  # [batch, 1, W, 1]
    n = w.sum(2, keepdim=True).clamp(min=1.0)
    mean = (q * w).sum(2, keepdim=True) / n
    return mean, (q - mean) * w / n.sqrt()


def expected_attention(
    mean: torch.Tensor, spread: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float,
    key_bias: torch.Tensor | None = None, values: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[batch, kv_heads, slots]` fp32: the attention the modelled next query is expected to give each held key,
    summed over the query heads of the group. `mean [batch, heads, 1, d]` and `spread [batch, heads, W, d]` from
    `query_statistics`, `keys [batch, kv_heads, slots, d]`, `valid [batch, kv_heads, slots]` (padding gets 0);
    `key_bias [batch, kv_heads, slots]` (log weights of merged slots) is added to the expected logits. With `values
    [batch, kv_heads, slots, d_v]`: how far the expected output moves without each key (`base.removal_error`)."""
    b, heads, w, d = spread.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    g = heads // kv_heads
    both = torch.cat([mean, spread], 2).reshape(b, kv_heads, g * (1 + w), d)
    dots = torch.matmul(both, keys.float().transpose(-1, -2)).view(b, kv_heads, g, 1 + w, slots)
    logits = dots[:, :, :, 0] * scaling + 0.5 * scaling**2 * dots[:, :, :, 1:].square().sum(3)  # [b, kv, g, slots]
    if key_bias is not None:
        logits = logits + key_bias[:, :, None].float()
    logits = logits.masked_fill(~valid[:, :, None], -INF)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs.sum(2) if values is None else removal_error(probs[:, :, :, None], values)[:, :, 0]
