"""Lossless coding of a layer's state: every tensor by the smallest of a few bit-exact encodings.

* 1-byte tensors (packed uint8 codes, int8 codes, fp8 values): the bytes as symbols, or unpacked into 4-bit or 2-bit
  symbols (the same bits, cut differently: bit-exact whatever the packing layout), entropy-coded with `constriction`,
  one categorical model per KV head (`[batch, heads, tokens, ...]` tensors) or per (KV head, last-dim position):
  per-channel key codes have a distribution of their own in every channel; or the symbols of 2-4 consecutive tokens
  of a channel coded as one (keys change slowly along the tokens: 6 % fewer bytes for 2-bit archive key codes);
* 2-byte tensors (fp16 / bf16 scales / zeros / tails): the high bytes (sign, exponent, top mantissa bits)
  entropy-coded per head or per (head, channel), or with each channel's majority sign flipped away, or (a zero point,
  `x.zero`, beside its scales `x.scale`) as the difference to the scale's high byte; the low bytes raw; or both byte
  planes zstd-compressed;
* anything else: byte planes + zstd.

Entropy-coded streams carry compact model tables (`entropy.encode_symbols`). Each tensor keeps whichever candidate is
smallest (its name is in the metadata, and the tensor it was coded against, if any), so the round trip is bit-exact.
"""

from __future__ import annotations

import numpy as np
import torch

from .entropy import decode_symbols, encode_symbols, shuffle_compress, shuffle_decompress
from .layers import LayerState, dtype_name, dtype_of
from .lossy import join_parts, split_parts


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _rows(u8: np.ndarray, by_channel: bool) -> np.ndarray:
    """`[batch, heads, ..., last]` bytes -> one row per head (`[heads, batch * rest]`), or with `by_channel` one row
    per (head, last-dim position) (`[heads * last, batch * rest]`); one row for < 2-D tensors."""
    if u8.ndim < 2 or u8.shape[1] == 0:
        return u8.reshape(1, -1)
    h = np.moveaxis(u8, 1, 0)  # [heads, batch, ..., last]
    if by_channel and h.ndim >= 3:
        return np.ascontiguousarray(np.moveaxis(h, -1, 1)).reshape(h.shape[0] * h.shape[-1], -1)
    return np.ascontiguousarray(h).reshape(h.shape[0], -1)


def _from_rows(rows: np.ndarray, shape: tuple[int, ...], by_channel: bool) -> np.ndarray:
    if len(shape) < 2 or shape[1] == 0:
        return rows.reshape(shape)
    moved = (shape[1], shape[0], *shape[2:])  # [heads, batch, ..., last]
    if by_channel and len(shape) >= 3:
        h = np.moveaxis(rows.reshape(shape[1], shape[-1], *moved[1:-1]), 1, -1)
    else:
        h = rows.reshape(moved)
    return np.moveaxis(h, 0, 1)


def _symbols(u8: np.ndarray, bits: int) -> np.ndarray:
    """`[..., n]` bytes -> `[..., n * 8 // bits]` symbols of `bits` bits (lowest bits first)."""
    per = 8 // bits
    if per == 1:
        return u8
    mask = (1 << bits) - 1
    return np.stack([(u8 >> (bits * j)) & mask for j in range(per)], axis=-1).reshape(*u8.shape[:-1], -1)


def _ans_bytes(u8: np.ndarray, bits: int, by_channel: bool = False, joint: int = 1) -> bytes:
    """Entropy-code a uint8 array cut into `bits`-bit symbols (8, 4 or 2), one model per head, or per (head,
    channel) with `by_channel` (the symbols of one last-dim position: e.g. one channel of per-channel key codes).
    `joint` > 1 (`[batch, heads, tokens, ...]` tensors): the symbols of `joint` consecutive tokens of one channel
    form one symbol, so the model sees how codes follow each other along the tokens (padded with zero tokens)."""
    sym = _symbols(u8, bits)
    if joint > 1:
        pad = (-sym.shape[2]) % joint
        sym = np.pad(sym, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (sym.ndim - 3)).astype(np.int32)
        sym = sum(sym[:, :, j::joint] << (bits * j) for j in range(joint))
    return encode_symbols(list(_rows(sym, by_channel).astype(np.int32)), 1 << (bits * joint))


