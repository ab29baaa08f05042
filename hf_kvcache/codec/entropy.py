"""Entropy coding of symbol streams with `constriction` (its ANS coder, categorical models), and zstd for the rest.

A stream is a list of *groups*, each a flat array of integer symbols in `[0, alphabet)` coded with its own
categorical model: the group's symbol histogram, stored (scaled to uint16, zstd-compressed) in front of the ANS
coder's words (ANS is a stack: groups are encoded last to first so that they decode first to last), so encoder and decoder build bit-identical models from the same integers. `constriction` does the
arithmetic; nothing here is a hand-written coder.
"""

from __future__ import annotations

import struct
from typing import Sequence

import constriction
import numpy as np
import zstandard

_HEAD = struct.Struct("<III")  # groups, alphabet, table bytes (compressed)
ZSTD_LEVEL = 3


def _scaled_counts(counts: np.ndarray) -> np.ndarray:
    """Histogram rows rescaled to uint16 (a nonzero count stays nonzero); all-zero rows stay zero."""
    top = counts.max(axis=1, keepdims=True).astype(np.float64)
    scaled = np.ceil(counts * (65535.0 / np.maximum(top, 1.0)))
    return np.where(counts > 0, np.clip(scaled, 1, 65535), 0).astype(np.uint16)


def _model(row: np.ndarray):
    return constriction.stream.model.Categorical(row.astype(np.float64), perfect=False)


def encode_groups(groups: Sequence[np.ndarray], alphabet: int) -> bytes:
    """Entropy-code each group (flat int array, values in `[0, alphabet)`) under its own histogram model."""
    if not 2 <= alphabet <= 65536:
        raise ValueError(f"alphabet must be in 2..65536, got {alphabet}")
    counts = np.zeros((len(groups), alphabet), dtype=np.int64)
    arrays = []
    for i, g in enumerate(groups):
        g = np.ascontiguousarray(g, dtype=np.int32).reshape(-1)
        if g.size and (g.min() < 0 or g.max() >= alphabet):
            raise ValueError(f"group {i} has symbols outside [0, {alphabet})")
        counts[i] = np.bincount(g, minlength=alphabet)
        arrays.append(g)
    table = _scaled_counts(counts)
    encoder = constriction.stream.stack.AnsCoder()
    for g, row in reversed(list(zip(arrays, table))):
        if g.size:
            encoder.encode_reverse(g, _model(row))
    words = encoder.get_compressed()
    packed_table = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(table.tobytes())
    return _HEAD.pack(len(groups), alphabet, len(packed_table)) + packed_table + words.astype("<u4").tobytes()


def decode_groups(data: bytes, sizes: Sequence[int]) -> list[np.ndarray]:
    """Inverse of `encode_groups`: `sizes[i]` symbols of group i, as int32 arrays."""
    if len(data) < _HEAD.size:
        raise ValueError("corrupt entropy-coded stream: shorter than its header")
    n_groups, alphabet, table_len = _HEAD.unpack_from(data)
    if n_groups != len(sizes):
        raise ValueError(f"corrupt entropy-coded stream: {n_groups} groups stored, {len(sizes)} expected")
    table_end = _HEAD.size + table_len
    table = np.frombuffer(
        zstandard.ZstdDecompressor().decompress(data[_HEAD.size : table_end], max_output_size=2 * n_groups * alphabet),
        dtype=np.uint16,
    ).reshape(n_groups, alphabet)
    words = np.frombuffer(data[table_end:], dtype="<u4").astype(np.uint32)
    decoder = constriction.stream.stack.AnsCoder(words)
    out = []
    for size, row in zip(sizes, table):
        if size == 0:
            out.append(np.zeros(0, dtype=np.int32))
            continue
        if not row.any():
            raise ValueError("corrupt entropy-coded stream: empty model for a non-empty group")
        out.append(decoder.decode(_model(row), int(size)))
    return out


def shuffle_compress(raw: bytes, itemsize: int) -> bytes:
    """zstd over the byte planes of `raw` (elements of `itemsize` bytes): the high bytes of floats (sign and
    exponent) sit together and compress well."""
    arr = np.frombuffer(raw, dtype=np.uint8)
    if itemsize > 1:
        arr = np.ascontiguousarray(arr.reshape(-1, itemsize).T)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(arr.tobytes())


def shuffle_decompress(data: bytes, itemsize: int, nbytes: int) -> bytes:
    arr = np.frombuffer(zstandard.ZstdDecompressor().decompress(data, max_output_size=nbytes), dtype=np.uint8)
    if arr.size != nbytes:
        raise ValueError(f"corrupt zstd section: {arr.size} bytes decompressed, {nbytes} expected")
    if itemsize > 1:
        arr = np.ascontiguousarray(arr.reshape(itemsize, -1).T)
    return arr.tobytes()
