"""Subspace archive quantization (the ADR's SQuat slot): quantize keys/values in a fitted orthogonal basis.

Per KV head, `fit_subspace` computes the mean and the covariance of calibration vectors and its eigendecomposition
(PCA, `torch.linalg.eigh`); the basis keeps the `rank` leading directions (descending eigenvalue) and their standard
deviations `sigma = sqrt(eigenvalue)`. Quantization of `x` `[batch, kv_heads, tokens, dim]`:

1. coefficients `c = (x - mean) @ basis` `[..., tokens, rank]`, whitened `z = c / sigma`;
2. the `rank` directions are split into subspaces of `group_size` consecutive directions (leading ones first); each
   subspace gets its own bit width (`bits` an int, or one per subspace, e.g. more bits for the top directions) and
   (`axis="token"`, the default) per token an fp16 scale `s = rms(z over the subspace)`;
3. `z / s` is quantized by a symmetric mid-rise uniform quantizer with `2**b` levels whose step is the MSE-optimal
   one for a unit Gaussian (`gaussian_step(b)`), clamped at the outer levels; codes packed with `quant.packing`.
   With `axis="channel"` (better for keys) steps 2-3 are instead KIVI's per-channel min/max quantization of each
   direction over groups of `token_group` tokens (fp16 scale and zero `[..., tokens // token_group, n_g]`).

Dequantization: `x ~ ((code - L/2 + 1/2) * step * s * sigma) @ basis.T + mean`. Directions beyond `rank` are
dropped (reconstructed as the mean): rank truncation is how this reaches extreme ratios. The basis is stored in fp16
and used in fp16 both ways, so `tensors()` (basis, mean and sigma included) is exactly what decoding needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from .kivi import KIVIQuantized, dequantize_kivi, quantize_kivi
from .packing import pack_bits, packed_length, unpack_bits
from .rows import TokenRows

_F16 = torch.float16


# gaussian_step_numeric(b) for b = 1..8 (100001-point grid on [-10, 10], golden-section search), rounded to 5 digits
_GAUSSIAN_STEPS = (1.59577, 0.99569, 0.58605, 0.33523, 0.18814, 0.10406, 0.05687, 0.03076)


def gaussian_step(bits: int) -> float:
    """MSE-optimal step of a symmetric mid-rise uniform quantizer with `2**bits` levels for N(0, 1) (tabulated)."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    return _GAUSSIAN_STEPS[bits - 1]


