"""Random keys/values streamed through a cache: shared by the cache unit tests (importable because pytest puts this
folder on sys.path)."""

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
