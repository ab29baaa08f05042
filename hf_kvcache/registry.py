"""Cache names for `generate(cache_implementation=...)`: the one place that hooks transformers.

transformers accepts a closed list of `cache_implementation` names and builds the cache inside
`GenerationMixin._prepare_cache_for_generation`. `install()` adds our names to that list and wraps that method so that
one of our names builds our cache from `cache_config`, exactly as `past_key_values=` would. Every other name, and
every unknown one, goes through transformers untouched (unknown names still raise there).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from transformers import GenerationMixin, PreTrainedConfig
from transformers.cache_utils import Cache
from transformers.generation import configuration_utils as gen_config

CacheFactory = Callable[..., Cache]
_FACTORIES: dict[str, CacheFactory] = {}
_installed = False


def register_cache(name: str, factory: CacheFactory) -> None:
    """Make `cache_implementation=name` build `factory(config=..., **cache_config)`."""
    if name in gen_config.ALL_CACHE_IMPLEMENTATIONS and name not in _FACTORIES:
        raise ValueError(f"{name!r} is already a transformers cache_implementation; pick another name")
    _FACTORIES[name] = factory
    if _installed:
        _extend_valid_names()


def fixed(cache_class: CacheFactory, **fixed_options: Any) -> CacheFactory:
    """A factory for `cache_class` with some options pinned by the name (e.g. "int4" pins dtype="int4")."""

    def factory(config: PreTrainedConfig | None = None, **options: Any) -> Cache:
        clash = sorted(set(options) & set(fixed_options))
        if clash:
            raise ValueError(
                f"option(s) {clash} are fixed by this cache name ({fixed_options}); drop them from cache_config "
                "or use the generic name"
            )
        return cache_class(config=config, **fixed_options, **options)

    return factory


def cache_names() -> list[str]:
    return sorted(_FACTORIES)


def build_cache(name: str, config: PreTrainedConfig | None = None, **cache_config: Any) -> Cache:
    """Build the cache registered as `name` (the same object `generate(cache_implementation=name)` uses)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown cache {name!r}; registered caches: {cache_names()}")
    return _FACTORIES[name](config=config, **cache_config)


def _extend_valid_names() -> None:
    missing = tuple(n for n in _FACTORIES if n not in gen_config.ALL_CACHE_IMPLEMENTATIONS)
    gen_config.ALL_CACHE_IMPLEMENTATIONS = gen_config.ALL_CACHE_IMPLEMENTATIONS + missing


def _attention_for(model, cache) -> None:
    """A cache class that sets `needs_attention_mass` (it ranks tokens by the attention they receive) gets the
    "hf_kvcache" attention, the one that reports it; see `hf_kvcache.attention.use_for_cache`."""
    if getattr(cache, "needs_attention_mass", False):
        from .attention import use_for_cache

        use_for_cache(model, cache)


def install() -> None:
    """Hook transformers' generate() once (idempotent)."""
    global _installed
    if _installed:
        return
    original = GenerationMixin._prepare_cache_for_generation

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        name = generation_config.cache_implementation
        if (
            name in _FACTORIES
            and model_kwargs.get("past_key_values") is None
            and generation_config.use_cache is not False
        ):
            # `cache_config` is copied: generate may be called again with the same generation config
            options = copy.deepcopy(generation_config.cache_config) if generation_config.cache_config else {}
            cache = build_cache(name, self.config.get_text_config(decoder=True), **options)
            model_kwargs["past_key_values"] = cache
            _attention_for(self, cache)
            if generation_config.is_assistant:
                cache.activate_past_recording()
            return None
        _attention_for(self, model_kwargs.get("past_key_values"))
        return original(self, generation_config, model_kwargs, *args, **kwargs)

    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    _installed = True
    _extend_valid_names()
