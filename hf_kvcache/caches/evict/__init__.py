"""The evicting cache, one concern per module: `options` (budget, policy, quantization; the flat `cache_config`
keys), `slots` (what a layer holds and how it is read), `layer` (what the attention reports; the eviction), `crop`
(undoing cropped tokens), `merge` (folding evicted tokens into kept ones), `cache` (`H2OCache`), `reconstruct`
(scoring a context by its reconstruction), `lookahead` (question-aware eviction scored with the model's draft of its
answer). The policies and their wrappers live in `hf_kvcache.policy`."""

from .cache import H2OCache
from .layer import H2OLayer
from .lookahead import evict_with_lookahead
from .options import EvictOptions, H2OOptions
from .slots import Slots

__all__ = ["EvictOptions", "H2OCache", "H2OLayer", "H2OOptions", "Slots", "evict_with_lookahead"]
