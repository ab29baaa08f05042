"""CacheGen-style KV bitstream: `encode(cache, config=model.config, mode="lossy" | "lossless") -> bytes` and
`decode(data, config=model.config) -> Cache`.

* lossy (`hf_kvcache.codec.lossy`): chunk anchors at int8, deltas to the anchor quantized with bins that depend on
  layer depth, entropy-coded with `constriction` per (layer, keys|values, channel group);
* lossless (`hf_kvcache.codec.lossless`): the codes our quantized caches already hold, entropy-coded; bit-exact;
* container (`hf_kvcache.codec.container`): magic, format version, model fingerprint, token count, crc32 per
  section; bad blobs raise `ValueError` saying what is wrong.
"""

from .api import CACHE_CLASSES, MODES, decode, encode, inspect
from .container import FORMAT_VERSION, MAGIC, fingerprint
from .layers import LAYER_CODECS, LayerCodec, LayerState
from .lossy import LossyOptions

__all__ = [
    "CACHE_CLASSES",
    "FORMAT_VERSION",
    "LAYER_CODECS",
    "LayerCodec",
    "LayerState",
    "LossyOptions",
    "MAGIC",
    "MODES",
    "decode",
    "encode",
    "fingerprint",
    "inspect",
]
