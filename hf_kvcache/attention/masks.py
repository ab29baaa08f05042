"""Masks of the `"hf_kvcache"` attention: boolean views of transformers' masks, the keys a mask lets any query see,
and the masks of layers whose heads hold different slots (`key_mask`) or whose slots stand for several tokens
(`key_bias`)."""

from __future__ import annotations

import torch


def mask_as_bool(mask: torch.Tensor) -> torch.Tensor:
    """An attention mask as booleans (True: may attend): bool masks as they are, additive float masks where they
    are above half the dtype's lowest value (transformers fills masked entries with that lowest value)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def visible_keys(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """`[batch, kv_len]` bool: keys at least one query (of any head) may attend; None when there is no mask."""
    if mask is None:
        return None
    return mask_as_bool(mask).any(dim=2).any(dim=1).expand(batch, -1)


def with_key_mask(
    mask: torch.Tensor | None, key_mask: torch.Tensor, heads: int, q_len: int, is_causal: bool
) -> torch.Tensor:
    """The mask of a layer whose KV heads hold different slots (`head_budgets`): boolean `[batch, heads, q, kv]`.

    `key_mask [batch, kv_heads, kv]` says which keys each head holds (False for empty slots and padding); the model's
    mask (None, bool or additive, `[b|1, 1|heads, q, kv']`, built for another layer's width) is read only for the new
    tokens, its last `q_len` columns (causality and padding among them): every held slot precedes every query."""
    b, kv_heads, kv = key_mask.shape
    per_head = key_mask.repeat_interleave(heads // kv_heads, dim=1)[:, :, None, :]
    if mask is None:
        return held_then_causal(q_len, kv, is_causal, key_mask.device) & per_head
    new = mask_as_bool(mask)[..., -q_len:]
    held = torch.ones(*new.shape[:-1], kv - q_len, dtype=torch.bool, device=key_mask.device)
    return torch.cat([held, new], dim=-1) & per_head


def held_then_causal(q_len: int, kv: int, is_causal: bool, device: torch.device) -> torch.Tensor:
    """`[1, 1, q_len, kv]` bool, what a query may attend when the model passed no mask: every held slot (the first
    `kv - q_len`), and the new tokens causally (all of them when not causal)."""
    visible = torch.ones(q_len, kv, dtype=torch.bool, device=device)
    return (visible.tril(kv - q_len) if is_causal and q_len > 1 else visible)[None, None]


def with_key_bias(
    mask: torch.Tensor | None, key_bias: torch.Tensor, heads: int, q_len: int, kv_len: int, is_causal: bool
) -> torch.Tensor:
    """The additive float32 mask `[batch, heads, q, kv]` of a layer whose slots stand for several tokens (`merge`):
    `key_bias [batch, kv_heads, kv]` (the log of the tokens of each slot) where the model's mask (None, bool or
    additive, `[b|1, 1|heads, q, kv]`) lets a query attend, `-inf` elsewhere."""
    b, kv_heads, kv = key_bias.shape
    if kv != kv_len:
        raise ValueError(f"key bias for {kv} slots, but the attention got {kv_len} keys")
    visible = held_then_causal(q_len, kv, is_causal, key_bias.device) if mask is None else mask_as_bool(mask)
    bias = key_bias.float().repeat_interleave(heads // kv_heads, dim=1)[:, :, None, :]
    if mask is not None and mask.dtype != torch.bool:
        bias = bias + mask.float()
    return torch.where(visible, bias, -float("inf"))
