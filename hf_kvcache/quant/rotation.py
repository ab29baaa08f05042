"""Orthogonal rotations of the head dimension, applied before quantizing (QuaRot / SpinQuant style).

A rotation `R` (orthogonal: `R @ R.T = I`) spreads an outlier channel over all channels, so per-token groups see a
flatter distribution. Attention only sees keys through `q @ k.T`, so a cache that stores `k @ R` must hand back
`(k @ R) @ R.T` (or rotate the queries as well); values likewise, since the output is `softmax(.) @ v`.

The rotation is a randomized Hadamard matrix `R = H_n diag(s) / sqrt(n)` with random signs `s` from a fixed seed (n a
power of two), the usual choice: exactly orthogonal, and it spreads any single channel evenly. The caches hold it as
a `HadamardRotation`: its `n` signs plus the Sylvester factors of `H_n = H_a (x) H_b` (Kronecker, `a * b = n`, each
at most `sqrt(2n)` wide), and apply it as a two-stage Walsh-Hadamard transform (`x @ H_n` is `H_a X H_b` for `x`
viewed as an `[a, b]` matrix), so no `n x n` matrix is ever held: for head_dim 256, 256 one-byte signs and one 16 x 16
float32 factor (1,280 bytes) instead of a 128 KiB bfloat16 matrix. `rotation_matrix(n)` builds the same `R` as a
dense matrix (tests, and callers that want one).
"""

from __future__ import annotations

import torch

_CACHE: dict[tuple, object] = {}


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


def random_signs(n: int, seed: int = 0) -> torch.Tensor:
    """The `n` signs (+-1, float64) of the randomized Hadamard rotation of size `n` and `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1


def rotation_matrix(
    n: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Orthogonal `[n, n]` randomized Hadamard matrix `H_n diag(s) / sqrt(n)` (cached per size, seed, dtype, device)."""
    device = torch.device(device)
    key = (n, seed, dtype, device)
    r = _CACHE.get(key)
    if r is None:
        r = (hadamard_matrix(n, torch.float64) * random_signs(n, seed) / n**0.5).to(dtype=dtype, device=device)
        r = _CACHE[key] = r.contiguous()
    return r


def _factor(n: int, device: torch.device) -> torch.Tensor:
    """`H_n` in float32 on `device`, one tensor per process (the keys' and values' rotations share it)."""
    key = ("factor", n, device)
    h = _CACHE.get(key)
    if h is None:
        h = _CACHE[key] = hadamard_matrix(n).to(device)
    return h


# from this many vectors on, `HadamardRotation._transform` takes the outer factor as one matrix product
_ONE_PRODUCT_ROWS = 64


class HadamardRotation:
    """`R = H_n diag(s) / sqrt(n)` held as its signs (int8 `[n]`) and the Sylvester factors `H_a`, `H_b` (float32,
    `a * b = n`; one tensor when `a == b`, shared by every rotation of that size), applied by a Walsh-Hadamard
    transform in float32. `rotate(x)` is `x @ R`, `unrotate(x)` is `x @ R.T`, both along the last dim, exact up to
    float32 rounding."""

    def __init__(self, n: int, seed: int = 0, device: torch.device | str = "cpu") -> None:
        if not is_power_of_two(n):
            raise ValueError(f"a Hadamard rotation needs a power-of-two size (a head_dim like 64, 128 or 256), got {n}")
        device = torch.device(device)
        self.n, self.seed = n, seed
        self.signs = random_signs(n, seed).to(device=device, dtype=torch.int8)
        b = 1 << ((n.bit_length() - 1 + 1) // 2)  # the inner factor: 2^ceil(log2(n) / 2)
        self.inner = _factor(b, device)
        self.outer = _factor(n // b, device)
        self.scale = 1.0 / n**0.5

    def tensors(self) -> list[torch.Tensor]:
        """What it holds (for the bytes a cache counts)."""
        return [self.signs, self.inner] + ([] if self.outer is self.inner else [self.outer])

    def _transform(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ H_n / sqrt(n)` in float32 along the last dim (x viewed as `[a, b]`: `H_a X H_b`)."""
        if x.shape[-1] != self.n:
            raise ValueError(f"a rotation of size {self.n} cannot rotate a last dim of {x.shape[-1]}")
        a, b = self.outer.shape[0], self.inner.shape[0]
        y = x.float().reshape(-1, a, b) @ self.inner
        if y.shape[0] < _ONE_PRODUCT_ROWS:
            return torch.matmul(self.outer, y).reshape(x.shape).mul_(self.scale)
        # H_a times every row's [a, b] block as one product `[a, a] @ [a, rows * b]` (torch's broadcast matmul would
        # run one small product a row): the same sums, the same bits
        y = (self.outer @ y.transpose(0, 1).reshape(a, -1)).view(a, -1, b).transpose(0, 1)
        return y.reshape(x.shape).mul_(self.scale)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ R` (float32)."""
        return self._transform(x).mul_(self.signs)

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ R.T` (float32), the inverse of `rotate`."""
        return self._transform(x.float() * self.signs)

    def matrix(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense `[n, n]` matrix `R` (built on demand, not held)."""
        return self.rotate(torch.eye(self.n, device=self.signs.device)).to(dtype)


def hadamard_rotation(n: int, seed: int = 0, device: torch.device | str = "cpu") -> HadamardRotation:
    """The `HadamardRotation` of size `n` and `seed` on `device`, one object per process (every layer shares it)."""
    device = torch.device(device)
    key = ("transform", n, seed, device)
    r = _CACHE.get(key)
    if r is None:
        r = _CACHE[key] = HadamardRotation(n, seed, device)
    return r


Rotation = torch.Tensor | HadamardRotation


def rotate(x: torch.Tensor, r: Rotation) -> torch.Tensor:
    """`x @ r` along the last dim (`r` a matrix, in x's dtype, or a `HadamardRotation`, in float32)."""
    if isinstance(r, HadamardRotation):
        return r.rotate(x)
    return torch.matmul(x, r.to(x.dtype))


def unrotate(x: torch.Tensor, r: Rotation, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ r.T`, the inverse of `rotate` (written into `out` when given)."""
    y = r.unrotate(x) if isinstance(r, HadamardRotation) else torch.matmul(x, r.to(x.dtype).t())
    if out is None:
        return y
    out.copy_(y)
    return out
