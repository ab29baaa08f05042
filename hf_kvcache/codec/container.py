"""The versioned container every codec blob travels in.

Layout (little-endian)::

    magic  b"HFKVCODEC"          9 bytes
    format version               u16
    header length                u32
    header crc32                 u32
    header                       zstd-compressed JSON (utf-8): mode, model fingerprint, token count, options, per-layer metadata,
                                 and the list of sections (name, byte length, crc32)
    sections                     concatenated, in the header's order

Every way a blob can be wrong raises `ValueError` naming what is wrong: too short / truncated, bad magic, another
format version, a corrupt header, a corrupt section (checksum), trailing bytes, or a model whose fingerprint differs
from the one the blob was encoded for. Nothing decodes silently wrong.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import zstandard

MAGIC = b"HFKVCODEC"
FORMAT_VERSION = 2  # 2: compact entropy tables and scale-referenced / sign-flipped high bytes in lossless sections
_PREFIX = struct.Struct("<HII")  # version, header length, header crc
_FIXED = len(MAGIC) + _PREFIX.size

# fingerprint keys compared against a model config on decode (dtype is recorded, not compared: see `fingerprint`)
COMPARED_KEYS = ("model_type", "layers", "kv_heads", "head_dim", "hidden_size", "vocab_size", "rope", "layer_types")


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def fingerprint(config: Any, dtype: str | None = None) -> dict[str, Any]:
    """What identifies the model a KV cache belongs to: architecture, layer count, KV heads, head dims, hidden size,
    vocabulary, RoPE settings and layer types from `config`, plus the cache's dtype (`dtype`, recorded for
    information: a cache encoded from an fp32 model may be decoded for the same model loaded in fp16).
    """
    c = _text_config(config)
    heads = getattr(c, "num_attention_heads", None)
    hidden = getattr(c, "hidden_size", None)
    head_dim = getattr(c, "head_dim", None) or (hidden // heads if hidden and heads else None)
    rope = getattr(c, "rope_parameters", None)
    if rope is None:
        rope = {"rope_theta": getattr(c, "rope_theta", None), "rope_scaling": getattr(c, "rope_scaling", None)}
    layer_types = getattr(c, "layer_types", None)
    return {
        "model_type": getattr(c, "model_type", None),
        "layers": getattr(c, "num_hidden_layers", None),
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "hidden_size": hidden,
        "vocab_size": getattr(c, "vocab_size", None),
        "rope": json.loads(json.dumps(rope, sort_keys=True, default=str)),
        "layer_types": list(layer_types) if layer_types is not None else None,
        "dtype": dtype,
    }


def check_fingerprint(stored: dict[str, Any], config: Any) -> None:
    """Raise `ValueError` naming every field where `config` differs from the fingerprint stored in a blob."""
    current = fingerprint(config)
    diffs = [f"{k}: blob {stored.get(k)!r} vs config {current.get(k)!r}" for k in COMPARED_KEYS
             if stored.get(k) != current.get(k)]
    if diffs:
        raise ValueError(
            "wrong model: this KV blob was encoded for another model (" + "; ".join(diffs) + "). Decode it with the "
            "config of the model that produced it."
        )


@dataclass
class Blob:
    """A parsed container: the header dict and the sections by name (bytes, checksums verified)."""

    header: dict[str, Any]
    sections: dict[str, bytes] = field(default_factory=dict)


def pack(header: dict[str, Any], sections: list[tuple[str, bytes]]) -> bytes:
    """Serialize `header` (JSON-able) and the named `sections` into one blob with per-section crc32 checksums."""
    names = [n for n, _ in sections]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate section names in {names}")
    header = dict(header)
    header["sections"] = [{"name": n, "length": len(b), "crc32": zlib.crc32(b)} for n, b in sections]
    head = zstandard.ZstdCompressor(level=9).compress(
        json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    parts = [MAGIC, _PREFIX.pack(FORMAT_VERSION, len(head), zlib.crc32(head)), head]
    parts.extend(b for _, b in sections)
    return b"".join(parts)


def unpack(data: bytes | bytearray | memoryview) -> Blob:
    """Parse and verify a blob made by `pack`; raises `ValueError` saying what is wrong with a bad one."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"a KV blob must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(MAGIC) and MAGIC.startswith(data):
        raise ValueError(f"truncated KV blob: {len(data)} bytes, shorter than the {_FIXED}-byte fixed header")
    if data[: len(MAGIC)] != MAGIC:
        raise ValueError("not an hf-kvcache codec blob: bad magic bytes (expected b'HFKVCODEC' at the start)")
    if len(data) < _FIXED:
        raise ValueError(f"truncated KV blob: {len(data)} bytes, shorter than the {_FIXED}-byte fixed header")
    version, head_len, head_crc = _PREFIX.unpack_from(data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise ValueError(
            f"unsupported KV blob format version {version}: this hf-kvcache reads version {FORMAT_VERSION}; "
            "re-encode the cache with this version of the library"
        )
    if len(data) < _FIXED + head_len:
        raise ValueError(f"truncated KV blob: the header needs {head_len} bytes, only {len(data) - _FIXED} present")
    head = data[_FIXED : _FIXED + head_len]
    if zlib.crc32(head) != head_crc:
        raise ValueError("corrupt KV blob: header checksum mismatch")
    try:
        header = json.loads(zstandard.ZstdDecompressor().decompress(head, max_output_size=64 << 20).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, zstandard.ZstdError) as exc:  # pragma: no cover - crc makes this unlikely
        raise ValueError(f"corrupt KV blob: header is not valid zstd JSON ({exc})") from None
    pos = _FIXED + head_len
    expected = pos + sum(s["length"] for s in header["sections"])
    if len(data) < expected:
        raise ValueError(f"truncated KV blob: expected {expected} bytes, got {len(data)}")
    if len(data) > expected:
        raise ValueError(f"corrupt KV blob: {len(data) - expected} trailing bytes after the last section")
    sections = {}
    for s in header["sections"]:
        body = data[pos : pos + s["length"]]
        if zlib.crc32(body) != s["crc32"]:
            raise ValueError(f"corrupt KV blob: checksum mismatch in section {s['name']!r}")
        sections[s["name"]] = body
        pos += s["length"]
    return Blob(header, sections)
