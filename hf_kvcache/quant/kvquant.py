"""KVQuant-style archive quantization (Hooper et al. 2024, "KVQuant: Towards 10 Million Context Length LLM
Inference with KV Cache Quantization"): pre-RoPE per-channel keys, per-token values, non-uniform levels fitted on
calibration data (nuq) and dense-and-sparse outliers.

Tensors are `[..., tokens, dim]` (a cache layer's `[batch, kv_heads, tokens, head_dim]`; GQA needs nothing special,
everything is per KV head). The pipeline for one tensor:

1. **RoPE** (keys only, done by the caller): `undo_rope(k, cos, sin)` turns the post-RoPE keys transformers hands to
   `Cache.update` back into pre-RoPE keys, whose outlier channels are fixed (RoPE rotates channel pairs by a
   position-dependent angle and smears them); `apply_rope` re-applies it after dequantization. `rope_cos_sin` builds
   the default (unscaled) cos/sin for tests and offline use.
2. **Outliers** (dense-and-sparse): every token keeps its `k` most extreme entries (largest `|x - mean| / std`, the
   statistics taken along the normalization axis) exactly in fp16, with their channel index (uint8 when
   `dim <= 256`, else int16). `k = max(1, round(outlier_frac * dim))`, a fixed count per token, so the sparse part
   stays token-aligned (`outlier_idx`/`outlier_val` are `[..., tokens, k]`).
3. **Normalization**: the remaining (dense) entries are mapped to [-1, 1] by `u = (x - offset) / scale` with
   `offset = (max + min) / 2`, `scale = (max - min) / 2` over the dense entries of a group, both fp16:
   `axis="channel"` (keys): per channel, per group of `group_size` tokens, `scale`/`offset` `[..., tokens // gs, dim]`;
   `axis="token"` (values): per token, per group of `group_size` channels, `[..., tokens, dim // gs]`.
4. **nuq**: `u` is rounded to the nearest of `2**bits` levels of a `NUQCodebook` (levels `[kv_heads, dim or 1,
   2**bits]` fp16, fitted by `fit_codebook` with 1-D k-means / Lloyd iterations on normalized calibration data, per
   KV head and channel, the outer levels pinned at -1/+1, optionally weighted by a sensitivity such as
   `attention_sensitivity`), codes packed along `dim` with `quant.packing`.

At read time the archived keys need the cos/sin of their own positions again: recompute them from the positions
(the model's rotary embedding, or `rope_cos_sin`) rather than storing them, or count them in the bytes held.

`NUQQuantized.tensors()` lists everything needed to decode, the codebook included; since one codebook serves every
block of a layer, `data_tensors()` lists the per-block part only (count the codebook once per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..rope import rotate_half
from .packing import pack_bits, unpack_bits
from .rows import TokenRows
from .kivi import CLIP_GRID
from .uniform import scale_to_fp16

AXES = ("channel", "token")
_F16 = torch.float16
_MIN_SCALE = 2.0**-14  # smallest normal fp16: a constant group still gets a usable scale


# ---------------------------------------------------------------------------------------------------------------- RoPE
def _rope_args(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if k.dim() < 2 or k.shape[-1] % 2:
        raise ValueError(f"keys must be [..., tokens, head_dim] with an even head_dim, got {tuple(k.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if cos.shape[-2:] != k.shape[-2:]:
        raise ValueError(
            f"cos/sin end in {tuple(cos.shape[-2:])} but keys in {tuple(k.shape[-2:])}: pass the cos/sin of exactly "
            "these tokens ([batch, tokens, head_dim] as in cache_kwargs, sliced to the same tokens)"
        )
    if cos.dim() == 3 and k.dim() == 4:  # [batch, tokens, dim] -> broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return cos.float(), sin.float()


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it: `k * cos + rotate_half(k) * sin`.

    k: `[batch, heads, tokens, head_dim]` (or `[..., tokens, head_dim]`); cos/sin: `[batch, tokens, head_dim]` as in
    `cache_kwargs` (or anything broadcastable ending in `[tokens, head_dim]`). Computed in fp32, returned in k.dtype.
    """
    cos, sin = _rope_args(k, cos, sin)
    kf = k.float()
    return (kf * cos + rotate_half(kf) * sin).to(k.dtype)


