"""What a compressed layer hands the fused attention: its held tokens as an ordered list of segments.

A `QuantSegment` holds KIVI-style codes (keys per channel in groups of `k_group` tokens, values per token in groups of
`v_group` channels, asymmetric: x = code * scale + zero). Codes of one token are packed along the channel dim as a
little-endian bit stream (`hf_kvcache.quant.packing.pack_bits` layout, for every width 1..8): code `d` sits at bit
`bits * d`. A `FullSegment` holds plain keys/values. Both are `[batch, kv_heads, tokens, ...]`.

A `TokenSegment` holds the uniform cache's per-token codes (`quant.uniform`: keys and values each in groups of channels
per token), its keys optionally pre-RoPE and normalized (`key_codec`, read back at `positions`).

A `SubspaceSegment` holds an archive coded in fitted bases (`quant.subspace.SubspaceRows`: keys per direction over
token groups, values per token and subspace), its keys optionally pre-RoPE (`rope` puts RoPE back from `start`).

A `FullSegment` with `overlay_at` set is an overlay: it does not add positions, it replaces what the other segments
hold at positions `[overlay_at, overlay_at + tokens)` (full-precision attention sinks laid over a quantized tier).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_kvcache.quant.kivi import KIVIQuantized, dequantize_kivi
from hf_kvcache.quant.prerope import PreRopeKeys
from hf_kvcache.rope import KeyRotation
from hf_kvcache.quant.subspace import SubspaceRows, dequantize_subspace_rows
from hf_kvcache.quant.uniform import QuantizedTensor, dequantize as dequantize_uniform
from hf_kvcache.quant.rotation import Rotation, unrotate as unrotate_by


@dataclass
class QuantSegment:
    k_codes: torch.Tensor  # [B, H, T, packed(D, k_bits)] uint8
    k_scale: torch.Tensor  # [B, H, T // k_group, D] fp16
    k_zero: torch.Tensor  # [B, H, T // k_group, D] fp16
    v_codes: torch.Tensor  # [B, H, T, packed(D, v_bits)] uint8
    v_scale: torch.Tensor  # [B, H, T, D // v_group] fp16
    v_zero: torch.Tensor  # [B, H, T, D // v_group] fp16
    k_bits: int
    v_bits: int
    k_group: int  # tokens per key scale
    v_group: int  # channels per value scale
    head_dim: int
    # stored keys are k @ R (R orthogonal: a matrix or a `HadamardRotation`): attend with q @ R
    k_rotation: Rotation | None = None
    v_rotation: Rotation | None = None  # stored values are v @ R: the segment's output is rotated back by R^T

    @property
    def tokens(self) -> int:
        return self.k_codes.shape[2]

    def check(self) -> None:
        b, h, t, _ = self.k_codes.shape
        if t % self.k_group:
            raise ValueError(f"a quantized segment holds whole key groups: {t} tokens, k_group={self.k_group}")
        if self.k_scale.shape[2] != t // self.k_group or self.v_scale.shape[2] != t:
            raise ValueError("scale shapes do not match the codes")

    def slice(self, start: int, stop: int) -> "QuantSegment":
        """Tokens [start, stop); both multiples of `k_group` (or stop == tokens)."""
        g = self.k_group
        return QuantSegment(
            self.k_codes[:, :, start:stop], self.k_scale[:, :, start // g : -(-stop // g)],
            self.k_zero[:, :, start // g : -(-stop // g)], self.v_codes[:, :, start:stop],
            self.v_scale[:, :, start:stop], self.v_zero[:, :, start:stop], self.k_bits, self.v_bits, g,
            self.v_group, self.head_dim, self.k_rotation, self.v_rotation,
        )

    def key_codes(self) -> KIVIQuantized:
        """The keys as the KIVI format they are stored in (views, no copy)."""
        return KIVIQuantized(self.k_codes, self.k_scale, self.k_zero, self.k_bits, self.k_group, "channel", self.head_dim)

    def value_codes(self) -> KIVIQuantized:
        """The values as the KIVI format they are stored in (views, no copy)."""
        return KIVIQuantized(self.v_codes, self.v_scale, self.v_zero, self.v_bits, self.v_group, "token", self.head_dim)

    def dequantize(self, dtype: torch.dtype = torch.float32, unrotate: bool = False,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Expansion to `[B, H, T, D]` keys and values (in the stored, rotated basis unless `unrotate`), written into
        `out` (two float32 `[B, H, T, D]` tensors with a contiguous last dim, e.g. token slices of bigger buffers)
        when given."""
        if out is not None and unrotate:
            raise ValueError("dequantize writes into `out` only in the stored basis: pass unrotate=False")
        k = dequantize_kivi(self.key_codes(), out=None if out is None else out[0])
        v = dequantize_kivi(self.value_codes(), out=None if out is None else out[1])
        if unrotate and self.k_rotation is not None:
            k = unrotate_by(k, self.k_rotation).float()
        if unrotate and self.v_rotation is not None:
            v = unrotate_by(v, self.v_rotation).float()
        return (k, v) if out is not None else (k.to(dtype), v.to(dtype))

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero))


