"""The evicting cache, one concern per module: `options` (budget, policy, quantization; the flat `cache_config`
keys), `slots` (what a layer holds and how it is read), `layer` (what the attention reports; the eviction), `crop`
(undoing cropped tokens), `merge` (folding evicted tokens into kept ones), `cache` (`H2OCache`). The policies and
their wrappers live in `hf_kvcache.policy`."""

from .cache import H2OCache
from .layer import H2OLayer
from .options import EvictOptions, H2OOptions
from .slots import Slots

__all__ = ["EvictOptions", "H2OCache", "H2OLayer", "H2OOptions", "Slots"]
