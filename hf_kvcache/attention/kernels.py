"""The kernels of the `"hf_kvcache"` attention and the call they serve: `AttentionCall` (one call, normalized), the
`Kernel` protocol, torch SDPA (no attention mass) and the blockwise reference that also returns the mass, and the
dispatch list `KERNELS` (`register_kernel` adds one, e.g. the fused kernel over compressed segments)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from .masks import mask_as_bool

if TYPE_CHECKING:
    from .request import AttentionRequest

QUERY_BLOCK = 256  # query positions per block when the attention mass is computed



@dataclass
class AttentionCall:
    """One attention call, normalized. `mask` is `None`, boolean (`True` = attend) or additive float, broadcastable
    to `[batch, heads, q_len, kv_len]` with a head dim of 1 or `heads`. With `mask=None`, `causal` means query `i` sees
    keys `0..i` (then `kv_len == q_len`, as in transformers' SDPA integration); otherwise every key is visible."""

    query: torch.Tensor  # [batch, heads, q_len, head_dim]
    key: torch.Tensor  # [batch, kv_heads, kv_len, head_dim]
    value: torch.Tensor  # [batch, kv_heads, kv_len, value_dim]
    mask: torch.Tensor | None
    causal: bool
    scaling: float
    dropout: float
    request: AttentionRequest | None  # what the cache layer that returned `key` asked for (None: not one of ours)
    want_mass: bool
    kv_len_before_crop: int  # the mass covers every key the layer returned, also the ones cut for `causal`

    @property
    def groups(self) -> int:
        return self.query.shape[1] // self.key.shape[1]

    @property
    def layer(self):
        """The cache layer that returned `key` (None: not one of ours)."""
        return None if self.request is None else self.request.layer


class Kernel(Protocol):
    name: str

    def supports(self, call: AttentionCall) -> bool: ...

    def __call__(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class TorchSDPAKernel:
    """torch SDPA with native GQA. No attention mass."""

    name = "torch_sdpa"

    def supports(self, call: AttentionCall) -> bool:
        return not call.want_mass

    def __call__(self, call: AttentionCall) -> tuple[torch.Tensor, None]:
        out = F.scaled_dot_product_attention(
            call.query, call.key, call.value, attn_mask=call.mask, dropout_p=call.dropout, scale=call.scaling,
            is_causal=call.causal, enable_gqa=call.groups > 1,
        )
        return out.transpose(1, 2).contiguous(), None


class BlockwiseTorchKernel:
    """Grouped-query attention over blocks of `block` query positions, returning the attention mass per KV head."""

    name = "torch_blockwise"

    def __init__(self, block: int | None = None) -> None:
        self.block = block

    def supports(self, call: AttentionCall) -> bool:
        return True

    def __call__(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = call.query, call.key, call.value
        b, heads, q_len, d = q.shape
        kv_heads, kv_len, dv = k.shape[1], k.shape[2], v.shape[-1]
        g = call.groups
        block = max(1, (self.block or QUERY_BLOCK))
        qg = q.view(b, kv_heads, g, q_len, d)
        out = q.new_empty(b, kv_heads, g, q_len, dv)
        mass = torch.zeros(b, kv_heads, kv_len, dtype=torch.float32, device=q.device) if call.want_mass else None
        k_t = k.transpose(-1, -2)
        for s in range(0, q_len, block):
            e = min(q_len, s + block)
            n = e - s
            scores = torch.matmul(qg[:, :, :, s:e].reshape(b, kv_heads, g * n, d), k_t).float()
            scores = scores.mul_(call.scaling).view(b, kv_heads, g, n, kv_len)
            dead_rows = self._apply_mask(scores, call, s, e)
            probs = torch.softmax(scores, dim=-1)
            if dead_rows is not None:  # rows no key is visible to (padding queries): zero output, zero mass
                probs = probs.masked_fill(dead_rows, 0.0)
            if mass is not None:
                mass += probs.sum(dim=(2, 3))
            if call.dropout > 0.0:
                probs = F.dropout(probs, p=call.dropout, training=True)
            pv = torch.matmul(probs.to(v.dtype).view(b, kv_heads, g * n, kv_len), v)
            out[:, :, :, s:e] = pv.view(b, kv_heads, g, n, dv)
        out = out.view(b, heads, q_len, dv).transpose(1, 2).contiguous()
        if mass is not None and call.kv_len_before_crop > kv_len:
            mass = F.pad(mass, (0, call.kv_len_before_crop - kv_len))
        return out, mass

    @staticmethod
    def _apply_mask(scores: torch.Tensor, call: AttentionCall, s: int, e: int) -> torch.Tensor | None:
        """Mask `scores [b, kv_heads, g, n, kv]` in place for query positions `s:e`; returns the fully masked rows
        (broadcastable bool) or None."""
        kv_len = scores.shape[-1]
        if call.mask is None:
            if call.causal:
                visible = torch.arange(kv_len, device=scores.device) <= torch.arange(s, e, device=scores.device)[:, None]
                scores.masked_fill_(~visible, float("-inf"))
            return None
        m = call.mask[..., s:e, :]
        if m.shape[1] == 1:
            m = m.unsqueeze(2)  # [b|1, 1, 1, n, kv]
        else:
            m = m.view(m.shape[0], scores.shape[1], scores.shape[2], e - s, kv_len)
        if m.dtype == torch.bool:
            scores.masked_fill_(~m, float("-inf"))
            visible = m
        else:
            scores.add_(m)
            visible = mask_as_bool(m)
        dead = ~visible.any(dim=-1, keepdim=True)
        return dead if bool(dead.any()) else None


KERNELS: list[Kernel] = [TorchSDPAKernel(), BlockwiseTorchKernel()]


def register_kernel(kernel: Kernel, first: bool = True) -> None:
    """Add a kernel to the dispatch list (first = tried before the built-in ones)."""
    if first:
        KERNELS.insert(0, kernel)
    else:
        KERNELS.append(kernel)
