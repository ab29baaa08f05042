"""How this transformers version takes a cache: the keyword that hands one to a model's forward or to `generate`.

transformers 5.24 renamed `past_key_values` to `cache` (the old keyword is still accepted, renamed on the way in with a
deprecation warning; forward drops it in 5.40, `generate` in 6.0). Our own calls use the keyword the installed
version expects, so they warn nowhere and keep working on the older transformers of a GPU machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import transformers

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

TRANSFORMERS_VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])
CACHE_KWARG = "cache" if TRANSFORMERS_VERSION >= (5, 24) else "past_key_values"


def cache_kwargs(cache: Cache | None) -> dict[str, Cache | None]:
    """The keyword argument that hands `cache` to a model's forward or `generate`.

    Args:
        cache: the cache to pass (None passes none).

    Returns:
        `{"cache": cache}` from transformers 5.24 on, `{"past_key_values": cache}` before:
        `model(ids, **cache_kwargs(cache))`.
    """
    return {CACHE_KWARG: cache}
