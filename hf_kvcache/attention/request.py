"""The typed hand-off from a cache layer to the `"hf_kvcache"` attention: an `AttentionRequest`.

A layer's `update` must return key and value tensors (transformers' contract), and the attention function is then
called with those tensors and nothing else of the cache. So `update` hands its request over with the key tensor it
returns (`hand_over`), and the attention function takes it back from the key tensor it receives (`request_for`). The
request says which layer to report to (its declared capabilities: `wants_attention_mass`, `query_window`,
`key_mask()`, `key_bias()`, `mask_from_end`, and the `observe_*` callbacks) and, when the layer is read in place,
the compressed segments to attend (`view`; the returned tensors are then placeholders).

Requests are held by the identity of the key tensor and dropped when that tensor is freed (or taken), so nothing is
stored on tensors and nothing outlives the forward that made it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels.segments import FullSegment, dense_segments

if TYPE_CHECKING:
    from ..caches.base import CompressedLayer


@dataclass
class FusedView:
    """The compressed storage a layer read in place hands over for one `update`: the segments it held before the
    update (references to storage that is replaced, never written in place) and the new tokens
    `[batch, kv_heads, new, head_dim]`, kept exactly as the model gave them."""

    segments: list
    new_keys: torch.Tensor
    new_values: torch.Tensor

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every position (held, then new) in the new tokens' dtype: the fallback for attention
        calls the fused kernel does not serve."""
        return dense_segments([*self.segments, FullSegment(self.new_keys, self.new_values)], self.new_keys.dtype)


@dataclass
class AttentionRequest:
    """What one `update` of `layer` asks of the attention call that follows it.

    Attributes:
        layer: the layer to ask for masks and to report to.
        view: the segments to attend instead of the returned (placeholder) tensors; None when the returned keys and
            values hold the data.
    """

    layer: CompressedLayer
    view: FusedView | None = None


_PENDING: dict[int, tuple[weakref.ref, AttentionRequest]] = {}


def hand_over(keys: torch.Tensor, request: AttentionRequest) -> None:
    """Leave `request` for the attention call that will receive `keys` (replaces an earlier one for them)."""
    key = id(keys)
    _PENDING[key] = (weakref.ref(keys, lambda _, key=key: _PENDING.pop(key, None)), request)


def request_for(keys: torch.Tensor, take: bool = False) -> AttentionRequest | None:
    """The request left with `keys` (None when no layer of ours returned them); `take` removes it."""
    entry = _PENDING.get(id(keys))
    if entry is None or entry[0]() is not keys:
        return None
    if take:
        _PENDING.pop(id(keys), None)
    return entry[1]


def pending_requests(layers=None) -> int:
    """How many requests wait for an attention call (those of `layers` only, when given): 0 once every forward that
    made one has returned and dropped its key tensors."""
    if layers is None:
        return len(_PENDING)
    wanted = {id(layer) for layer in layers}
    return sum(1 for _, request in list(_PENDING.values()) if id(request.layer) in wanted)
