"""The fused kernel of the `"hf_kvcache"` attention: attention read straight from a layer's compressed segments.

Registered first in `attention.KERNELS` on import. The first call it sees for a layer that can expose segments
(`CompressedLayer.attention_segments`) is served by the plain kernels (the layer returned real tensors) and enrolls
the layer (`fused_reader = True`); from then on that layer's `update` returns placeholders plus a `fused_view`, and
this kernel computes the attention with `kernels.decode_attention`: Triton on CUDA tensors, the blockwise torch
path elsewhere, never expanding the cache to full precision as a whole.

Enrollment is per layer and lasts until `cache.reset()`: keep using the model with `attn_implementation="hf_kvcache"`
while that cache is in use (other attention implementations cannot read the placeholders).
"""

from __future__ import annotations

import torch

from .attention import AttentionCall, register_kernel
from .kernels.decode_attention import decode_attention
from .kernels.segments import FullSegment


class FusedCompressedKernel:
    name = "fused_compressed"

    def supports(self, call: AttentionCall) -> bool:
        layer = call.layer
        if layer is None or call.dropout > 0.0 or (call.mask is not None and call.mask.shape[1] != 1):
            return False
        if getattr(layer, "fused_view", None) is not None:
            return True
        if layer.attention_segments() is not None:
            layer.fused_reader = True  # enroll: the next update hands over a compressed view
        return False

    def __call__(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer = call.layer
        segments, new_k, new_v = layer.fused_view
        layer.fused_view = None
        segments = [*segments, FullSegment(new_k, new_v)]
        mask = call.mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask > torch.finfo(mask.dtype).min / 2
        out, mass = decode_attention(call.query, segments, mask, call.scaling, return_mass=call.want_mass)
        return out.transpose(1, 2).contiguous(), mass


def register() -> None:
    register_kernel(FusedCompressedKernel(), first=True)
