"""The `"hf_kvcache"` attention implementation: one attention function for every cache, with pluggable kernels.

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_kvcache")
    # or, on a loaded model:  model.set_attn_implementation("hf_kvcache")

Importing `hf_kvcache` registers the function with transformers' `AttentionInterface` and the SDPA mask builder under
the same name with `AttentionMaskInterface` (masks are boolean, `True` = may attend, shape `[batch, 1, q, kv]`, or
`None` when a plain causal / full mask suffices).

How a call is served
--------------------
`hf_kvcache_attention` normalizes its arguments into an `AttentionCall` (GQA shapes checked, causal flag resolved,
the cache layer found with `layer_of(key)`), then runs the first kernel in `KERNELS` whose `supports(call)` is true:

* `TorchSDPAKernel` -- the fast path: `torch.nn.functional.scaled_dot_product_attention` with `enable_gqa=True`, so
  KV heads are never repeated in memory. Used whenever nobody asked for attention mass.
* `BlockwiseTorchKernel` -- the reference path that also returns the attention mass: queries are regrouped as
  `[batch, kv_heads, group * block, head_dim]` (no KV repetition) and processed `QUERY_BLOCK` query positions at a
  time, so a long prompt never materializes a `[batch, heads, q_len, kv_len]` matrix. Each block's probabilities are
  summed over the query heads of the group and over the query positions into `mass [batch, kv_heads, kv_len]`.

When the layer sets `wants_attention_mass`, the function then calls `layer.observe_visible_keys(visible)` (which keys
the mask lets any query see; `None` when there is no mask) and `layer.observe_attention(mass)`. Masked keys and fully
masked (padding) query rows contribute nothing to the mass. A layer that also sets `query_window = W > 0` first gets
`layer.observe_queries(query[:, :, -W:], scaling)`: the (post-RoPE) queries of the last `W` positions of the call,
`[batch, heads, min(W, q_len), head_dim]`. From them a policy can recompute the attention of a window of recent
queries over whatever the layer holds (SnapKV, TOVA), also across decoding steps of one query each, which the summed
mass cannot give. A layer whose heads hold different numbers of slots (`key_mask()` not None,
`[batch, kv_heads, kv]`) gets its empty slots masked per head, on top of the model's mask.

A fused dequantize+attention kernel (Triton on CUDA, blockwise torch on CPU) plugs in with `register_kernel(kernel,
first=True)`: its `supports(call)` looks at `call.layer` (e.g. a layer exposing a compressed view of its storage) and
the device, and its `__call__` returns `(output [batch, q_len, heads, head_dim], mass or None)`, mass only when
`call.want_mass`. The model keeps calling the same `"hf_kvcache"` function.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .caches.base import CompressedLayer, layer_of, take_fused_view

NAME = "hf_kvcache"
QUERY_BLOCK = 256  # query positions per block when the attention mass is computed

logger = logging.getLogger(__name__)


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
    layer: CompressedLayer | None
    want_mass: bool
    kv_len_before_crop: int  # the mass covers every key the layer returned, also the ones cut for `causal`

    @property
    def groups(self) -> int:
        return self.query.shape[1] // self.key.shape[1]


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


def mask_as_bool(mask: torch.Tensor) -> torch.Tensor:
    """An attention mask as booleans (True: may attend): bool masks as they are, additive float masks where they
    are above half the dtype's lowest value (transformers fills masked entries with that lowest value)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def visible_keys(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """`[batch, kv_len]` bool: keys at least one query (of any head) may attend; None when there is no mask."""
    if mask is None:
        return None
    return mask_as_bool(mask).any(dim=2).any(dim=1).expand(batch, -1)


