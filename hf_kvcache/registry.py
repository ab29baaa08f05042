"""Cache names for `generate(cache_implementation=...)`: the one place that hooks transformers.

transformers accepts a closed list of `cache_implementation` names and builds the cache inside
`GenerationMixin._prepare_cache_for_generation`. `install()` adds our names to that list and wraps that method so that
one of our names builds our cache from `cache_config`, exactly as `past_key_values=` would. Every other name, and
every unknown one, goes through transformers untouched (unknown names still raise there).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable

from transformers import GenerationMixin, PreTrainedConfig
from transformers.cache_utils import Cache
from transformers.generation import configuration_utils as gen_config

from .caches.base import CompressedCache
from .transformers_compat import CACHE_KWARG

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


def preset(cache_class: CacheFactory, **preset_options: Any) -> CacheFactory:
    """A factory for `cache_class` whose defaults are `preset_options`; options the user gives take precedence."""

    def factory(config: PreTrainedConfig | None = None, **options: Any) -> Cache:
        return cache_class(config=config, **{**copy.deepcopy(preset_options), **options})

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


@dataclass
class _Lease:
    """What `generate` changed on a model for its cache: undone when that generate returns."""

    attn_implementation: str | None
    cache: Cache


def _attention_for(model, cache) -> None:
    """Give `cache` the attention it needs for this generate: caches that rank tokens by the attention they receive
    (`needs_attention_mass`) and caches the fused attention reads in place (`reads_fused`) switch the model to the
    "hf_kvcache" attention; the latter are also bound to the model (`CompressedCache.bind`). Both are undone when
    generate returns (`_release`), so the model is handed back as it was."""
    ours = isinstance(cache, CompressedCache)  # a transformers cache keeps the model's attention
    needs_mass, reads_fused = ours and cache.needs_attention_mass, ours and cache.reads_fused
    leases = model.__dict__.setdefault("_hf_kvcache_leases", [])
    if not (needs_mass or reads_fused) or any(lease.cache is cache for lease in leases):
        return  # nothing to change, or an outer `attached` / generate already holds this cache
    from .attention import NAME, unsupported, use_for_cache

    if not needs_mass and unsupported(model.config):
        return  # reading codes in place is an optimization: such a model keeps its attention and dequantized tensors
    before = getattr(model.config, "_attn_implementation", None)
    if needs_mass:
        use_for_cache(model, cache)
    elif before != NAME:
        try:
            model.set_attn_implementation(NAME)
        except (ValueError, ImportError):  # a model that cannot take it keeps dequantized tensors: still right
            return
    if reads_fused:
        cache.bind(model)
    leases.append(_Lease(before, cache))


@contextlib.contextmanager
def attached(model, cache):
    """Run `model` with `cache` as `generate` does: the attention the cache needs, the cache bound to the fused
    attention where it reads codes in place, and the model handed back as it was on exit.

        with hf_kvcache.attached(model, cache):
            model(ids, past_key_values=cache)
    """
    depth = len(model.__dict__.get("_hf_kvcache_leases", ()))
    _attention_for(model, cache)
    try:
        yield cache
    finally:
        _release(model, depth)


def _release(model, depth: int) -> None:
    """Undo the leases taken since there were `depth` of them (innermost first); nested `attached` / generate
    calls with the same cache take none, so an inner generate never hands back what an outer call set up."""
    leases = model.__dict__.get("_hf_kvcache_leases", [])
    while len(leases) > depth:
        lease = leases.pop()
        if lease.cache.reads_fused:
            lease.cache.unbind()
        if lease.attn_implementation is not None and model.config._attn_implementation != lease.attn_implementation:
            model.set_attn_implementation(lease.attn_implementation)


def _chunk_prefill(cache, generation_config) -> None:
    """Prefill long prompts in chunks (transformers' `prefill_chunk_size`) for caches of ours that ask for it
    (`prefill_chunk_size`), so the full-precision keys/values of a whole long prompt never exist at once; a value in
    the generation config wins (generate works on its own copy of that config)."""
    chunk = cache.prefill_chunk_size if isinstance(cache, CompressedCache) else None
    if chunk and getattr(generation_config, "prefill_chunk_size", None) is None:
        generation_config.prefill_chunk_size = chunk


def _record_padding(cache, model_kwargs: dict) -> None:
    """Tell an empty cache of ours which positions of the prompt are left padding (`CompressedCache.set_padding`)."""
    if isinstance(cache, CompressedCache) and cache.get_seq_length() == 0:
        cache.set_padding(model_kwargs.get("attention_mask"))


def install() -> None:
    """Hook transformers' generate() once (idempotent)."""
    global _installed
    if _installed:
        return
    original = GenerationMixin._prepare_cache_for_generation
    original_generate = GenerationMixin.generate

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        name = generation_config.cache_implementation
        if (
            name in _FACTORIES
            and model_kwargs.get(CACHE_KWARG) is None
            and generation_config.use_cache is not False
        ):
            # `cache_config` is copied: generate may be called again with the same generation config
            options = copy.deepcopy(generation_config.cache_config) if generation_config.cache_config else {}
            cache = build_cache(name, self.config.get_text_config(decoder=True), **options)
            model_kwargs[CACHE_KWARG] = cache
            _attention_for(self, cache)
            _record_padding(cache, model_kwargs)
            _chunk_prefill(cache, generation_config)
            if generation_config.is_assistant:
                cache.activate_past_recording()
            return None
        given = model_kwargs.get(CACHE_KWARG)
        _attention_for(self, given)
        _record_padding(given, model_kwargs)
        _chunk_prefill(given, generation_config)
        return original(self, generation_config, model_kwargs, *args, **kwargs)

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        depth = len(self.__dict__.get("_hf_kvcache_leases", ()))
        try:
            return original_generate(self, *args, **kwargs)
        finally:
            _release(self, depth)

    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    GenerationMixin.generate = generate
    _installed = True
    _extend_valid_names()
