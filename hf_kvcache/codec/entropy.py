"""Entropy coding of symbol streams with `constriction` (its ANS coder, categorical models), and zstd for the rest.

A stream is a list of *groups*, each a flat array of integer symbols in `[0, alphabet)` coded with its own
categorical model: the group's symbol histogram, stored (scaled, zstd-compressed) in front of the ANS coder's words
(ANS is a stack: groups are encoded last to first so that they decode first to last), so encoder and decoder build
bit-identical models from the same integers. `constriction` does the arithmetic; nothing here is a hand-written
coder.

Two stream formats:

* `encode_groups` / `decode_groups` (the lossy mode): a 12-byte header (groups, alphabet, table bytes) and the
  histograms scaled to a largest entry of 65535 (uint16);
* `encode_symbols` / `decode_symbols` (the lossless mode): a 5-byte header (table precision, table bytes; the group
  sizes and the alphabet are the caller's) and the histograms scaled to a largest entry from `PRECISIONS` (15 ...
  65535), tried coarse to fine until one costs more than the one before, keeping the one with the fewest estimated
  bytes (`table bytes + sum(count * -log2(p))`): a coarse table costs a little in the coded symbols and saves much in
  the table where alphabets are large or groups small. Tables with largest entry <= 255 are stored as uint8,
  zstd-compressed or raw, whichever is smaller.
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


def _decode_groups(decoder, sizes, table) -> list[np.ndarray]:
    """The symbols of each group (`sizes[g]` of them, model row `table[g]`), decoded in order from one ANS stack."""
    out = []
    for size, row in zip(sizes, table):
        if size == 0:
            out.append(np.zeros(0, dtype=np.int32))
            continue
        if not row.any():
            raise ValueError("corrupt entropy-coded stream: empty model for a non-empty group")
        out.append(decoder.decode(_model(row), int(size)))
    return out


def _model(row: np.ndarray):
    return constriction.stream.model.Categorical(row.astype(np.float64), perfect=False)


def encode_groups(groups: Sequence[np.ndarray], alphabet: int) -> bytes:
    """Entropy-code each group (flat int array, values in `[0, alphabet)`) under its own histogram model."""
    arrays, counts = _histograms(groups, alphabet)
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
    return _decode_groups(decoder, sizes, table)


# largest table entry of the compact (lossless) format, by index; uint8 storage up to 255
PRECISIONS = (15, 63, 127, 255, 4095, 65535)
_MODEL_HEAD = struct.Struct("<BI")  # precision index (| _RAW: table stored uncompressed), table bytes
_RAW = 0x80
TABLE_ZSTD_LEVEL = 9


def _histograms(groups: Sequence[np.ndarray], alphabet: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Flat int32 copies of `groups` and their `[groups, alphabet]` symbol counts (symbols checked in range)."""
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
    return arrays, counts


def _quantized(counts: np.ndarray, top: int) -> np.ndarray:
    """`[groups, alphabet]` counts rounded to a largest entry of `top` per row (a nonzero count stays nonzero)."""
    scaled = np.rint(counts * (top / np.maximum(counts.max(axis=1, keepdims=True), 1).astype(np.float64)))
    return np.where(counts > 0, np.clip(scaled, 1, top), 0).astype(np.uint8 if top <= 255 else "<u2")


def _packed_table(table: np.ndarray) -> tuple[bool, bytes]:
    raw = table.tobytes()
    # parameters sized to the table: the level's default window makes a small compress 400x slower
    params = zstandard.ZstdCompressionParameters.from_level(TABLE_ZSTD_LEVEL, source_size=len(raw))
    packed = zstandard.ZstdCompressor(compression_params=params).compress(raw)
    return (True, raw) if len(raw) <= len(packed) else (False, packed)


def encode_symbols(groups: Sequence[np.ndarray], alphabet: int) -> bytes:
    """Entropy-code each group (flat int array, values in `[0, alphabet)`) under its own histogram model, the
    histograms at the precision (`PRECISIONS`) estimated to give the fewest bytes. Decode with `decode_symbols` and
    the same group sizes and alphabet."""
    arrays, counts = _histograms(groups, alphabet)
    best = None
    for index, top in enumerate(PRECISIONS):
        table = _quantized(counts, top)
        raw, packed = _packed_table(table)
        prob = table / np.maximum(table.sum(axis=1, keepdims=True), 1).astype(np.float64)
        used = counts > 0
        bits = float(-(counts[used] * np.log2(prob[used])).sum())
        cost = len(packed) + bits / 8
        if best is not None and cost >= best[0]:
            break  # finer tables cost more in the table than they save in the symbols from here on
        best = (cost, index, raw, packed, table)
    _, index, raw, packed, table = best
    encoder = constriction.stream.stack.AnsCoder()
    for g, row in reversed(list(zip(arrays, table))):
        if g.size:
            encoder.encode_reverse(g, _model(row))
    words = encoder.get_compressed()
    flag = index | (_RAW if raw else 0)
    return _MODEL_HEAD.pack(flag, len(packed)) + packed + words.astype("<u4").tobytes()


def decode_symbols(data: bytes, sizes: Sequence[int], alphabet: int) -> list[np.ndarray]:
    """Inverse of `encode_symbols`: `sizes[i]` symbols of group i (alphabet `alphabet`), as int32 arrays."""
    if len(data) < _MODEL_HEAD.size:
        raise ValueError("corrupt entropy-coded stream: shorter than its header")
    flag, table_len = _MODEL_HEAD.unpack_from(data)
    index = flag & ~_RAW
    if index >= len(PRECISIONS):
        raise ValueError(f"corrupt entropy-coded stream: unknown table precision {index}")
    dt = np.dtype(np.uint8 if PRECISIONS[index] <= 255 else "<u2")
    table_end = _MODEL_HEAD.size + table_len
    if table_end > len(data):
        raise ValueError("corrupt entropy-coded stream: the model table runs past the end")
    nbytes = len(sizes) * alphabet * dt.itemsize
    body = data[_MODEL_HEAD.size : table_end]
    if not flag & _RAW:
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=nbytes)
        except zstandard.ZstdError as exc:
            raise ValueError(f"corrupt entropy-coded stream: model table does not decompress ({exc})") from None
    if len(body) != nbytes:
        raise ValueError(f"corrupt entropy-coded stream: model table of {len(body)} bytes, {nbytes} expected for "
                         f"{len(sizes)} groups of alphabet {alphabet}")
    table = np.frombuffer(body, dtype=dt).reshape(len(sizes), alphabet)
    if (len(data) - table_end) % 4:
        raise ValueError("corrupt entropy-coded stream: coded words are not whole 32-bit words")
    decoder = constriction.stream.stack.AnsCoder(np.frombuffer(data[table_end:], dtype="<u4").astype(np.uint32))
    return _decode_groups(decoder, sizes, table)


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