@lru_cache(maxsize=None)
def gaussian_step_numeric(bits: int, points: int = 100_001) -> float:
    """`gaussian_step` computed: minimize the quantizer's expected squared error on a grid (golden-section search)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits!r}")
    z = torch.linspace(-10, 10, points, dtype=torch.float64)
    p = torch.exp(-0.5 * z * z)
    p = p / p.sum()
    n = 2**bits

    def mse(step: float) -> float:
        q = (torch.floor(z / step) + n // 2).clamp(0, n - 1)
        return float((((q - n // 2 + 0.5) * step - z) ** 2 * p).sum())

    lo, hi = 0.005, 2.5  # the error is unimodal in the step: golden-section search
    r = (5**0.5 - 1) / 2
    a, b = hi - r * (hi - lo), lo + r * (hi - lo)
    fa, fb = mse(a), mse(b)
    for _ in range(60):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - r * (hi - lo)
            fa = mse(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + r * (hi - lo)
            fb = mse(b)
    return (lo + hi) / 2


@dataclass
class SubspaceBasis:
    """Per-KV-head PCA basis: mean fp16 `[kv_heads, dim]`, basis fp16 `[kv_heads, dim, rank]` (columns, descending
    eigenvalue), sigma fp16 `[kv_heads, rank]` (sqrt of the eigenvalues, floored), explained: fp32 `[kv_heads, dim]`
    fraction of the variance in the leading directions (cumulative; fit-time information, not needed to decode)."""

    mean: torch.Tensor
    basis: torch.Tensor
    sigma: torch.Tensor
    explained: torch.Tensor

    @property
    def rank(self) -> int:
        return self.basis.shape[-1]

    @property
    def dim(self) -> int:
        return self.basis.shape[-2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.mean, self.basis, self.sigma]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


def fit_subspace(calib_x: torch.Tensor, rank: int | None = None, center: bool = True) -> SubspaceBasis:
    """PCA basis per KV head of `calib_x` `[batch, kv_heads, tokens, dim]` (pre-RoPE keys or values).

    rank: directions kept (default all `dim`); center: subtract the per-head mean first (else mean = 0).
    """
    if calib_x.dim() != 4 or not torch.is_floating_point(calib_x):
        raise ValueError(f"calib_x must be a float [batch, kv_heads, tokens, dim] tensor, got {tuple(calib_x.shape)}")
    b, h, t, d = calib_x.shape
    rank = d if rank is None else rank
    if not isinstance(rank, int) or not 1 <= rank <= d:
        raise ValueError(f"rank must be an integer in 1..{d} (head_dim), got {rank!r}")
    x = calib_x.double().transpose(0, 1).reshape(h, b * t, d)
    mean = x.mean(1) if center else torch.zeros(h, d, dtype=x.dtype)
    xc = x - mean[:, None]
    cov = xc.transpose(1, 2) @ xc / max(b * t, 1)
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    evals, evecs = evals.flip(-1).clamp_min(0), evecs.flip(-1)
    explained = evals.cumsum(-1) / evals.sum(-1, keepdim=True).clamp_min(1e-30)
    # a direction with (numerically) zero variance still needs a usable scale
    floor = evals[:, :1].clamp_min(1e-30) * 1e-8
    sigma = evals[:, :rank].clamp_min(floor).sqrt()
    return SubspaceBasis(
        mean.to(_F16).contiguous(),
        evecs[:, :, :rank].to(_F16).contiguous(),
        sigma.clamp(6.2e-5, 6.0e4).to(_F16).contiguous(),
        explained.float(),
    )


@dataclass
class SubspaceQuantized:
    """One `[batch, kv_heads, tokens, dim]` tensor in a subspace basis.

    codes: one packed uint8 tensor per subspace `[..., tokens, packed(n_g)]`; scale: one fp16 tensor per subspace,
    `[..., tokens, 1]` with `axis="token"` (rms of the whitened coefficients), `[..., tokens // token_group, n_g]` with
    `axis="channel"` (KIVI per-direction step); zero: per subspace, `axis="channel"` only (else empty); basis: the
    shared `SubspaceBasis`; bits: per subspace; bounds: the subspaces' (start, stop) directions.
    """

    codes: list[torch.Tensor]
    scale: list[torch.Tensor]
    zero: list[torch.Tensor]
    basis: SubspaceBasis
    bits: tuple[int, ...]
    bounds: tuple[tuple[int, int], ...]
    rank: int
    axis: str
    token_group: int

    @property
    def tokens(self) -> int:
        return self.codes[0].shape[-2]

    def data_tensors(self) -> list[torch.Tensor]:
        """The per-block tensors (everything but the shared basis)."""
        return [*self.codes, *self.scale, *self.zero]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor needed to decode, the basis included (shared by all blocks of a layer: count it once)."""
        return self.data_tensors() + self.basis.tensors()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


def subspace_plan(rank: int, group_size: int, bits: int | Sequence[int]
                  ) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """The subspaces of `rank` directions in groups of `group_size`: their (start, stop) bounds and bits each (`bits`:
    one width for all, or one per subspace, checked)."""
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size (directions per subspace) must be a positive integer, got {group_size!r}")
    bounds = tuple((s, min(s + group_size, rank)) for s in range(0, rank, group_size))
    bl = (bits,) * len(bounds) if isinstance(bits, int) else tuple(bits)
    if len(bl) != len(bounds):
        raise ValueError(
            f"bits gives {len(bl)} widths but rank {rank} in subspaces of {group_size} makes {len(bounds)}; pass an "
            "int or one width per subspace"
        )
    for b in bl:
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= 8:
            raise ValueError(f"every subspace's bits must be an integer in 1..8, got {bits!r}")
    return bounds, bl


