"""CacheGen-style lossy coding of keys / values: chunk anchors + depth-dependent delta quantization + entropy coding.

For one tensor `x [batch, kv_heads, tokens, dim]` of layer `l` (keys and values separately):

1. Tokens are split into chunks of `chunk_size`; the first token of each chunk is its *anchor*, stored at higher
   precision: int8 codes with one fp16 scale per (row, head, anchor token) (absmax / 127).
2. Every other token is coded as its delta to the *dequantized* anchor of its chunk (so errors never accumulate),
   quantized uniformly with one step per (head, channel): `step = 4 * std(delta) / bins_l`, i.e. `bins_l` bins across
   +-2 standard deviations of that channel's deltas. `bins_l` depends on the depth of the layer: `bins` gives one value
   per depth band (layers split evenly into `len(bins)` bands, shallow first), more bins for shallow layers, whose
   errors the paper measures to hurt quality most. Deltas past `2 * bins_l` steps are clipped (beyond 8 sigma).
3. Symbols are entropy-coded with `constriction`'s range coder, one categorical model per (layer, keys|values,
   channel group of `group_channels` channels); anchor codes with one model per (layer, keys|values).

Error bound: a non-anchor element is off by at most `step / 2` (unless clipped); an anchor by `scale / 2` (and a
non-anchor inherits its anchor's error on top).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from .entropy import decode_groups, encode_groups

_PARTS = struct.Struct("<I")


def join_parts(parts: list[bytes]) -> bytes:
    """Length-prefixed concatenation (the sub-parts of one section)."""
    return b"".join(_PARTS.pack(len(p)) + p for p in parts)


def split_parts(data: bytes, count: int) -> list[bytes]:
    out, pos = [], 0
    for _ in range(count):
        if pos + _PARTS.size > len(data):
            raise ValueError("corrupt KV blob: a section is shorter than its parts")
        (n,) = _PARTS.unpack_from(data, pos)
        pos += _PARTS.size
        out.append(data[pos : pos + n])
        pos += n
    if pos != len(data):
        raise ValueError("corrupt KV blob: a section is longer than its parts")
    return out


@dataclass
class LossyOptions:
    """Options of the lossy (CacheGen) mode.

    - chunk_size: tokens per chunk; the first of each is the chunk's int8 anchor
    - bins: bins across +-2 std of a channel's deltas, one value per depth band (shallow layers first); a single int
      applies to every layer
    - group_channels: channels (over heads x head_dim) sharing one entropy model
    """

    chunk_size: int = 16
    bins: tuple[int, ...] = (32, 24, 16)
    group_channels: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.bins, int):
            self.bins = (self.bins,)
        self.bins = tuple(self.bins)
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {self.chunk_size!r}")
        if not self.bins or any(not isinstance(b, int) or isinstance(b, bool) or not 2 <= b <= 1024 for b in self.bins):
            raise ValueError(f"bins must be an int or a sequence of ints in 2..1024, got {self.bins!r}")
        if not isinstance(self.group_channels, int) or isinstance(self.group_channels, bool) or self.group_channels < 1:
            raise ValueError(f"group_channels must be a positive integer, got {self.group_channels!r}")

    def bins_for(self, layer: int, layers: int) -> int:
        band = min(len(self.bins) - 1, layer * len(self.bins) // max(layers, 1))
        return self.bins[band]


def _positions(tokens: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.arange(tokens)
    anchor = t % chunk == 0
    return anchor, ~anchor, t // chunk


def _groups(channels: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, channels)) for a in range(0, channels, size)]


def encode_tensor(x: torch.Tensor, bins: int, opts: LossyOptions) -> tuple[bytes, dict]:
    """Code `x [batch, heads, tokens, dim]`; returns the section bytes and the metadata `decode_tensor` needs."""
    x = x.detach().to("cpu", torch.float32)
    b, h, t, d = x.shape
    anchor_mask, rest_mask, chunk_of = _positions(t, opts.chunk_size)
    anchors = x[:, :, anchor_mask]  # [b, h, na, d]
    scale = (anchors.abs().amax(-1, keepdim=True) / 127.0).to(torch.float16).float().clamp_min(1e-30)
    codes = torch.round(anchors / scale).clamp(-127, 127)
    anchor_hat = codes * scale
    deltas = x[:, :, rest_mask] - anchor_hat[:, :, chunk_of[rest_mask]]  # [b, h, nr, d]
    nr = deltas.shape[2]
    if nr:
        std = deltas.std(dim=(0, 2), correction=0) if b * nr > 1 else deltas.abs().amax(dim=(0, 2))
        step = (4.0 * std / bins).clamp_min(1e-6).to(torch.float16).float()  # [h, d]
        sym = torch.round(deltas / step[None, :, None, :])
        limit = int(min(2 * bins, max(1.0, sym.abs().max().item())))
        sym = sym.clamp(-limit, limit)
        flat = (sym.permute(1, 3, 0, 2).reshape(h * d, b * nr) + limit).to(torch.int32).numpy()
        spans = _groups(h * d, opts.group_channels)
        delta_bytes = encode_groups([flat[a:e].reshape(-1) for a, e in spans], 2 * limit + 1)
    else:
        step = torch.ones(h, d)
        limit, delta_bytes = 0, b""
    anchor_sym = (codes.to(torch.int32) + 127).numpy().reshape(-1)
    parts = [
        encode_groups([anchor_sym], 255),
        scale.to(torch.float16).numpy().tobytes(),
        step.to(torch.float16).numpy().tobytes(),
        delta_bytes,
    ]
    return join_parts(parts), {"shape": [b, h, t, d], "limit": limit}


def decode_tensor(data: bytes, meta: dict, opts: LossyOptions, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """Inverse of `encode_tensor`: `[batch, heads, tokens, dim]` in `dtype` on `device`."""
    b, h, t, d = meta["shape"]
    limit = meta["limit"]
    anchor_mask, rest_mask, chunk_of = _positions(t, opts.chunk_size)
    na, nr = int(anchor_mask.sum()), t - int(anchor_mask.sum())
    anchor_part, scale_part, step_part, delta_part = split_parts(data, 4)
    if len(scale_part) != 2 * b * h * na or len(step_part) != 2 * h * d:
        raise ValueError("corrupt KV blob: lossy section sizes do not match the header")
    (anchor_sym,) = decode_groups(anchor_part, [b * h * na * d])
    codes = torch.from_numpy(anchor_sym).view(b, h, na, d).float() - 127.0
    scale = torch.from_numpy(np.frombuffer(scale_part, dtype=np.float16).copy()).view(b, h, na, 1).float()
    anchor_hat = codes * scale
    out = torch.empty(b, h, t, d, dtype=torch.float32)
    out[:, :, anchor_mask] = anchor_hat
    if nr:
        step = torch.from_numpy(np.frombuffer(step_part, dtype=np.float16).copy()).view(h, d).float()
        spans = _groups(h * d, opts.group_channels)
        decoded = decode_groups(delta_part, [(e - a) * b * nr for a, e in spans])
        flat = torch.from_numpy(np.concatenate(decoded)).view(h, d, b, nr)
        deltas = (flat.permute(2, 0, 3, 1).float() - limit) * step[None, :, None, :]
        out[:, :, rest_mask] = deltas + anchor_hat[:, :, chunk_of[rest_mask]]
    return out.to(device=device, dtype=dtype)