def _with_key_mask(
    mask: torch.Tensor | None, key_mask: torch.Tensor, heads: int, q_len: int, is_causal: bool
) -> torch.Tensor:
    """The mask of a layer whose KV heads hold different slots (`head_budgets`): boolean `[batch, heads, q, kv]`.

    `key_mask [batch, kv_heads, kv]` says which keys each head holds (False for empty slots and padding); the model's
    mask (None, bool or additive, `[b|1, 1|heads, q, kv']`, built for another layer's width) is read only for the new
    tokens, its last `q_len` columns (causality and padding among them): every held slot precedes every query."""
    b, kv_heads, kv = key_mask.shape
    per_head = key_mask.repeat_interleave(heads // kv_heads, dim=1)[:, :, None, :]
    if mask is None:
        return _held_then_causal(q_len, kv, is_causal, key_mask.device) & per_head
    new = mask_as_bool(mask)[..., -q_len:]
    held = torch.ones(*new.shape[:-1], kv - q_len, dtype=torch.bool, device=key_mask.device)
    return torch.cat([held, new], dim=-1) & per_head


def _held_then_causal(q_len: int, kv: int, is_causal: bool, device: torch.device) -> torch.Tensor:
    """`[1, 1, q_len, kv]` bool, what a query may attend when the model passed no mask: every held slot (the first
    `kv - q_len`), and the new tokens causally (all of them when not causal)."""
    visible = torch.ones(q_len, kv, dtype=torch.bool, device=device)
    return (visible.tril(kv - q_len) if is_causal and q_len > 1 else visible)[None, None]


def _with_key_bias(
    mask: torch.Tensor | None, key_bias: torch.Tensor, heads: int, q_len: int, kv_len: int, is_causal: bool
) -> torch.Tensor:
    """The additive float32 mask `[batch, heads, q, kv]` of a layer whose slots stand for several tokens (`merge`):
    `key_bias [batch, kv_heads, kv]` (the log of the tokens of each slot) where the model's mask (None, bool or
    additive, `[b|1, 1|heads, q, kv]`) lets a query attend, `-inf` elsewhere."""
    b, kv_heads, kv = key_bias.shape
    if kv != kv_len:
        raise ValueError(f"key bias for {kv} slots, but the attention got {kv_len} keys")
    visible = _held_then_causal(q_len, kv, is_causal, key_bias.device) if mask is None else mask_as_bool(mask)
    bias = key_bias.float().repeat_interleave(heads // kv_heads, dim=1)[:, :, None, :]
    if mask is not None and mask.dtype != torch.bool:
        bias = bias + mask.float()
    return torch.where(visible, bias, -float("inf"))


def _prepare(module, query, key, value, attention_mask, dropout, scaling, is_causal) -> AttentionCall:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"hf_kvcache attention takes [batch, heads, tokens, head_dim] tensors, got query {tuple(query.shape)}, "
            f"key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot be grouped over {kv_heads} KV heads")
    layer = layer_of(key)
    want_mass = bool(layer is not None and getattr(layer, "wants_attention_mass", False))
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4D [batch, 1|heads, q, kv], got shape {tuple(attention_mask.shape)}")
    if attention_mask is not None:
        if getattr(layer, "mask_from_end", False) and attention_mask.shape[-1] > kv_len:
            # a layer that holds fewer slots than the layer the mask was built for (per-layer budgets): its held
            # slots are the newest of that layer's, so the mask's last columns are its own
            attention_mask = attention_mask[..., -kv_len:]
        else:
            attention_mask = attention_mask[..., :kv_len]  # static caches may hand over a longer mask
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    key_mask = layer.key_mask() if layer is not None and hasattr(layer, "key_mask") else None
    if key_mask is not None:
        attention_mask = _with_key_mask(attention_mask, key_mask, heads, q_len, bool(is_causal))
    key_bias = layer.key_bias() if layer is not None and hasattr(layer, "key_bias") else None
    if key_bias is not None:
        attention_mask = _with_key_bias(attention_mask, key_bias, heads, q_len, kv_len, bool(is_causal))
    causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if causal and kv_len > q_len:
        # as transformers' SDPA integration: a skipped causal mask with more keys than queries only happens on the
        # prefill of a static cache, whose extra keys are empty slots
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    return AttentionCall(
        query, key, value, attention_mask, causal, query.shape[-1] ** -0.5 if scaling is None else scaling,
        dropout, layer, want_mass, kv_len,
    )


def hf_kvcache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Drop-in for transformers' `sdpa_attention_forward`; returns `(attn_output [batch, q_len, heads, dim], None)`.

    Reports attention mass to the hf-kvcache layer that returned `key` when that layer asks for it."""
    if kwargs.get("softcap") is not None:
        raise ValueError("the hf_kvcache attention does not support `softcap`; use eager or flex attention")
    special = kwargs.get("position_bias") is not None or kwargs.get("cache") is not None or kwargs.get("s_aux") is not None
    if special:
        layer = layer_of(key)
        if layer is not None and getattr(layer, "wants_attention_mass", False):
            raise NotImplementedError(
                "the hf_kvcache attention cannot report attention mass together with position_bias / paged caches / "
                "attention sinks (s_aux)"
            )
        view = take_fused_view(layer)
        if view is not None:  # a layer read in place handed placeholders: attend to its decoded tensors instead
            key, value = view.dense()
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    call = _prepare(module, query, key, value, attention_mask, dropout, scaling, is_causal)
    for kernel in KERNELS:
        if kernel.supports(call):
            out, mass = kernel(call)
            break
    else:  # pragma: no cover - the blockwise kernel supports everything
        raise RuntimeError("no hf_kvcache attention kernel supports this call")
    window = int(getattr(call.layer, "query_window", 0) or 0)
    if window > 0:  # the last queries: policies that score by a recent window, layers calibrating their recipe
        call.layer.observe_queries(query[:, :, -window:], call.scaling)
    if call.want_mass:
        if mass is None:
            raise RuntimeError(f"kernel {kernel.name!r} was asked for the attention mass and returned none")
        call.layer.observe_visible_keys(visible_keys(call.mask, query.shape[0]))
        call.layer.observe_attention(mass)
    return out, None


def unsupported(config) -> str | None:
    """Why this attention cannot run a model of `config` at all (None when it can): attention logit soft-capping."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping (attn_logit_softcapping)"
    return None


def register() -> None:
    """Register `"hf_kvcache"` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(NAME, hf_kvcache_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_for_cache(model, cache) -> bool:
    """Switch `model` to `attn_implementation="hf_kvcache"` when `cache` declares `needs_attention_mass`.

    The switch stays (it is not undone after generation): for every other cache this attention computes exactly what
    SDPA computes, so later calls are unaffected. Returns True when it switched."""
    if not getattr(cache, "needs_attention_mass", False):
        return False
    current = getattr(model.config, "_attn_implementation", None)
    if current == NAME:
        return False
    model.set_attn_implementation(NAME)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        raise ValueError(
            f"{type(cache).__name__} needs the attention mass that only attn_implementation='{NAME}' reports, and "
            f"{type(model).__name__} could not be switched to it; load the model with attn_implementation='{NAME}'"
        )
    logger.warning(
        "%s ranks tokens by the attention they receive: switched the model's attn_implementation from %r to %r "
        "(same outputs as sdpa for every other cache)", type(cache).__name__, current, NAME,
    )
    return True
