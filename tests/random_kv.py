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


def subspace_case(b: int, t: int, rows: int, d: int, prerope: bool, full_8bit: bool = False):
    """(queries [b, 2, rows, d], a `SubspaceSegment` of t tokens, key_valid [b, t]): keys and values in eight
    subspaces each, of odd and even sizes (codes ending inside a packed word) and every width 1-8, ranks below the
    head dim, the second row left-padded over whole chunks and part of a key group. `full_8bit`: instead every
    direction kept at 8 bits (rows of d bytes)."""
    from hf_kvcache.kernels.segments import SubspaceSegment
    from hf_kvcache.quant.subspace import fit_subspace, quantize_subspace_rows
    from hf_kvcache.rope import KeyRotation

    g, h = torch.Generator().manual_seed(11), 2
    k = torch.randn(b, h, t, d, generator=g) * torch.linspace(0.2, 3.0, d)
    v = torch.randn(b, h, t, d, generator=g)
    if full_8bit:
        keys = quantize_subspace_rows(k, fit_subspace(k, rank=d), 8, d // 8, rank=d, axis="channel", token_group=64)
        values = quantize_subspace_rows(v, fit_subspace(v, rank=d), 8, d // 8, rank=d, axis="token")
    else:
        keys = quantize_subspace_rows(k, fit_subspace(k, rank=d - 8), (8, 5, 4, 3, 2, 1, 6, 7), d // 8 - 1,
                                      rank=d - 8, axis="channel", token_group=64)
        values = quantize_subspace_rows(v, fit_subspace(v, rank=d - 16), (1, 2, 3, 4, 5, 6, 7, 2), d // 8 - 2,
                                        rank=d - 16, axis="token")
    rope = KeyRotation(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), 1.25) if prerope else None
    q = torch.randn(b, h, rows, d, generator=g) / d**0.5
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :150] = False
    return q, SubspaceSegment(keys, values, rope, start=37), valid
