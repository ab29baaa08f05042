"""The fused kernel of the `"hf_kvcache"` attention: attention read straight from a layer's compressed segments.

Registered first in `attention.KERNELS` on import. A cache bound to the model (`CompressedCache.bind(model)`, done by
`generate` for caches that set `reads_fused`) hands this kernel a `FusedView` (in its `AttentionRequest`) from every
`update` made while the model runs the `"hf_kvcache"` attention: the segments it held plus the new tokens, and placeholder key/value tensors that
nothing else can read. The kernel computes the attention with `kernels.decode_attention` (Triton on CUDA tensors, the
blockwise torch path elsewhere), never expanding the cache to full precision as a whole. A call it does not serve
(dropout, a per-head mask) is computed from the view's dequantized tensors by the other kernels, so every call that
carries a view gets a right answer.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels.decode_attention import decode_attention
from ..kernels.segments import FullSegment
from .kernels import KERNELS, AttentionCall, register_kernel
from .masks import mask_as_bool


class FusedCompressedKernel:
    name = "fused_compressed"

    def supports(self, call: AttentionCall) -> bool:
        return call.request is not None and call.request.view is not None

    def __call__(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        view = call.request.view
        if call.dropout > 0.0 or (call.mask is not None and call.mask.shape[1] != 1):
            keys, values = view.dense()
            plain = dataclasses.replace(call, key=keys, value=values,
                                        request=dataclasses.replace(call.request, view=None))
            kernel = next(k for k in KERNELS if k is not self and k.supports(plain))
            return kernel(plain)
        segments = [*view.segments, FullSegment(view.new_keys, view.new_values)]
        mask = None if call.mask is None else mask_as_bool(call.mask)
        out, mass = decode_attention(call.query, segments, mask, call.scaling, return_mass=call.want_mass)
        return out.transpose(1, 2).contiguous(), mass


def register() -> None:
    register_kernel(FusedCompressedKernel(), first=True)
