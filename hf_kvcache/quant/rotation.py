"""Orthogonal rotations of the head dimension, applied before quantizing (QuaRot / SpinQuant style).

A rotation `R` (orthogonal: `R @ R.T = I`) spreads an outlier channel over all channels, so per-token groups see a
flatter distribution. Attention only sees keys through `q @ k.T`, so a cache that stores `k @ R` must hand back
`(k @ R) @ R.T` (or rotate the queries as well); values likewise, since the output is `softmax(.) @ v`.

`rotation_matrix(n)` is a randomized Hadamard matrix `H_n diag(s) / sqrt(n)` with random signs `s` from a fixed seed
(n a power of two), the usual choice: it is cheap, exactly orthogonal and spreads any single channel evenly.
"""

from __future__ import annotations

import torch

_CACHE: dict[tuple, torch.Tensor] = {}


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sylvester Hadamard matrix of size `n` (a power of two), entries +-1, not normalized."""
    if not is_power_of_two(n):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(dtype)


def rotation_matrix(
    n: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Orthogonal `[n, n]` randomized Hadamard matrix (cached per size, seed, dtype and device)."""
    device = torch.device(device)
    key = (n, seed, dtype, device)
    r = _CACHE.get(key)
    if r is None:
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
        r = (hadamard_matrix(n, torch.float64) * signs / n**0.5).to(dtype=dtype, device=device).contiguous()
        _CACHE[key] = r
    return r


def unrotation_matrix(
    n: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The transpose (= inverse) of `rotation_matrix(n, seed)`, contiguous, in `dtype` (cached like it)."""
    device = torch.device(device)
    key = ("inverse", n, seed, dtype, device)
    r = _CACHE.get(key)
    if r is None:
        r = _CACHE[key] = rotation_matrix(n, seed, torch.float32, device).t().to(dtype).contiguous()
    return r


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """`x @ r` along the last dim."""
    return torch.matmul(x, r.to(x.dtype))


def unrotate(x: torch.Tensor, r: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ r.T`, the inverse of `rotate` (written into `out` when given)."""
    rt = r.to(x.dtype).t()
    if out is None:
        return torch.matmul(x, rt)
    out.copy_(torch.matmul(x, rt))
    return out