def quantize_subspace(
    x: torch.Tensor,
    basis: SubspaceBasis,
    bits: int | Sequence[int],
    group_size: int = 32,
    rank: int | None = None,
    axis: str = "token",
    token_group: int = 64,
) -> SubspaceQuantized:
    """Quantize `x` `[batch, kv_heads, tokens, dim]` in `basis` (see the module docstring).

    bits: one width, or one per subspace of `group_size` directions (leading directions first, e.g. `(3, 2)`);
    rank: directions kept (<= basis.rank; default all of the basis);
    axis: `"token"`: per token and subspace an fp16 rms scale, Gaussian-optimal uniform step (no token grouping);
    `"channel"`: KIVI's per-channel min/max quantization of each direction's coefficients in groups of
    `token_group` tokens (tokens must be a multiple of it) -- better for keys, whose directions keep their range.
    """
    if x.dim() != 4 or not torch.is_floating_point(x):
        raise ValueError(f"x must be a float [batch, kv_heads, tokens, dim] tensor, got {tuple(x.shape)}")
    if x.shape[1] != basis.basis.shape[0] or x.shape[-1] != basis.dim:
        raise ValueError(
            f"basis is for {basis.basis.shape[0]} KV heads of dim {basis.dim}, x is {tuple(x.shape)}: fit it on this "
            "layer's data"
        )
    if axis not in ("token", "channel"):
        raise ValueError(f"axis={axis!r} is not valid; choose 'token' (per-token scales) or 'channel' (per direction)")
    rank = basis.rank if rank is None else rank
    if not isinstance(rank, int) or not 1 <= rank <= basis.rank:
        raise ValueError(f"rank must be an integer in 1..{basis.rank} (the basis rank), got {rank!r}")
    bounds, bl = subspace_plan(rank, group_size, bits)
    v = basis.basis[:, :, :rank].float()  # [H, D, r]
    z = ((x.float() - basis.mean.float()[None, :, None]) @ v[None]) / basis.sigma[:, :rank].float()[None, :, None]
    codes, scales, zeros = [], [], []
    for (s, e), b in zip(bounds, bl):
        zg = z[..., s:e]
        if axis == "channel":
            kq = quantize_kivi(zg.contiguous(), b, token_group, "channel")
            codes.append(kq.codes)
            scales.append(kq.scale)
            zeros.append(kq.zero)
            continue
        sc = zg.square().mean(-1, keepdim=True).sqrt().clamp_min(6.2e-5).to(_F16)
        n = 2**b
        step = sc.float() * gaussian_step(b)
        q = (torch.floor(zg / step) + n // 2).clamp_(0, n - 1).to(torch.uint8)
        codes.append(pack_bits(q, b))
        scales.append(sc.contiguous())
    return SubspaceQuantized(codes, scales, zeros, basis, bl, bounds, rank, axis, token_group)


def dequantize_subspace(q: SubspaceQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruction `[batch, kv_heads, tokens, dim]` of what `q` was made from."""
    parts = []
    for i, ((s, e), b) in enumerate(zip(q.bounds, q.bits)):
        if q.axis == "channel":
            kq = KIVIQuantized(q.codes[i], q.scale[i], q.zero[i], b, q.token_group, "channel", e - s)
            parts.append(dequantize_kivi(kq))
            continue
        n = 2**b
        c = unpack_bits(q.codes[i], b, e - s).float()
        parts.append((c - (n // 2 - 0.5)) * (q.scale[i].float() * gaussian_step(b)))
    z = torch.cat(parts, -1) * q.basis.sigma[:, : q.rank].float()[None, :, None]
    v = q.basis.basis[:, :, : q.rank].float()
    return (z @ v.transpose(-1, -2)[None] + q.basis.mean.float()[None, :, None]).to(dtype)


@dataclass
class SubspaceRows(TokenRows):
    """A `SubspaceQuantized` with its subspaces side by side, one tensor per field, laid out in token-aligned rows
    (`quant.rows.TokenRows`): slicing along tokens, concatenation and batch mapping (beam reordering) work as for
    the other formats, and the codec flattens it like any dataclass of tensors. The tiered cache's subspace archive
    stores this.

    codes: uint8 `[..., tokens, sum of packed(n_g)]`; scale: fp16 `[..., tokens, subspaces]` (axis "token") or
    `[..., tokens // token_group, rank]` (axis "channel"); zero: fp16 `[..., tokens // token_group, rank]` (channel)
    or `[..., tokens, 0]` (token); basis: the shared `SubspaceBasis`; bits, bounds, rank, axis, token_group: as in
    `SubspaceQuantized`.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    basis: SubspaceBasis
    bits: tuple
    bounds: tuple
    rank: int
    axis: str
    token_group: int
    nominal_bits: int = 0  # the average width an allocation (`allocate_bits`) spread over the subspaces (0: bits[0])

    def __post_init__(self) -> None:  # JSON (the codec) gives lists back
        self.bits = tuple(int(b) for b in self.bits)
        self.bounds = tuple((int(s), int(e)) for s, e in self.bounds)

    def row_fields(self) -> dict[str, int]:
        per = self.token_group if self.axis == "channel" else 1
        return {"codes": 1, "scale": per, "zero": per}

    def shared(self) -> tuple:
        return (self.basis,)

    def data_tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale, self.zero]

    def tensors(self) -> list[torch.Tensor]:
        """Everything needed to decode, the basis included (shared by every block of a layer)."""
        return self.data_tensors() + self.basis.tensors()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    @classmethod
    def of(cls, q: SubspaceQuantized) -> "SubspaceRows":
        lead = q.codes[0].shape[:-1]
        zero = torch.cat(q.zero, -1) if q.zero else q.scale[0].new_zeros(*lead, 0)
        return cls(torch.cat(q.codes, -1), torch.cat(q.scale, -1), zero, q.basis, q.bits, q.bounds, q.rank, q.axis,
                   q.token_group)

    def split(self) -> SubspaceQuantized:
        """The per-subspace form `dequantize_subspace` reads (views)."""
        codes, scales, zeros, c = [], [], [], 0
        for i, ((s, e), b) in enumerate(zip(self.bounds, self.bits)):
            n = packed_length(e - s, b)
            codes.append(self.codes[..., c : c + n])
            c += n
            if self.axis == "channel":
                scales.append(self.scale[..., s:e])
                zeros.append(self.zero[..., s:e])
            else:
                scales.append(self.scale[..., i : i + 1])
        return SubspaceQuantized(codes, scales, zeros, self.basis, self.bits, self.bounds, self.rank, self.axis,
                                 self.token_group)


# expected squared error per unit variance for 0..8 bits (0 bits: the direction is dropped, read back as its mean):
# the Gaussian-optimal uniform quantizer of axis "token" (`gaussian_step`), and KIVI's min/max quantizer of axis
# "channel" over groups of 64 Gaussian samples (range about 5 sigma, error step**2 / 12: its 1 bit is worse than none)
GAUSSIAN_MSE = (1.0, 0.3634, 0.1175, 0.03744, 0.01154, 0.00349, 0.00104, 0.000307, 0.0000890)
MINMAX_MSE = (1.0, 2.08, 0.231, 0.0425, 0.00926, 0.00216, 0.000525, 0.000129, 0.0000320)


def allocate_bits(basis: SubspaceBasis, budget: int, group_size: int, axis: str = "token",
                  max_bits: int = 8) -> tuple[int, ...]:
    """Bit widths per subspace of `group_size` consecutive directions spending at most `budget` code bits per token,
    by greedy reverse water-filling on the basis' variances (averaged over KV heads, each head's normalized to sum
    1): each step gives one or two more bits to the subspace whose expected error (`GAUSSIAN_MSE` / `MINMAX_MSE` by
    `axis`) drops most per bit. Widths come out non-increasing; trailing subspaces may get 0 bits (drop them: the
    rank of the codes)."""
    mse = MINMAX_MSE if axis == "channel" else GAUSSIAN_MSE
    var = basis.sigma.float().square()
    var = (var / var.sum(-1, keepdim=True).clamp_min(1e-30)).mean(0)  # [rank]
    bounds = [(s, min(s + group_size, var.numel())) for s in range(0, var.numel(), group_size)]
    energy = [float(var[s:e].sum()) for s, e in bounds]
    bits = [0] * len(bounds)
    left = budget
    while True:
        best, gain = None, 0.0
        for j, (s, e) in enumerate(bounds):
            for step in (1, 2):
                b, cost = bits[j] + step, step * (e - s)
                if b > max_bits or cost > left:
                    continue
                g = energy[j] * (mse[bits[j]] - mse[b]) / cost
                if g > gain:
                    best, gain = (j, step), g
        if best is None:
            break
        j, step = best
        bits[j] += step
        left -= step * (bounds[j][1] - bounds[j][0])
    for j in range(1, len(bits)):  # keep widths non-increasing (a dropped subspace is never followed by a kept one)
        bits[j] = min(bits[j], bits[j - 1])
    return tuple(bits)


def quantize_subspace_rows(x: torch.Tensor, basis: SubspaceBasis, bits: int | Sequence[int], group_size: int = 32,
                           rank: int | None = None, axis: str = "token", token_group: int = 64) -> SubspaceRows:
    """`quantize_subspace` in the token-aligned form (`SubspaceRows`)."""
    return SubspaceRows.of(quantize_subspace(x, basis, bits, group_size, rank, axis, token_group))


def dequantize_subspace_rows(q: SubspaceRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_subspace(q.split(), dtype)


def bytes_per_element(q: SubspaceQuantized, include_basis: bool = True) -> float:
    """Bytes held per element of the original `[..., tokens, dim]` tensor (basis included unless told otherwise)."""
    n = q.codes[0].shape[:-1].numel() * q.basis.dim
    ts = q.tensors() if include_basis else q.data_tensors()
    return sum(t.nbytes for t in ts) / max(n, 1)


__all__ = [
    "SubspaceBasis",
    "SubspaceQuantized",
    "SubspaceRows",
    "dequantize_subspace_rows",
    "quantize_subspace_rows",
    "bytes_per_element",
    "dequantize_subspace",
    "fit_subspace",
    "gaussian_step",
    "gaussian_step_numeric",
    "quantize_subspace",
    "subspace_plan",
]
