"""CPAC page features, similarity, pressure-driven thresholds, and the RoPE key space.

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

Keys reach the cache after RoPE: the key of position t is R(t) k_t. Two pages of the same content at different
positions differ by a rotation, which neither the features nor a token-wise delta can see through. `KeyRotation`
undoes it (R(-t)) so that features and deltas can be computed on position-free keys, and redoes it on decompression;
it is exact up to float rounding (R is orthogonal).
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


# ---- RoPE key space --------------------------------------------------------------------------------------------------
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KeyRotation:
    """Llama-style RoPE (`rotate_half` layout) of a model config, applied or undone at given token positions.

    Positions are cache indices (0 for the first token the layer holds). With left padding the true positions are
    shifted by a constant per row; undoing and redoing the rotation at the same index is still exact, and the
    shared offset does not change how pages of a row compare.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.float()
        self.scaling = float(attention_scaling)

    @classmethod
    def from_config(cls, config, head_dim: int | None = None) -> "KeyRotation":
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        params = dict(getattr(text, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE:
            raise ValueError(
                f"key_space='derotated' supports rope types {list(SUPPORTED_ROPE)}, not {rope_type!r}; "
                "use key_space='rotated'"
            )
        head_dim = head_dim or getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if rope_type == "default":
            base = params.get("rope_theta", getattr(text, "rope_theta", None))
            if base is None:
                raise ValueError("key_space='derotated' needs rope_theta in the model config")
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text)
        if 2 * inv_freq.numel() != head_dim:
            raise ValueError(
                f"key_space='derotated' needs RoPE over the whole head (head_dim={head_dim}, rotary dims="
                f"{2 * inv_freq.numel()}); use key_space='rotated'"
            )
        return cls(inv_freq, scaling)

    def _cos_sin(self, start: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, dtype=torch.float32, device=device)
        freqs = pos.unsqueeze(1) * self.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Apply RoPE to `x` `[..., T, D]` whose tokens sit at positions start..start+T-1 (fp32 result)."""
        cos, sin = self._cos_sin(start, x.shape[-2], x.device)
        x = x.float()
        return (x * cos + _rotate_half(x) * sin) * self.scaling

    def derotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Undo `rotate` (fp32 result)."""
        cos, sin = self._cos_sin(start, x.shape[-2], x.device)
        x = x.float()
        return (x * cos - _rotate_half(x) * sin) / self.scaling