@dataclass
class FullSegment:
    keys: torch.Tensor  # [B, H, T, D]
    values: torch.Tensor
    overlay_at: int | None = None  # set: an overlay of positions [overlay_at, overlay_at + tokens)

    @property
    def tokens(self) -> int:
        return self.keys.shape[2]


@dataclass
class TokenSegment:
    """Per-token codes `[B, H, T, ...]` (`quant.uniform.QuantizedTensor`: codes, scales and zeros per token and group
    of channels). With `key_codec` the keys hold `key_codec`'s normalized pre-RoPE frame and are read back at
    `positions` (`[T]`, or `[B, 1, T]` with left padding: each row's true positions)."""

    keys: QuantizedTensor
    values: QuantizedTensor
    key_codec: PreRopeKeys | None = None
    positions: torch.Tensor | None = None

    @property
    def k_codes(self) -> torch.Tensor:
        return self.keys.codes

    @property
    def tokens(self) -> int:
        return self.keys.codes.shape[2]

    def dequantize(self, dtype: torch.dtype = torch.float32, unrotate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE redone when pre-RoPE) and values `[B, H, T, D]` in `dtype`; `unrotate` is accepted for the
        segment interface (no rotation is held)."""
        values = dequantize_uniform(self.values, dtype)
        if self.key_codec is None:
            return dequantize_uniform(self.keys, dtype), values
        return self.key_codec.dequantize(self.keys, self.positions, dtype), values


@dataclass
class SubspaceSegment:
    """Keys and values coded in per-KV-head bases (`SubspaceRows`, `[B, H, T, ...]`; keys axis "channel", values
    axis "token"). With `rope` the keys are pre-RoPE: `rope.rotate(keys, start)` gives the model's keys of positions
    `start..`; without it they are the model's keys and the fused attention folds the query into their basis."""

    keys: SubspaceRows
    values: SubspaceRows
    rope: KeyRotation | None = None
    start: int = 0

    @property
    def tokens(self) -> int:
        return self.keys.tokens

    @property
    def k_codes(self) -> torch.Tensor:
        return self.keys.codes

    @property
    def k_group(self) -> int:
        """Tokens per key scale group (a block of tokens starts on one)."""
        return self.keys.token_group

    @property
    def head_dim(self) -> int:
        return self.keys.basis.dim

    def nbytes(self) -> int:
        """Bytes the attention reads: codes, scales and zeros of both, and their bases."""
        return self.keys.nbytes + self.values.nbytes

    def slice(self, start: int, stop: int) -> "SubspaceSegment":
        """Tokens [start, stop); `start` a multiple of the keys' token group (`stop` too, or the end)."""
        return SubspaceSegment(self.keys.slice(start, stop), self.values.slice(start, stop), self.rope,
                               self.start + start)

    def dequantize(self, dtype: torch.dtype = torch.float32,
                   unrotate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE put back when pre-RoPE) and values `[B, H, T, D]` in `dtype` (`unrotate`: the segment
        interface's flag; the bases are always undone)."""
        keys = dequantize_subspace_rows(self.keys)
        if self.rope is not None:
            keys = self.rope.rotate(keys, self.start)
        return keys.to(dtype), dequantize_subspace_rows(self.values, dtype)


Segment = QuantSegment | TokenSegment | SubspaceSegment | FullSegment


def split_overlays(segments: list[Segment]) -> tuple[list[Segment], list[FullSegment]]:
    """(the segments in key order, the overlays); checks that every overlay lies inside the positions held."""
    ordered = [s for s in segments if not (isinstance(s, FullSegment) and s.overlay_at is not None)]
    overlays = [s for s in segments if isinstance(s, FullSegment) and s.overlay_at is not None]
    total = sum(s.tokens for s in ordered)
    for o in overlays:
        if o.overlay_at < 0 or o.overlay_at + o.tokens > total:
            raise ValueError(f"an overlay of positions [{o.overlay_at}, {o.overlay_at + o.tokens}) lies outside the "
                             f"{total} positions the segments hold")
    return ordered, overlays


def dense_segments(segments: list[Segment], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[B, H, T, D]` of every position the segments hold, quantized ones dequantized (and
    un-rotated), overlays written over the positions they replace."""
    ordered, overlays = split_overlays(segments)
    parts = [(s.keys.to(dtype), s.values.to(dtype)) if isinstance(s, FullSegment) else s.dequantize(dtype, unrotate=True)
             for s in ordered]
    keys = torch.cat([k for k, _ in parts], 2)
    values = torch.cat([v for _, v in parts], 2)
    for o in overlays:
        keys[:, :, o.overlay_at : o.overlay_at + o.tokens] = o.keys.to(dtype)
        values[:, :, o.overlay_at : o.overlay_at + o.tokens] = o.values.to(dtype)
    return keys, values
