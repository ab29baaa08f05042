"""CPAC page features, similarity, and pressure-driven thresholds.

A page is `page_size` consecutive tokens of one KV head, `[P, D]`. The paper describes its features as "per-head mean
and variance, a mean-abs signature over tokens, a few DCT coefficients"; `kind` picks one of three feature sets:

- `summary` (default, the literal reading): the page's mean and variance over all its elements (two scalars), its
  signature `s[t] = mean_c |x[t, c]|` (one value per token, `[P]`), and DCT-II coefficients 1..n_dct of that signature
  (orthonormal; coefficient 0 is the signature's mean), concatenated as they are `[2 + P + n_dct]` and scaled to unit
  norm. The positive signature dominates, so most pages of a head look alike (cosine > 0.95 for nearly every pair
  of SmolLM2-135M pages): this reading barely discriminates.
- `channel`: per-channel blocks -- mean over the tokens `[D]`, variance `[D]`, mean |x| `[D]`, and DCT coefficients
  1..n_dct of every channel along the tokens `[n_dct * D]`. Each block is scaled to unit norm and the concatenation
  by `1/sqrt(blocks)`, so the dot product of two vectors is the mean of the block cosines.
- `page`: the page itself, flattened and scaled to unit norm: the cosine then says directly how small the token-wise
  delta against a base is (`|p - b|^2 = |p|^2 + |b|^2 - 2 |p| |b| cos`). Not in the paper; an improvement to try.

Features of several tensors of a page (keys and values) combine by `combine_features`: the dot product of two
combined vectors is the mean of the per-tensor cosines. Similarity of a page to a base page is that cosine times
the importance weight `1 - |imp_a - imp_b|` (importances in [0, 1]).
"""

from __future__ import annotations

import functools
import math

import torch

FEATURE_KINDS = ("summary", "channel", "page")
_EPS = 1e-12


@functools.lru_cache(maxsize=16)
def _dct_rows(page_size: int, n_dct: int, device: str) -> torch.Tensor:
    """Rows 1..n_dct of the orthonormal DCT-II matrix of size `page_size`, `[n_dct, page_size]` (at most
    `page_size - 1` rows: a page of P tokens has no more)."""
    n_dct = min(n_dct, page_size - 1)
    t = torch.arange(page_size, dtype=torch.float64) + 0.5
    k = torch.arange(1, n_dct + 1, dtype=torch.float64).unsqueeze(1)
    rows = math.sqrt(2.0 / page_size) * torch.cos(math.pi * k * t / page_size)
    return rows.to(device=device, dtype=torch.float32)


def feature_blocks(pages: torch.Tensor, n_dct: int = 4) -> dict[str, torch.Tensor]:
    """The raw `channel` feature blocks of `pages` `[..., P, D]` (mean, var, absmean, dct), each `[..., width]`."""
    x = pages.float()
    mean = x.mean(-2)
    blocks = {
        "mean": mean,
        "var": (x - mean.unsqueeze(-2)).square().mean(-2),
        "absmean": x.abs().mean(-2),
    }
    if min(n_dct, x.shape[-2] - 1) > 0:
        rows = _dct_rows(x.shape[-2], n_dct, str(x.device))
        blocks["dct"] = torch.einsum("kp,...pd->...kd", rows, x).flatten(-2)
    return blocks


def summary_features(pages: torch.Tensor, n_dct: int = 4) -> torch.Tensor:
    """The raw `summary` features of `pages` `[..., P, D]`: `[..., 2 + P + n_dct]` (mean, variance, signature, DCT)."""
    x = pages.float()
    mean = x.mean((-2, -1))
    var = (x - mean[..., None, None]).square().mean((-2, -1))
    signature = x.abs().mean(-1)
    parts = [mean.unsqueeze(-1), var.unsqueeze(-1), signature]
    if min(n_dct, x.shape[-2] - 1) > 0:
        parts.append(signature @ _dct_rows(x.shape[-2], n_dct, str(x.device)).T)
    return torch.cat(parts, dim=-1)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


def page_features(pages: torch.Tensor, n_dct: int = 4, kind: str = "summary") -> torch.Tensor:
    """Unit-norm feature vector `[..., F]` of `pages` `[..., P, D]` (see the module docstring for the kinds)."""
    if kind == "summary":
        return _unit(summary_features(pages, n_dct))
    if kind == "channel":
        blocks = [_unit(b) for b in feature_blocks(pages, n_dct).values()]
        return torch.cat(blocks, dim=-1) / math.sqrt(len(blocks))
    if kind == "page":
        return _unit(pages.float().flatten(-2))
    raise ValueError(f"unknown feature kind {kind!r}; choose one of {list(FEATURE_KINDS)}")


def combine_features(*features: torch.Tensor) -> torch.Tensor:
    """One feature vector from the features of several tensors of a page (each of unit norm): the dot product of
    two combined vectors is the mean of the per-tensor cosines."""
    if len(features) == 1:
        return features[0]
    return torch.cat(features, dim=-1) / math.sqrt(len(features))


def importance_weight(imp_a: torch.Tensor, imp_b: torch.Tensor) -> torch.Tensor:
    """`1 - |imp_a - imp_b|` for importances in [0, 1]: pages of unlike importance are made less similar."""
    return (1.0 - (imp_a - imp_b).abs()).clamp(0.0, 1.0)


def threshold_for_pressure(pressure: float, thresholds: tuple[float, ...], levels: tuple[float, ...]) -> float:
    """The similarity a page needs to be stored as a delta: `thresholds[i]` for the first `levels[i]` the pressure
    is below, the last threshold above all levels (defaults: 0.95 below 0.6, 0.85 below 0.8, 0.70 above)."""
    for level, threshold in zip(levels, thresholds):
        if pressure < level:
            return threshold
    return thresholds[len(levels)]
