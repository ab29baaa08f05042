"""Random keys/values streamed through a cache, and random per-token segments: shared by the cache and kernel unit
tests (importable because pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch


def stream_random(cache, chunks, batch: int, heads: int, dim: int, layers: int, seed: int = 0):
    """Feed `[batch, heads, n, dim]` random keys and values for each `n` in `chunks` through every layer of `cache`
    (the same tensors for every layer); return all keys and values fed, concatenated along the tokens."""
    torch.manual_seed(seed)
    ks, vs = [], []
    for n in chunks:
        k, v = torch.randn(batch, heads, n, dim), torch.randn(batch, heads, n, dim)
        for layer in range(layers):
            cache.update(k, v, layer)
        ks.append(k)
        vs.append(v)
    return torch.cat(ks, 2), torch.cat(vs, 2)


def token_segment(b, h, t, d, dtype="int4", group_size=None, symmetric=None, prerope=False, pad=(0,), seed=0,
                  start=0):
    """A `TokenSegment` of the uniform cache's codes; with `prerope`, keys normalized pre-RoPE with statistics per row
    and each row's true positions (`start` plus the index minus its left padding `pad`)."""
    from hf_kvcache.caches.uniform import UniformPreRopeKeys, UniformQuantOptions
    from hf_kvcache.kernels.segments import TokenSegment
    from hf_kvcache.rope import KeyRotation

    g = torch.Generator().manual_seed(seed)
    options = UniformQuantOptions(dtype=dtype, group_size=group_size, symmetric=symmetric)
    options.validate()
    k = torch.randn(b, h, t, d, generator=g) + 4 * torch.randn(1, h, 1, d, generator=g)  # channel offsets
    v = torch.randn(b, h, t, d, generator=g)
    if not prerope:
        return TokenSegment(options.quantize(k), options.quantize(v))
    rope = KeyRotation(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), attention_scaling=1.25)
    codec = UniformPreRopeKeys(rope, options.bits, scale_power=0.5, per_row=True, options=options)
    positions = (start + torch.arange(t)[None] - torch.tensor(pad)[:, None]).unsqueeze(1)  # [b or 1, 1, t]
    pre = codec.derotate(k, positions)
    codec.fit(pre)
    return TokenSegment(codec.quantize_pre(pre), options.quantize(v), codec, positions)
