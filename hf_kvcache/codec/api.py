"""`encode(cache, config=..., mode=...) -> bytes` and `decode(data, config=...) -> Cache`."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from ..caches.base import CompressedCache
from ..caches.tiered import KIVICache, TieredQuantCache
from ..caches.uniform import UniformQuantCache
from .lossless import decode_state, encode_state
from .lossy import LossyOptions, decode_tensor, encode_tensor
from .container import check_fingerprint, fingerprint, pack, unpack
from .layers import LAYER_CODECS, dtype_name, dtype_of, layer_codec, layer_kv, set_dynamic_layer

MODES = ("lossy", "lossless")
# cache classes the lossless mode rebuilds, by name
CACHE_CLASSES: dict[str, type[Cache]] = {
    "DynamicCache": DynamicCache,
    "UniformQuantCache": UniformQuantCache,
    "TieredQuantCache": TieredQuantCache,
    "KIVICache": KIVICache,
}


def _check_against_config(cache: Cache, fp: dict[str, Any], dims: list[tuple[int, int, int]]) -> None:
    if fp["layers"] is not None and len(cache.layers) != fp["layers"]:
        raise ValueError(
            f"the cache has {len(cache.layers)} layers but config says {fp['layers']}: pass the config of the model "
            "that filled this cache"
        )
    for i, (heads, kd, vd) in enumerate(dims):
        if (fp["kv_heads"] is not None and heads != fp["kv_heads"]) or (fp["head_dim"] is not None
                                                                        and kd != fp["head_dim"]):
            raise ValueError(
                f"layer {i} holds {heads} KV heads of dim {kd}, config says {fp['kv_heads']} of dim {fp['head_dim']}: "
                "pass the config of the model that filled this cache"
            )


def encode(cache: Cache, *, config: Any, mode: str = "lossy", **options: Any) -> bytes:
    """Serialize `cache` (filled by the model whose `config` is given) into a self-checking blob.

    mode="lossy" (CacheGen, any cache whose layers hold every token: DynamicCache and every non-evicting hf-kvcache
    cache, read through its dequantized keys/values): options `chunk_size`, `bins`, `group_channels`
    (`hf_kvcache.codec.lossy.LossyOptions`). mode="lossless": the exact state of DynamicCache, UniformQuantCache,
    TieredQuantCache and KIVICache (their codes entropy-coded), no options.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not valid; choose one of {list(MODES)}")
    if not isinstance(cache, Cache):
        raise ValueError(f"encode takes a transformers Cache, got {type(cache).__name__}")
    if config is None:
        raise ValueError("encode needs config=model.config: the blob records which model its KV belongs to")
    if not cache.layers or cache.get_seq_length() == 0:
        raise ValueError("the cache is empty; encode a cache after a forward pass")
    tokens = cache.get_seq_length()
    if mode == "lossy":
        opts = LossyOptions(**options)
        sections, metas, dims, dtype, batch = [], [], [], None, None
        for i, layer in enumerate(cache.layers):
            k, v = layer_kv(layer, i)
            if k.shape[2] != tokens:
                raise ValueError(f"layer {i} holds {k.shape[2]} tokens, layer 0 has seen {tokens}")
            dims.append((k.shape[1], k.shape[3], v.shape[3]))
            dtype, batch = k.dtype, k.shape[0]
            bins = opts.bins_for(i, len(cache.layers))
            meta = {"bins": bins}
            for name, x in (("k", k), ("v", v)):
                body, meta[name] = encode_tensor(x, bins, opts)
                sections.append((f"L{i}.{name}", body))
            metas.append(meta)
        fp = fingerprint(config, dtype_name(dtype))
        _check_against_config(cache, fp, dims)
        header = {"mode": mode, "fingerprint": fp, "tokens": tokens, "batch": batch,
                  "options": opts.to_dict(),
                  "layers": metas}
        return pack(header, sections)

    if options:
        raise ValueError(f"lossless mode takes no options, got {sorted(options)}")
    cls_name = type(cache).__name__
    if cls_name not in CACHE_CLASSES or CACHE_CLASSES[cls_name] is not type(cache):
        raise ValueError(f"lossless mode supports {sorted(CACHE_CLASSES)}, not {cls_name}; use mode='lossy'")
    sections, metas, dims, dtype = [], [], [], None
    for i, layer in enumerate(cache.layers):
        codec = layer_codec(layer, i)
        state = codec.state(layer)
        if codec.kind == "dynamic":
            k, v = state.tensors["keys"], state.tensors["values"]
            dims.append((k.shape[1], k.shape[3], v.shape[3]))
            dtype = k.dtype
        else:
            dims.append((state.scalars["num_heads"], state.scalars["head_dim"], state.scalars["value_dim"]))
            dtype = dtype_of(state.scalars["dtype"])
        body, meta = encode_state(state)
        metas.append({"kind": codec.kind, "class": type(layer).__name__, **meta})
        sections.append((f"L{i}", body))
    fp = fingerprint(config, dtype_name(dtype))
    _check_against_config(cache, fp, dims)
    cache_options = cache.options.to_dict() if isinstance(cache, CompressedCache) else {}
    header = {"mode": mode, "fingerprint": fp, "tokens": tokens, "cache_class": cls_name,
              "cache_options": cache_options, "layers": metas}
    return pack(header, sections)


