"""Lossless coding of a layer's state: its 1-byte code tensors entropy-coded, everything else byte-shuffled + zstd.

A tensor of a 1-byte dtype (packed uint8 codes, int8 codes, fp8 values) is coded byte by byte with `constriction`,
one categorical model per KV head (`[batch, heads, tokens, ...]` tensors) over the 256 byte values: a byte of packed
2-bit codes carries four codes, so the model sees their joint distribution. Other tensors (fp16 scales / zeros / tails,
fp32 keys) are split into byte planes and zstd-compressed. The round trip is bit-exact.
"""

from __future__ import annotations

import numpy as np
import torch

from .entropy import decode_groups, encode_groups, shuffle_compress, shuffle_decompress
from .layers import LayerState, dtype_name, dtype_of
from .lossy import join_parts, split_parts


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _head_groups(t: torch.Tensor) -> int:
    return t.shape[1] if t.dim() >= 2 and t.shape[1] > 0 else 1


def encode_tensor(t: torch.Tensor) -> tuple[bytes, dict]:
    """Bytes and metadata (name-free) of one tensor."""
    meta = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
    if t.numel() == 0:
        meta["enc"] = "empty"
        return b"", meta
    if t.element_size() == 1:
        heads = _head_groups(t)
        u8 = t.detach().cpu().contiguous().view(torch.uint8)
        per_head = u8.transpose(0, 1).reshape(heads, -1).to(torch.int32).numpy() if t.dim() >= 2 else \
            u8.reshape(1, -1).to(torch.int32).numpy()
        meta["enc"] = "ans8"
        return encode_groups(list(per_head), 256), meta
    meta["enc"] = "zstd-shuffle"
    return shuffle_compress(_raw_bytes(t), t.element_size()), meta


def decode_tensor(data: bytes, meta: dict) -> torch.Tensor:
    dt = dtype_of(meta["dtype"])
    shape = tuple(meta["shape"])
    if meta["enc"] == "empty":
        return torch.empty(shape, dtype=dt)
    itemsize = torch.empty((), dtype=dt).element_size()
    numel = int(np.prod(shape))
    if meta["enc"] == "ans8":
        if len(shape) >= 2:
            heads = shape[1]
            per = numel // heads
            rows = decode_groups(data, [per] * heads)
            # stored as [heads, batch, rest...]: put the batch back in front
            u8 = torch.from_numpy(np.stack(rows).astype(np.uint8)).view(heads, shape[0], *shape[2:]).transpose(0, 1)
        else:
            (row,) = decode_groups(data, [numel])
            u8 = torch.from_numpy(row.astype(np.uint8))
        return u8.contiguous().view(dt).reshape(shape)
    if meta["enc"] == "zstd-shuffle":
        raw = shuffle_decompress(data, itemsize, numel * itemsize)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)
    raise ValueError(f"corrupt KV blob: unknown tensor encoding {meta['enc']!r}")


def encode_state(state: LayerState) -> tuple[bytes, dict]:
    """One section (all tensors of a layer) and its metadata."""
    names = sorted(state.tensors)
    parts, metas = [], []
    for name in names:
        body, meta = encode_tensor(state.tensors[name])
        parts.append(body)
        metas.append({"name": name, **meta})
    return join_parts(parts), {"scalars": state.scalars, "tensors": metas}


def decode_state(data: bytes, meta: dict) -> LayerState:
    parts = split_parts(data, len(meta["tensors"]))
    tensors = {m["name"]: decode_tensor(p, m) for p, m in zip(parts, meta["tensors"])}
    return LayerState(dict(meta["scalars"]), tensors)
