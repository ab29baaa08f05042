"""The `"hf_kvcache"` attention implementation: one attention function for every cache, with pluggable kernels.

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_kvcache")
    # or, on a loaded model:  model.set_attn_implementation("hf_kvcache")

Importing `hf_kvcache` registers the function with transformers' `AttentionInterface` and the SDPA mask builder under
the same name with `AttentionMaskInterface` (masks are boolean, `True` = may attend, shape `[batch, 1, q, kv]`, or
`None` when a plain causal / full mask suffices).

How a call is served
--------------------
`hf_kvcache_attention` normalizes its arguments into an `AttentionCall` (GQA shapes checked, causal flag resolved,
the cache layer's `AttentionRequest` found with `request_for(key)`), then runs the first kernel in `KERNELS` whose `supports(call)` is true:

* `TorchSDPAKernel` -- the fast path: `torch.nn.functional.scaled_dot_product_attention` with `enable_gqa=True`, so
  KV heads are never repeated in memory. Used whenever nobody asked for attention mass.
* `BlockwiseTorchKernel` -- the reference path that also returns the attention mass: queries are regrouped as
  `[batch, kv_heads, group * block, head_dim]` (no KV repetition) and processed `QUERY_BLOCK` query positions at a
  time, so a long prompt never materializes a `[batch, heads, q_len, kv_len]` matrix. Each block's probabilities are
  summed over the query heads of the group and over the query positions into `mass [batch, kv_heads, kv_len]`.

When the layer sets `wants_attention_mass`, the function then calls `layer.observe_visible_keys(visible)` (which keys
the mask lets any query see; `None` when there is no mask) and `layer.observe_attention(mass)`. Masked keys and fully
masked (padding) query rows contribute nothing to the mass. A layer that sets only `wants_visible_keys` (an
evicting layer whose policy does not rank by the mass: it needs the padding flags and the end of the forward) gets
the same two calls, with `mass=None`, and its attention stays `TorchSDPAKernel`. A layer that also sets
`query_window = W > 0` first gets `layer.observe_queries(query[:, :, -W:], scaling)`: the (post-RoPE) queries of
the last `W` positions of the call, `[batch, heads, min(W, q_len), head_dim]`. From them a policy can recompute the attention of a window of recent
queries over whatever the layer holds (SnapKV, TOVA), also across decoding steps of one query each, which the summed
mass cannot give. A layer whose heads hold different numbers of slots (`key_mask()` not None,
`[batch, kv_heads, kv]`) gets its empty slots masked per head, on top of the model's mask.

A fused dequantize+attention kernel (Triton on CUDA, blockwise torch on CPU) plugs in with `register_kernel(kernel,
first=True)`: its `supports(call)` looks at `call.layer` (e.g. a layer exposing a compressed view of its storage) and
the device, and its `__call__` returns `(output [batch, q_len, heads, head_dim], mass or None)`, mass only when
`call.want_mass`. The model keeps calling the same `"hf_kvcache"` function.

A user's own loop on an sdpa model (`model(ids, past_key_values=cache)`, no `attached`) is served too: importing
`hf_kvcache` wraps transformers' `"sdpa"` entry so that a call whose layer asks for queries, mass or masks goes to
this function (`attention.plain`); every other call stays transformers' own.
"""

from .function import NAME, hf_kvcache_attention, prepare, register, unsupported, use_for_cache
from .fused import FusedCompressedKernel
from .fused import register as register_fused_kernel
from .kernels import KERNELS, QUERY_BLOCK, AttentionCall, BlockwiseTorchKernel, Kernel, TorchSDPAKernel, register_kernel
from .masks import mask_as_bool, visible_keys
from .plain import serve_plain_loops, serving
from .request import AttentionRequest, FusedView, hand_over, pending_requests, request_for

__all__ = [
    "NAME", "KERNELS", "QUERY_BLOCK", "AttentionCall", "AttentionRequest", "BlockwiseTorchKernel", "FusedCompressedKernel",
    "FusedView", "Kernel", "TorchSDPAKernel", "hand_over", "hf_kvcache_attention", "mask_as_bool", "pending_requests",
    "prepare", "register", "register_fused_kernel", "register_kernel", "request_for", "serve_plain_loops", "serving",
    "unsupported", "use_for_cache", "visible_keys",
]