def inspect(data: bytes) -> dict[str, Any]:
    """The verified header of a blob (mode, fingerprint, tokens, options, per-layer metadata, sections)."""
    return unpack(data).header


def decode(data: bytes, config: Any, *, device: str | torch.device = "cpu",
           dtype: torch.dtype | None = None) -> Cache:
    """Rebuild a cache from `encode`'s blob for the model whose `config` is given (its fingerprint must match).

    Lossy blobs come back as a `DynamicCache` in `dtype` (default: the dtype encoded); lossless blobs as the cache
    class that was encoded, bit-exact (`dtype` must then be None). The cache continues generation:
    `model.generate(ids, past_key_values=cache)` prefills only the tokens past `cache.get_seq_length()`.
    """
    if config is None:
        raise ValueError("decode needs config=model.config, to check that the blob belongs to this model")
    blob = unpack(data)
    h = blob.header
    check_fingerprint(h["fingerprint"], config)
    device = torch.device(device)
    if h["mode"] == "lossy":
        opts = LossyOptions(**{**h["options"], "bins": tuple(h["options"]["bins"])})
        dt = dtype or dtype_of(h["fingerprint"]["dtype"])
        cache = DynamicCache(config=config)
        for i, meta in enumerate(h["layers"]):
            k = decode_tensor(blob.sections[f"L{i}.k"], meta["k"], opts, dt, device)
            v = decode_tensor(blob.sections[f"L{i}.v"], meta["v"], opts, dt, device)
            set_dynamic_layer(cache.layers[i], k, v)
        return cache
    if h["mode"] != "lossless":
        raise ValueError(f"corrupt KV blob: unknown mode {h['mode']!r}")
    if dtype is not None:
        raise ValueError("a lossless blob decodes in the dtype it was encoded in; leave dtype=None")
    cls = CACHE_CLASSES.get(h["cache_class"])
    if cls is None:
        raise ValueError(f"corrupt KV blob: unknown cache class {h['cache_class']!r}")
    cache = cls(config=config, **h["cache_options"]) if cls is not DynamicCache else DynamicCache(config=config)
    if len(cache.layers) != len(h["layers"]):
        raise ValueError(f"corrupt KV blob: {len(h['layers'])} layers stored, the config builds {len(cache.layers)}")
    by_kind = {c.kind: (cls_, c) for cls_, c in LAYER_CODECS.items()}
    for i, meta in enumerate(h["layers"]):
        layer = cache.layers[i]
        layer_cls, codec = by_kind.get(meta["kind"], (None, None))
        if layer_cls is None or type(layer) is not layer_cls:
            raise ValueError(
                f"layer {i} was encoded as {meta['kind']!r} ({meta['class']}) but {h['cache_class']} builds a "
                f"{type(layer).__name__} for this config"
            )
        codec.restore(layer, decode_state(blob.sections[f"L{i}"], meta), device)
    if cache.get_seq_length() != h["tokens"]:
        raise ValueError(f"corrupt KV blob: rebuilt {cache.get_seq_length()} tokens, header says {h['tokens']}")
    return cache