def undo_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` (same shapes): `(k * cos - rotate_half(k) * sin) / (cos**2 + sin**2)`.

    The division makes it exact for RoPE variants that scale cos/sin (an `attention_scaling` != 1).
    """
    cos, sin = _rope_args(k, cos, sin)
    kf = k.float()
    return ((kf * cos - rotate_half(kf) * sin) / (cos * cos + sin * sin)).to(k.dtype)


def rope_cos_sin(
    positions: torch.Tensor | int, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) RoPE cos/sin `[1, tokens, head_dim]` for `positions` (an int n means 0..n-1)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    pos = torch.arange(positions) if isinstance(positions, int) else positions
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)


# ---------------------------------------------------------------------------------------------- normalization/outliers
def outlier_count(dim: int, outlier_frac: float) -> int:
    """Outliers kept per token: `max(1, round(outlier_frac * dim))`, or 0 when `outlier_frac == 0`."""
    if not 0.0 <= outlier_frac < 0.5:
        raise ValueError(f"outlier_frac must be in [0, 0.5), got {outlier_frac!r} (0.01 is KVQuant's 1 %)")
    return 0 if outlier_frac == 0 else max(1, round(outlier_frac * dim))


def _check_axis(axis: str, group_size: int | None) -> None:
    if axis not in AXES:
        raise ValueError(f"axis={axis!r} is not valid; choose 'channel' (keys) or 'token' (values)")
    if group_size is not None and (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0):
        raise ValueError(f"group_size must be a positive integer or None (one group), got {group_size!r}")


def _group_size(x: torch.Tensor, axis: str, group_size: int | None) -> int:
    tokens, dim = x.shape[-2], x.shape[-1]
    if axis == "channel":
        gs = tokens if group_size is None else group_size
        if tokens % gs:
            raise ValueError(
                f"per-channel groups need whole groups of tokens: got {tokens} tokens, group_size={gs}; quantize a "
                f"multiple of {gs} tokens or pass group_size=None (one group)"
            )
        return gs
    gs = dim if group_size is None else group_size
    if dim % gs:
        raise ValueError(f"group_size={gs} must divide the last dim {dim}; choose a divisor of {dim} or None")
    return gs


def _gview(x: torch.Tensor, axis: str, gs: int) -> tuple[torch.Tensor, int]:
    """`x` with one dim holding the elements of a normalization group; returns (view, that dim)."""
    *lead, tokens, dim = x.shape
    if axis == "channel":
        return x.reshape(*lead, tokens // gs, gs, dim), -2
    return x.reshape(*lead, tokens, dim // gs, gs), -1


def _normalize(x: torch.Tensor, axis: str, gs: int, k: int):
    """Split fp32 `x` [..., T, D] into outliers and normalized dense values.

    Returns `u` [..., T, D] in [-1, 1] (0 at outliers), the dense mask, fp16 scale/offset (group shapes), and the
    outliers' indices (int64 [..., T, k]) and fp16 values.
    """
    g, red = _gview(x, axis, gs)
    mask = torch.ones_like(x, dtype=torch.bool)
    if k:
        mu = g.mean(red, keepdim=True)
        sd = g.std(red, keepdim=True, unbiased=False).clamp_min(1e-12) if g.shape[red] > 1 else torch.ones_like(mu)
        z = ((g - mu).abs() / sd).reshape(x.shape)
        idx = z.topk(k, dim=-1).indices
        mask.scatter_(-1, idx, False)
        val = x.gather(-1, idx).to(_F16)
    else:
        idx = torch.zeros(*x.shape[:-1], 0, dtype=torch.int64, device=x.device)
        val = torch.zeros(*x.shape[:-1], 0, dtype=_F16, device=x.device)
    m, _ = _gview(mask, axis, gs)
    inf = torch.tensor(float("inf"), device=x.device)
    lo = torch.where(m, g, inf).amin(red)
    hi = torch.where(m, g, -inf).amax(red)
    empty = ~torch.isfinite(lo)  # every entry of the group was an outlier
    lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    scale = scale_to_fp16(((hi - lo) * 0.5).clamp_min(_MIN_SCALE))
    offset = ((hi + lo) * 0.5).to(_F16)
    u = ((g - offset.float().unsqueeze(red)) / scale.float().unsqueeze(red)).clamp_(-1.0, 1.0)
    u = torch.where(m, u, 0.0).reshape(x.shape)
    return u, mask, scale.contiguous(), offset.contiguous(), idx, val


# --------------------------------------------------------------------------------------------------------- codebook
@dataclass
class NUQCodebook:
    """Non-uniform levels for normalized values, fitted per KV head (and channel).

    levels: fp16 `[kv_heads, dim or 1, 2**bits]`, ascending along the last dim. The normalization settings it was
    fitted under (`axis`, `group_size`, `outlier_frac`) are part of it: `quantize_nuq` uses the same ones.
    """

    levels: torch.Tensor
    bits: int
    axis: str
    group_size: int | None
    outlier_frac: float

    def tensors(self) -> list[torch.Tensor]:
        return [self.levels]

    @property
    def nbytes(self) -> int:
        return self.levels.nbytes


def _lloyd(data: torch.Tensor, w: torch.Tensor, n_levels: int, iters: int, pin_ends: bool) -> torch.Tensor:
    """Weighted 1-D k-means of each row of `data` [R, N] (weights `w` [R, N], 0 = ignored) -> sorted [R, L].

    pin_ends: the outer levels stay at -1 and +1 (the normalized range), only the inner ones move."""
    rows = data.shape[0]
    # initial levels: weighted quantiles at (i + 0.5) / L of each row
    order = data.argsort(-1)
    ds, ws = data.gather(-1, order), w.gather(-1, order)
    cw = ws.cumsum(-1)
    tot = cw[:, -1:].clamp_min(1e-12)
    targets = (torch.arange(n_levels, dtype=data.dtype, device=data.device) + 0.5) / n_levels * tot
    pos = torch.searchsorted(cw.contiguous(), targets.contiguous()).clamp_(max=data.shape[1] - 1)
    c = ds.gather(-1, pos)
    empty_row = tot.squeeze(-1) <= 1e-12
    c[empty_row] = torch.linspace(-1, 1, n_levels, dtype=data.dtype, device=data.device)
    if pin_ends:
        c[:, 0], c[:, -1] = -1.0, 1.0
    for _ in range(iters):
        mids = (c[:, 1:] + c[:, :-1]) * 0.5
        a = torch.searchsorted(mids.contiguous(), data.contiguous())  # nearest level of each point
        sw = torch.zeros(rows, n_levels, dtype=data.dtype, device=data.device).scatter_add_(1, a, w)
        sx = torch.zeros_like(sw).scatter_add_(1, a, w * data)
        c = torch.where(sw > 0, sx / sw.clamp_min(1e-12), c)
        if pin_ends:
            c[:, 0], c[:, -1] = -1.0, 1.0
        c = c.sort(-1).values
    return c


def fit_codebook(
    calib_x: torch.Tensor,
    bits: int,
    axis: str,
    group_size: int | None = None,
    outlier_frac: float = 0.01,
    per_channel: bool = True,
    iters: int = 12,
    weights: torch.Tensor | None = None,
    pin_ends: bool = True,
) -> NUQCodebook:
    """Fit `2**bits` levels to normalized calibration data by 1-D k-means.

    calib_x: `[batch, kv_heads, tokens, dim]` (pre-RoPE keys with `axis="channel"`, values with `axis="token"`);
    normalized exactly as `quantize_nuq` will (same `axis`, `group_size`, `outlier_frac`), outliers left out.
    per_channel: one codebook per (KV head, channel) (levels `[kv_heads, dim, L]`) or per KV head (`[kv_heads, 1, L]`).
    weights: optional sensitivity (e.g. Fisher information), broadcastable to `calib_x`; k-means minimizes the
    weighted squared error.
    pin_ends: keep the outer levels at -1/+1 so the extremes of every group stay representable (plain k-means pulls
    them inwards: lower MSE but a larger attention error on real keys, whose largest entries decide the scores).
    """
    _check_bits(bits)
    _check_axis(axis, group_size)
    if calib_x.dim() != 4 or not torch.is_floating_point(calib_x):
        raise ValueError(f"calib_x must be a float [batch, kv_heads, tokens, dim] tensor, got {tuple(calib_x.shape)}")
    x = calib_x.float()
    gs = _group_size(x, axis, group_size)
    u, mask, *_ = _normalize(x, axis, gs, outlier_count(x.shape[-1], outlier_frac))
    w = mask.float()
    if weights is not None:
        try:
            w = w * weights.float().expand_as(x)
        except RuntimeError as e:
            raise ValueError(
                f"weights {tuple(weights.shape)} must broadcast to calib_x {tuple(x.shape)}, e.g. [batch, kv_heads, "
                "tokens, 1] from attention_sensitivity"
            ) from e
    b, h, t, d = x.shape
    if per_channel:
        data, wr = u.permute(1, 3, 0, 2).reshape(h * d, b * t), w.permute(1, 3, 0, 2).reshape(h * d, b * t)
    else:
        data, wr = u.transpose(0, 1).reshape(h, -1), w.transpose(0, 1).reshape(h, -1)
    levels = _lloyd(data, wr, 2**bits, iters, pin_ends).reshape(h, d if per_channel else 1, 2**bits)
    return NUQCodebook(levels.to(_F16).contiguous(), bits, axis, group_size, float(outlier_frac))


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8 (KVQuant uses 2, 3 or 4), got {bits!r}")


def attention_sensitivity(
    query: torch.Tensor, key: torch.Tensor, scaling: float, power: float = 0.5, floor: float = 0.1
) -> torch.Tensor:
    """Per-token sensitivity weights `[batch, kv_heads, tokens, 1]` for `fit_codebook(weights=...)`.

    query `[batch, heads, tokens, dim]` and key `[batch, kv_heads, tokens, dim]` (post-RoPE, as attention sees them,
    the same tokens; GQA: heads a multiple of kv_heads) of a calibration prefill: the causal attention mass each key
    token receives, summed over its query heads, divided by its mean, raised to `power`, plus `floor` so no token is
    ignored. An error on a token that gets much attention moves the output more (for keys and for values alike),
    which is what KVQuant's Fisher-information weighting captures; this is a gradient-free stand-in for it.
    `power=0.5` (default) damps attention sinks: with the raw mass (power 1) a sink token dominates a layer's
    codebook, which on SmolLM2-135M's layer 18 at 2 bits tripled the attention error (1.57 vs 0.42 unweighted);
    the square root gave the best mean and max error of {none, 1, 0.5, capped at 3 or 10} on SmolLM2 and Qwen2.5.
    """
    if query.dim() != 4 or key.dim() != 4 or query.shape[2] != key.shape[2] or query.shape[1] % key.shape[1]:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must be [batch, heads, tokens, dim] of the same "
            "tokens, heads a multiple of kv_heads"
        )
    b, hq, t, _ = query.shape
    hk = key.shape[1]
    s = (query.float() @ key.float().repeat_interleave(hq // hk, 1).transpose(-1, -2)) * scaling
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    mass = torch.softmax(s, -1).reshape(b, hk, hq // hk, t, t).sum((2, 3))  # [b, hk, t]
    return ((mass / mass.mean(-1, keepdim=True)).pow(power) + floor).unsqueeze(-1)


# ------------------------------------------------------------------------------------------------------ quantization
@dataclass
class NUQQuantized(TokenRows):
    """nuq codes + normalization + sparse outliers of one `[..., tokens, dim]` tensor.

    codes: uint8 `[..., tokens, packed(dim)]`; scale/offset: fp16 (shapes: module docstring); outlier_idx: uint8
    (dim <= 256) or int16 `[..., tokens, k]`; outlier_val: fp16 `[..., tokens, k]`; codebook: the shared levels.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    outlier_idx: torch.Tensor
    outlier_val: torch.Tensor
    codebook: NUQCodebook
    group_size: int
    dim: int

    def row_fields(self) -> dict[str, int]:
        per = self.group_size if self.codebook.axis == "channel" else 1
        return {"codes": 1, "scale": per, "offset": per, "outlier_idx": 1, "outlier_val": 1}

    def shared(self) -> tuple:
        return (self.codebook,)

    def data_tensors(self) -> list[torch.Tensor]:
        """The per-block tensors (everything but the shared codebook)."""
        return [self.codes, self.scale, self.offset, self.outlier_idx, self.outlier_val]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor needed to decode, the codebook included (shared by all blocks of a layer: count it once)."""
        return self.data_tensors() + self.codebook.tensors()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


def _levels_for(codebook: NUQCodebook, x: torch.Tensor) -> torch.Tensor:
    """Codebook levels as fp32 `[1, kv_heads, 1, dim or 1, L]`, checked against `x` [batch, kv_heads, tokens, dim]."""
    h, c, _ = codebook.levels.shape
    if x.dim() != 4 or x.shape[1] != h or c not in (1, x.shape[-1]):
        raise ValueError(
            f"codebook levels {tuple(codebook.levels.shape)} do not fit x {tuple(x.shape)}: fit the codebook on "
            "[batch, kv_heads, tokens, dim] data of this layer (same kv_heads and head_dim)"
        )
    return codebook.levels.float()[None, :, None]


def _nearest(u: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of the levels nearest to `u` `[..., T, D]`, given the midpoints between levels."""
    return (u.unsqueeze(-1) > mids).sum(-1, dtype=torch.uint8)


def _clip_search(x: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, axis: str, gs: int,
                 lv: torch.Tensor, mids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the scale `scale * r` (r in `CLIP_GRID`: the group's range shrunk around its midpoint, the
    entries beyond it clipped to the outer levels) whose nuq round trip of the dense entries of `x` `[..., T, D]`
    has the smallest squared error; returns that scale (fp16, group shape) and the normalized `u`."""
    g, red = _gview(x, axis, gs)
    m, _ = _gview(mask, axis, gs)
    off = offset.float().unsqueeze(red)
    levels = lv.expand(*x.shape, lv.shape[-1])
    best_err, best_scale = None, scale
    for r in CLIP_GRID:
        s = scale_to_fp16(scale.float() * r) if r != 1.0 else scale
        u = ((g - off) / s.float().unsqueeze(red)).clamp(-1.0, 1.0).reshape(x.shape)
        rec = levels.gather(-1, _nearest(u, mids).long().unsqueeze(-1)).squeeze(-1)
        err = torch.where(m, _gview(rec, axis, gs)[0] * s.float().unsqueeze(red) + off - g, 0.0).square().sum(red)
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_err, best_scale = torch.where(better, err, best_err), torch.where(better, s, best_scale)
    u = ((g - off) / best_scale.float().unsqueeze(red)).clamp(-1.0, 1.0)
    return best_scale.contiguous(), torch.where(m, u, 0.0).reshape(x.shape)


def quantize_nuq(x: torch.Tensor, codebook: NUQCodebook, clip_search: bool = False) -> NUQQuantized:
    """Quantize `x` `[batch, kv_heads, tokens, dim]` with `codebook` (its axis, group_size and outlier_frac).

    Keys must already be pre-RoPE (`undo_rope`) if the codebook was fitted on pre-RoPE keys. `clip_search`: each
    group's scale is the one of `CLIP_GRID`'s shrunk ranges with the smallest squared error (as KIVI's clip search;
    the stored layout is the same).
    """
    if not torch.is_floating_point(x):
        raise ValueError(f"can only quantize floating-point tensors, got {x.dtype}")
    lv = _levels_for(codebook, x)
    xf = x.float()
    dim = x.shape[-1]
    gs = _group_size(xf, codebook.axis, codebook.group_size)
    k = outlier_count(dim, codebook.outlier_frac)
    u, mask, scale, offset, idx, val = _normalize(xf, codebook.axis, gs, k)
    mids = (lv[..., 1:] + lv[..., :-1]) * 0.5  # [1, H, 1, C, L-1]
    if clip_search:
        scale, u = _clip_search(xf, mask, scale, offset, codebook.axis, gs, lv, mids)
    codes = _nearest(u, mids)
    idx_dtype = torch.uint8 if dim <= 256 else torch.int16
    return NUQQuantized(
        pack_bits(codes, codebook.bits), scale, offset, idx.to(idx_dtype), val, codebook, gs, dim
    )


def dequantize_nuq(q: NUQQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor `q` was made from (up to quantization error; outliers exact in fp16), `[..., tokens, dim]`."""
    codes = unpack_bits(q.codes, q.codebook.bits, q.dim).long()
    lv = _levels_for(q.codebook, codes)
    lv = lv.expand(*codes.shape, lv.shape[-1])
    u = lv.gather(-1, codes.unsqueeze(-1)).squeeze(-1)
    g, red = _gview(u, q.codebook.axis, q.group_size)
    x = torch.addcmul(q.offset.float().unsqueeze(red), g, q.scale.float().unsqueeze(red)).reshape(u.shape)
    if q.outlier_idx.shape[-1]:
        x.scatter_(-1, q.outlier_idx.long(), q.outlier_val.float())
    return x.to(dtype)


def bytes_per_element(q: NUQQuantized, include_codebook: bool = True) -> float:
    """Bytes held per quantized element (codebook included unless told otherwise)."""
    n = q.codes.shape[:-1].numel() * q.dim
    ts = q.tensors() if include_codebook else q.data_tensors()
    return sum(t.nbytes for t in ts) / max(n, 1)


__all__ = [
    "NUQCodebook",
    "NUQQuantized",
    "apply_rope",
    "attention_sensitivity",
    "bytes_per_element",
    "dequantize_nuq",
    "fit_codebook",
    "outlier_count",
    "quantize_nuq",
    "rope_cos_sin",
    "rotate_half",
    "undo_rope",
]
