"""CacheGen-style lossy coding of keys / values: chunk anchors + depth-dependent delta quantization + entropy coding.

For one tensor `x [batch, kv_heads, tokens, dim]` of layer `l` (keys and values separately):

1. Tokens are split into chunks of `chunk_size`; the first token of each chunk is its *anchor*, stored at higher
   precision: int8 codes with one fp16 scale per (row, head, chunk) (absmax / 127). (The first token of the sequence,
   the attention sink that quality is most sensitive to, is always an anchor. A chunk-mean "virtual anchor" was tried
   and dropped: it left the sink at delta precision and cost +9 % perplexity on SmolLM2.)
2. Every other token is coded as its delta to the *dequantized* anchor of its chunk (so errors never accumulate),
   quantized uniformly with one step per (head, channel): `step = 4 * std / bins_l`, i.e. `bins_l` bins across
   +-2 standard deviations of that channel (of its deltas or of its values: `step_from`). `bins_l` depends on the
   depth of the layer: `bins` gives one value per depth band (layers split evenly into `len(bins)` bands, shallow
   first), more bins for shallow layers, whose errors the paper measures to hurt quality most. Deltas past
   `2 * bins_l` steps (attention-sink tokens, outliers) are escaped: an extra symbol in the stream, their exact
   quantized value in a side list, so nothing is clipped.
3. Symbols are entropy-coded with `constriction`'s ANS coder, one categorical model per (layer, keys|values,
   channel group of `group_channels` channels); anchor codes with one model per (layer, keys|values).

Error bound: a delta-coded element is off by at most `step / 2` (deltas are taken to the dequantized anchor, so the
anchor's own error does not carry over), an anchor element by at most `scale / 2`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from .entropy import decode_groups, encode_groups

_PARTS = struct.Struct("<I")
STEP_FROM = ("deltas", "values", "head")


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
    """Options of the lossy (CacheGen) mode. Defaults: the codec-bench row "lossy mid, chunk 32" (SmolLM2 / Moby
    Dick, 2048 tokens: 5244 bytes per token, 2.27x smaller than the int8 cache, +0.18 % continuation perplexity).

    - chunk_size: tokens per chunk; the first of each is the chunk's int8 anchor
    - bins: bins across +-2 std of a channel's deltas, one value per depth band (shallow layers first); a single int
      applies to every layer
    - group_channels: channels (over heads x head_dim) sharing one entropy model
    - step_from: what the +-2 std that `bins` divides is measured on: "deltas" (each channel's deltas), "values"
      (each channel's values: the same absolute error for channels whose deltas are small, so they cost fewer bits)
      or "head" (one step for all channels of a KV head, from the RMS of their value spreads: low-variance channels
      then cost almost no bits and every channel of the head gets the same absolute error)
    """

    chunk_size: int = 32
    bins: tuple[int, ...] = (12, 8, 6)
    group_channels: int = 32
    step_from: str = "values"

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
        if self.step_from not in STEP_FROM:
            raise ValueError(f"step_from={self.step_from!r} is not valid; choose one of {list(STEP_FROM)}")

    def to_dict(self) -> dict:
        return {"chunk_size": self.chunk_size, "bins": list(self.bins), "group_channels": self.group_channels,
                "step_from": self.step_from}

    def bins_for(self, layer: int, layers: int) -> int:
        band = min(len(self.bins) - 1, layer * len(self.bins) // max(layers, 1))
        return self.bins[band]


def _groups(channels: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, channels)) for a in range(0, channels, size)]


def encode_tensor(x: torch.Tensor, bins: int, opts: LossyOptions) -> tuple[bytes, dict]:
    """Code `x [batch, heads, tokens, dim]`; returns the section bytes and the metadata `decode_tensor` needs.

    Token order inside a chunk is kept: the delta-coded tokens, chunk after chunk, are the first `nr` rows of the
    padded `[chunks * coded_per_chunk]` layout (the padding sits at the end of the last chunk). The arithmetic runs
    in numpy (single-threaded and predictable next to a busy torch thread pool)."""
    x = x.detach().to("cpu", torch.float32).numpy()
    b, h, t, d = x.shape
    c, k0 = opts.chunk_size, 1  # position 0 of a chunk is its anchor
    n = -(-t // c)
    if n * c != t:  # pad the last chunk by repeating the last token
        x = np.concatenate([x, np.repeat(x[:, :, -1:], n * c - t, axis=2)], axis=2)
    xc = x.reshape(b, h, n, c, d)
    anchors = xc[:, :, :, 0]  # [b, h, n, d]
    scale = (np.abs(anchors).max(-1, keepdims=True) / 127.0).astype(np.float16).astype(np.float32)
    scale = np.maximum(scale, np.float32(1e-30))
    codes = np.clip(np.rint(anchors / scale), -127, 127)
    anchor_hat = codes * scale
    nr = t - n * k0
    cd = c - k0
    if nr:
        deltas = (xc[:, :, :, k0:] - anchor_hat[:, :, :, None]).reshape(b, h, n * cd, d)[:, :, :nr]
        # channel-major [h * d, b * nr]: one contiguous row per channel, entropy groups are row blocks
        rows = np.ascontiguousarray(deltas.transpose(1, 3, 0, 2)).reshape(h * d, b * nr)
        ref = xc.reshape(b, h, n * c, d)[:, :, :t].transpose(1, 3, 0, 2).reshape(h * d, -1)
        spread = rows.std(axis=1) if opts.step_from == "deltas" else ref.std(axis=1)
        if opts.step_from == "head":  # one step per head: the RMS of its channels' spreads (reverse water-filling)
            spread = np.repeat(np.sqrt(np.square(spread).reshape(h, d).mean(axis=1)), d)
        step = np.maximum(4.0 * spread / bins, 1e-6).astype(np.float16).astype(np.float32)  # [h * d]
        sym = np.rint(rows / step[:, None]).astype(np.int64)
        limit = int(min(2 * bins, max(1, int(np.abs(sym).max()))))
        # symbols past +-limit are escaped: coded as the extra symbol 2 * limit + 1, their value stored exactly
        outside = np.abs(sym) > limit
        where = np.flatnonzero(outside).astype(np.uint64)
        values = sym.reshape(-1)[where.astype(np.int64)].astype(np.int64)
        flat = np.where(outside, 2 * limit + 1, sym + limit).astype(np.int32)
        spans = _groups(h * d, opts.group_channels)
        delta_bytes = encode_groups([flat[a:e].reshape(-1) for a, e in spans], 2 * limit + 2)
    else:
        step = np.ones(h * d, dtype=np.float32)
        limit, delta_bytes = 0, b""
        where, values = np.zeros(0, np.uint64), np.zeros(0, np.int64)
    escapes = zstandard.ZstdCompressor(level=3).compress(where.astype("<u8").tobytes() + values.astype("<i8").tobytes())
    anchor_sym = (codes.astype(np.int32) + 127).reshape(-1)
    parts = [
        encode_groups([anchor_sym], 255),
        scale.astype(np.float16).tobytes(),
        step.astype(np.float16).tobytes(),
        delta_bytes,
        escapes,
    ]
    return join_parts(parts), {"shape": [b, h, t, d], "limit": limit, "escapes": int(where.size)}


def decode_tensor(data: bytes, meta: dict, opts: LossyOptions, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """Inverse of `encode_tensor`: `[batch, heads, tokens, dim]` in `dtype` on `device`. The arithmetic runs in
    numpy (single-threaded and predictable next to a busy torch thread pool)."""
    b, h, t, d = meta["shape"]
    limit = meta["limit"]
    c, k0 = opts.chunk_size, 1
    n = -(-t // c)
    nr = t - n * k0
    cd = c - k0
    anchor_part, scale_part, step_part, delta_part, escape_part = split_parts(data, 5)
    if len(scale_part) != 2 * b * h * n or len(step_part) != 2 * h * d:
        raise ValueError("corrupt KV blob: lossy section sizes do not match the header")
    (anchor_sym,) = decode_groups(anchor_part, [b * h * n * d])
    scale = np.frombuffer(scale_part, dtype=np.float16).astype(np.float32).reshape(b, h, n, 1)
    anchor_hat = (anchor_sym.reshape(b, h, n, d) - np.int32(127)).astype(np.float32)
    anchor_hat *= scale
    out = np.empty((b, h, n, c, d), dtype=np.float32)
    if k0:
        out[:, :, :, 0] = anchor_hat
    if nr:
        step = np.frombuffer(step_part, dtype=np.float16).astype(np.float32)
        spans = _groups(h * d, opts.group_channels)
        decoded = decode_groups(delta_part, [(e - a) * b * nr for a, e in spans])
        rows = np.concatenate(decoded).reshape(h * d, b * nr)
        n_esc = meta.get("escapes", 0)
        if n_esc:
            raw = zstandard.ZstdDecompressor().decompress(escape_part, max_output_size=16 * n_esc)
            if len(raw) != 16 * n_esc:
                raise ValueError("corrupt KV blob: escape list does not match the header")
            where = np.frombuffer(raw[: 8 * n_esc], dtype="<u8").astype(np.int64)
            values = np.frombuffer(raw[8 * n_esc :], dtype="<i8")
            rows = rows.astype(np.int64)
            rows.reshape(-1)[where] = values + limit
        rows = (rows - limit).astype(np.float32)
        rows *= step[:, None]
        rest = np.zeros((b, h, n * cd, d), dtype=np.float32)
        rest[:, :, :nr] = rows.reshape(h, d, b, nr).transpose(2, 0, 3, 1)
        rest = rest.reshape(b, h, n, cd, d)
        rest += anchor_hat[:, :, :, None]
        out[:, :, :, k0:] = rest
    x = torch.from_numpy(out.reshape(b, h, n * c, d)[:, :, :t])
    return x.to(device=device, dtype=dtype)