def _ans_unbytes(data: bytes, shape: tuple[int, ...], bits: int, by_channel: bool = False,
                 joint: int = 1) -> np.ndarray:
    per = 8 // bits
    sym_shape = (*shape[:-1], shape[-1] * per) if shape else shape
    if joint > 1:
        sym_shape = (*sym_shape[:2], -(-sym_shape[2] // joint), *sym_shape[3:])
    numel = int(np.prod(sym_shape))
    groups = 1 if len(shape) < 2 or shape[1] == 0 else shape[1] * (sym_shape[-1] if by_channel and len(shape) >= 3 else 1)
    rows = np.stack(decode_symbols(data, [numel // groups] * groups, 1 << (bits * joint)))
    sym = _from_rows(rows, sym_shape, by_channel)
    if joint > 1:
        mask = (1 << bits) - 1
        sym = np.stack([(sym >> (bits * j)) & mask for j in range(joint)], axis=3)
        sym = sym.reshape(*sym_shape[:2], -1, *sym_shape[3:])[:, :, : shape[2]]
    if per > 1:
        sym = sym.reshape(*shape, per)
        packed = np.zeros(shape, dtype=np.int32)
        for j in range(per):
            packed |= sym[..., j].astype(np.int32) << (bits * j)
        sym = packed
    return sym.astype(np.uint8)


def _planes(t: torch.Tensor) -> np.ndarray:
    """`[..., itemsize]` byte planes (little-endian: plane 0 is the low byte)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(*t.shape, t.element_size())


# entropy-coded byte encodings: name -> (bits per symbol, by_channel, tokens coded jointly)
# (consecutive tokens coded jointly: up to 8 bits a symbol)
_ANS: dict[str, tuple[int, bool, int]] = {}
for _b in (8, 4, 2):
    _ANS |= {f"ans{_b}": (_b, False, 1), f"ans{_b}c": (_b, True, 1)}
    _ANS |= {f"ans{_b}t{j}": (_b, False, j) for j in range(2, 8 // _b + 1)}
del _b


def _code(x: np.ndarray, alphabet: int, by_channel: bool) -> bytes:
    """Entropy-code the integers `x` (`[batch, heads, ...]`, values in `[0, alphabet)`): one model per head, or per
    (head, last-dim position) with `by_channel`."""
    return encode_symbols(list(_rows(x, by_channel).astype(np.int32)), alphabet)


def _uncode(data: bytes, shape: tuple[int, ...], alphabet: int, by_channel: bool) -> np.ndarray:
    """Inverse of `_code`: int32 `shape`."""
    groups = 1 if len(shape) < 2 or shape[1] == 0 else shape[1] * (shape[-1] if by_channel and len(shape) >= 3 else 1)
    numel = int(np.prod(shape))
    return _from_rows(np.stack(decode_symbols(data, [numel // groups] * groups, alphabet)), shape, by_channel)


# 2-byte tensors (fp16 / bf16 scales, zero points, tails): the high byte (sign, exponent, top mantissa bits)
# entropy-coded one of these ways, the low byte raw after it (nearly uniform: coding it gains nothing):
# * hi-ans / hi-ansc: the high byte, one model per head / per (head, channel);
# * hi-flip-ans (`[batch, heads, ..., channels]`): one bit per (head, channel), the channel's majority sign, then the
#   high byte with that sign flipped away, per head (key channels keep their sign: most flipped signs are +);
# * hi-ref-ans (a zero point with its scale beside it): the high byte minus the scale's high byte (mod 256) per
#   head: a group's minimum is about -1.5 scales for 2-bit codes, so its exponent follows the scale's.
_HI = ("hi-ans", "hi-ansc", "hi-flip-ans", "hi-ref-ans")


def _majority_sign(hi: np.ndarray) -> np.ndarray:
    """`[batch, heads, ..., channels]` high bytes -> `[1, heads, 1..., channels]` 1 where most signs are negative."""
    axes = (0, *range(2, hi.ndim - 1))
    return (2 * (hi >> 7).sum(axis=axes, keepdims=True) > np.prod([hi.shape[a] for a in axes])).astype(np.int32)


def _hi_bytes(hi: np.ndarray, enc: str, ref_hi: np.ndarray | None) -> bytes:
    if enc == "hi-flip-ans":
        flip = _majority_sign(hi)
        return np.packbits(flip.astype(np.uint8)).tobytes() + _code(hi ^ (flip << 7), 256, False)
    if enc == "hi-ref-ans":
        return _code((hi.astype(np.int32) - ref_hi) % 256, 256, False)
    return _code(hi, 256, enc == "hi-ansc")


def _hi_unbytes(data: bytes, shape: tuple[int, ...], enc: str, ref_hi: np.ndarray | None) -> np.ndarray:
    if enc == "hi-flip-ans":
        if len(shape) < 3:
            raise ValueError(f"corrupt KV blob: a hi-flip-ans tensor of shape {list(shape)} (needs >= 3 dims)")
        n_flip = shape[1] * shape[-1]
        if len(data) < (n_flip + 7) // 8:
            raise ValueError("corrupt KV blob: a hi-flip-ans tensor shorter than its sign-flip mask")
        flip = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=(n_flip + 7) // 8))[:n_flip]
        flip = flip.astype(np.int32).reshape(1, shape[1], *[1] * (len(shape) - 3), shape[-1])
        return _uncode(data[(n_flip + 7) // 8 :], shape, 256, False) ^ (flip << 7)
    if enc == "hi-ref-ans":
        return (_uncode(data, shape, 256, False) + ref_hi) % 256
    return _uncode(data, shape, 256, enc == "hi-ansc")


def encode_tensor(t: torch.Tensor, ref: torch.Tensor | None = None) -> tuple[bytes, dict]:
    """Bytes and metadata (name-free) of one tensor: the smallest bit-exact candidate encoding. `ref`: for a 2-byte
    zero-point tensor, the scales of the same groups (same shape), decoded before it (`hi-ref-ans`)."""
    meta = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
    if t.numel() == 0:
        return b"", {**meta, "enc": "empty"}
    candidates: dict[str, bytes] = {"zstd-shuffle": shuffle_compress(_raw_bytes(t), t.element_size())}
    if t.element_size() == 1:
        u8 = _planes(t)[..., 0]
        for name, (bits, by_channel, joint) in _ANS.items():
            if joint == 1 or u8.ndim >= 4:  # joint tokens need the [batch, heads, tokens, ...] layout
                candidates[name] = _ans_bytes(u8, bits, by_channel, joint)
    elif t.element_size() == 2:
        planes = _planes(t)
        lo = planes[..., 0].tobytes()
        ref_hi = None
        if ref is not None and ref.shape == t.shape and ref.element_size() == 2:
            ref_hi = _planes(ref)[..., 1].astype(np.int32)
        for name in _HI:
            if (name != "hi-ref-ans" or ref_hi is not None) and (name != "hi-flip-ans" or t.dim() >= 3):
                candidates[name] = _hi_bytes(planes[..., 1], name, ref_hi) + lo
    enc = min(candidates, key=lambda k: len(candidates[k]))
    return candidates[enc], {**meta, "enc": enc}


def decode_tensor(data: bytes, meta: dict, ref: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `encode_tensor` (`ref`: the decoded reference tensor, for `hi-ref-ans`)."""
    dt = dtype_of(meta["dtype"])
    shape = tuple(meta["shape"])
    enc = meta["enc"]
    if enc == "empty":
        return torch.empty(shape, dtype=dt)
    itemsize = torch.empty((), dtype=dt).element_size()
    numel = int(np.prod(shape))
    if enc in _ANS:
        u8 = _ans_unbytes(data, shape, *_ANS[enc])
    elif enc in _HI:
        if itemsize != 2 or len(data) < numel:
            raise ValueError(f"corrupt KV blob: a {enc} tensor of {numel} {meta['dtype']} values in "
                             f"{len(data)} bytes")
        ref_hi = None
        if enc == "hi-ref-ans":
            if ref is None or tuple(ref.shape) != shape or ref.element_size() != 2:
                raise ValueError("corrupt KV blob: a hi-ref-ans tensor without its reference tensor (same shape)")
            ref_hi = _planes(ref)[..., 1].astype(np.int32)
        hi = _hi_unbytes(data[: len(data) - numel], shape, enc, ref_hi)
        lo = np.frombuffer(data, dtype=np.uint8, offset=len(data) - numel).reshape(shape)
        u8 = np.stack([lo, hi.astype(np.uint8)], -1)
    elif enc == "zstd-shuffle":
        u8 = np.frombuffer(shuffle_decompress(data, itemsize, numel * itemsize), dtype=np.uint8)
    else:
        raise ValueError(f"corrupt KV blob: unknown tensor encoding {enc!r}")
    raw = torch.from_numpy(np.ascontiguousarray(u8).reshape(-1).copy())
    return raw.view(dt).reshape(shape)


def _reference(name: str) -> str | None:
    """The tensor a zero-point tensor may be coded against: its scales (`x.zero` -> `x.scale`)."""
    return name.removesuffix("zero") + "scale" if name.endswith(".zero") else None


def encode_state(state: LayerState) -> tuple[bytes, dict]:
    """One section (all tensors of a layer) and its metadata."""
    names = sorted(state.tensors)
    parts, metas = [], []
    for name in names:
        ref = _reference(name)
        body, meta = encode_tensor(state.tensors[name], state.tensors.get(ref) if ref else None)
        parts.append(body)
        metas.append({"name": name, **meta, **({"ref": ref} if meta["enc"] == "hi-ref-ans" else {})})
    return join_parts(parts), {"scalars": state.scalars, "tensors": metas}


def decode_state(data: bytes, meta: dict) -> LayerState:
    parts = split_parts(data, len(meta["tensors"]))
    tensors: dict[str, torch.Tensor] = {}
    for p, m in zip(parts, meta["tensors"]):  # in name order: a zero point's scales (its "ref") come before it
        if "ref" in m and m["ref"] not in tensors:
            raise ValueError(f"corrupt KV blob: tensor {m['name']!r} refers to {m['ref']!r}, not decoded before it")
        tensors[m["name"]] = decode_tensor(p, m, tensors.get(m.get("ref")))
    return LayerState(dict(meta["scalars"]), tensors)
