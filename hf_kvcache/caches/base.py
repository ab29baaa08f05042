"""`CompressedLayer` (one model layer's compressed storage) and `CompressedCache` (the thin container).

Attention hand-off: `update` hands an `attention.AttentionRequest` over with the key tensor it returns
(`attention.hand_over`), so the registered `"hf_kvcache"` attention function finds the layer, reads its compressed
storage directly (the request's `FusedView`), and, when the layer declares `wants_attention_mass`, reports the
attention each held token received through `observe_attention`. What a layer can ask of the attention is declared
here with its defaults: `wants_attention_mass`, `query_window` (+ `observe_queries`), `key_mask()`, `key_bias()`,
`mask_from_end`.

A layer keeps what it stores in typed attributes of its own (quantized tensors, slots, tiers) and says what they are
through a few methods: `tokens_held`, `batch_size`, `held_tensors` (the bytes counted), `_map_store` (a batch-dim
operation applied to its row-laid-out storage) and, for the lossless codec, `state_tensors` / `load_state_tensors`.
Beam reordering, batch selection, repetition and cropping newest tokens (where storage is token-aligned: the tokens
on dim 2) are implemented once here on top of `_map_store`; a layer whose storage is not token-aligned overrides
`_crop_newest`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import PreTrainedConfig, cache_utils
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.cache_utils import get_layer_types_and_kwargs

from ..options import CacheOptions
from ..rope import KeyRotation
from ..attention.request import AttentionRequest, FusedView, hand_over
from .accounting import FP16_BYTES, fp16_equivalent, held_bytes, tensors_in

# transformers before 5.23 has no DummyLayer (and no "dummy" layer type)
DummyLayer = getattr(cache_utils, "DummyLayer", None)
FUSED_ATTENTION = "hf_kvcache"  # the attention implementation that reads compressed storage directly


class FusedBinding:
    """A cache bound to the model whose attention reads it: the layers hand over `FusedView`s only while that model
    runs the `"hf_kvcache"` attention (checked at every `update`), and dequantized tensors otherwise, so switching
    the model to another attention implementation at any time keeps the results right."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def active(self) -> bool:
        return getattr(self.config, "_attn_implementation", None) == FUSED_ATTENTION


class Placeholder(torch.Tensor):
    """The key/value tensors a layer returns while the fused attention reads its `FusedView`: right shape, no data.
    Anything but a look at the shape, dtype or device raises, so no other code can attend to them by mistake."""

    _ALLOWED = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__,
                torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.ndim.__get__,
                torch.Tensor.requires_grad.__get__, torch.Tensor.__repr__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            "an hf-kvcache layer handed its compressed storage to the 'hf_kvcache' attention, but something else read "
            f"the placeholder keys/values ({getattr(func, '__name__', func)}). Keep the model on "
            "attn_implementation='hf_kvcache' during a forward, or unbind the cache (cache.unbind())."
        )

    @staticmethod
    def like(x: torch.Tensor, tokens: int) -> "Placeholder":
        shape = (*x.shape[:2], tokens, x.shape[-1])
        return _zero_like(x.dtype, x.device, torch.is_inference_mode_enabled()).expand(shape).as_subclass(Placeholder)


@functools.lru_cache(maxsize=64)
def _zero_like(dtype: torch.dtype, device: torch.device, inference: bool) -> torch.Tensor:
    """A 0-d zero that placeholders expand (one per dtype, device and inference mode: never written)."""
    return torch.zeros((), dtype=dtype, device=device)


def _detached(x: torch.Tensor) -> torch.Tensor:
    """`x` cut from autograd (itself when no gradient can reach it: no dispatch on the decode path)."""
    return x.detach() if x.requires_grad else x


class CompressedLayer(DynamicLayer):
    """Base of every hf-kvcache layer: input checks, token counting, byte accounting, the batch/beam contract.

    Subclasses implement `append(keys, values)` (store new tokens, already detached from autograd) and
    `materialize()` (keys and values of the stored tokens, in the model's dtype, for attention implementations that
    need plain tensors); `materialize_into` may be overridden to write them straight into a buffer.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True
    # what the layer asks of the "hf_kvcache" attention (see the module docstring); subclasses override
    wants_attention_mass = False  # report the attention mass (`observe_visible_keys`, `observe_attention`)
    # report which keys the mask lets a query see, and that the forward's attention ran, without computing the mass
    # (`observe_visible_keys`, then `observe_attention(None)`): the attention stays torch SDPA
    wants_visible_keys = False
    query_window = 0  # > 0: report the last this-many queries of each call (`observe_queries`)
    mask_from_end = False  # the layer holds fewer slots than the mask's width: its columns are the mask's last ones
    fused_max_new = 64  # the fused attention serves forwards of at most this many new tokens (decode, small chunks)
    supports_sliding = False  # the class takes `sliding_window=` and keeps only what a sliding window can see
    replans = False  # the layer takes new cache options after construction (`replan`)
    sliding_window: int | None = None

    def __init__(self, options: CacheOptions | None = None) -> None:
        super().__init__()
        self.options = options
        self.cumulative_length = 0
        self.fused_binding: FusedBinding | None = None
        # `[batch]` int64: leading padding positions of each row (`CompressedCache.set_padding`); layers that pool
        # statistics over tokens keep these positions out of them
        self.padding: torch.Tensor | None = None

    # ---- what subclasses provide -------------------------------------------------------------------------------
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def materialize_into(self, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """Write the held tokens into `out_k` / `out_v` (`[batch, kv_heads, held, dim]`)."""
        past_k, past_v = self.materialize()
        out_k.copy_(past_k)
        out_v.copy_(past_v)

    def plain_storage(self) -> bool:
        """Whether, once `append` has run, `stored_keys_values` returns the held tokens and the new ones as they are
        (the model's dtype, key order), so that `update` hands them over without a copy."""
        return False

    def stored_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[batch, kv_heads, held + new, head_dim]` and values as stored (only where `plain_storage()`)."""
        raise NotImplementedError

    def attention_segments(self) -> list | None:
        """The held tokens as `hf_kvcache.kernels.segments` (quantized / full), in key order; None when this layer
        has no storage the fused attention can read directly."""
        return None

    def key_mask(self) -> torch.Tensor | None:
        """`[batch, kv_heads, held + new]` bool, the keys each KV head holds (False: an empty slot), for a layer
        whose heads hold different numbers of slots; None when every head holds every key."""
        return None

    def key_bias(self) -> torch.Tensor | None:
        """`[batch, kv_heads, held + new]` additive bias per key (the log of the tokens a merged slot stands for);
        None when there is none."""
        return None

    def observe_queries(self, queries: torch.Tensor, scaling: float) -> None:
        """The last `query_window` (post-RoPE) queries of an attention call `[batch, heads, w, head_dim]` and the
        call's scaling (only called when `query_window > 0`)."""

    def observe_attention(self, mass: torch.Tensor | None) -> None:
        """Attention mass `[batch, kv_heads, tokens]` received by the keys of the last `update` (held tokens first,
        then the new ones), summed over the query heads of each KV group and over the query positions; None for a
        layer that asked only `wants_visible_keys` (the forward's attention ran, nothing was summed)."""

    def observe_visible_keys(self, visible: torch.Tensor | None) -> None:
        """Called by the attention function just before `observe_attention`, over the same keys: `[batch, tokens]`
        bool, False where the mask lets no query attend the key (padding); None when the call had no mask."""

    # ---- transformers' layer contract ---------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads, self.head_dim = key_states.shape[1], key_states.shape[-1]
        self.value_dim = value_states.shape[-1]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens; return keys and values of everything held (past decoded, new tokens as given).

        The stored copy is detached (the cache works in grad mode as DynamicCache does; gradients reach the new
        tokens of this forward). While bound to a model running the fused attention, returns placeholders and
        leaves a `FusedView` for that attention instead."""
        self._check_states(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._begin_update()
        n = key_states.shape[2]
        view = self._segments_for_fused(n)
        held = self.tokens_held()
        # plain storage holds what the attention needs once the new tokens are stored: hand it over, no copy (not
        # when gradients must reach the new tokens: the stored copy is detached)
        stored = view is None and held > 0 and self.plain_storage() and not (
            torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad))
        if view is not None or stored:
            keys = values = None
        elif held > 0:
            keys, values = self._empty(held + n)
            self.materialize_into(keys[:, :, :held], values[:, :, :held])
            keys[:, :, held:].copy_(key_states)
            values[:, :, held:].copy_(value_states)
        else:
            keys, values = key_states, value_states
        self.cumulative_length += n
        self.append(_detached(key_states), _detached(value_states))
        if stored:
            keys, values = self.stored_keys_values()
        self._end_update(n)
        if view is not None:
            keys = Placeholder.like(key_states, held + n)
            values = Placeholder.like(value_states, held + n)
        hand_over(keys, AttentionRequest(self, None if view is None else FusedView(view, key_states, value_states)))
        return keys, values

    def _begin_update(self) -> None:
        """Hook: called at every `update` before anything is read or stored (checks, layout changes)."""

    def _end_update(self, new_tokens: int) -> None:
        """Hook: called at every `update` after the new tokens are stored."""

    def _segments_for_fused(self, new_tokens: int) -> list | None:
        """The segments to hand the fused attention for this update, or None to return plain tensors."""
        if self.fused_binding is None or not self.fused_binding.active() or new_tokens > self.fused_max_new:
            return None
        return self.attention_segments()

    def _empty(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch_size()
        kw = dict(dtype=self.dtype, device=self.device)
        return (torch.empty(b, self.num_heads, tokens, self.head_dim, **kw),
                torch.empty(b, self.num_heads, tokens, self.value_dim, **kw))

    def get_seq_length(self) -> int:
        """Tokens seen (also when some were evicted), so that positions stay right."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys attended, position of the first one): held tokens are the newest `held` of those seen."""
        held = self.tokens_held()
        return held + query_length, self.cumulative_length - held

    def get_max_length(self) -> int:
        return -1

    def replan(self, options: CacheOptions) -> None:
        """Run with new cache `options` (only where `replans`; `CompressedCache.replace_options` checks first)."""
        raise ValueError(f"{type(self).__name__} keeps the options it was built with")

    def reset(self) -> None:
        """Forget everything seen (a subclass also clears its own storage)."""
        self.cumulative_length = 0
        self.padding = None
        self.keys = self.values = None
        self.is_initialized = False

    def tokens_held(self) -> int:
        """Token positions held (0 before the first update)."""
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the layer stores, by name (what the lossless codec writes)."""
        raise NotImplementedError

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `state_tensors` (what the lossless codec restores; layers it restores provide it)."""
        raise NotImplementedError(f"{type(self).__name__} is not restored from named tensors")

    def batch_size(self) -> int:
        """Rows held (0 before the first update)."""
        raise NotImplementedError

    def _map_store(self, fn) -> None:
        """Apply the batch-dim operation `fn` (a tensor -> tensor) to every row-laid-out tensor stored."""
        raise NotImplementedError

    def _map_rows(self, fn) -> None:
        """Apply a batch-dim operation to everything kept per row."""
        self._map_store(fn)
        if self.padding is not None:
            self.padding = fn(self.padding)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def row_padding(self, batch: int) -> torch.Tensor | None:
        """`[batch]` leading padding positions of each row, or None when no row is padded. A padding vector set for
        fewer rows is repeated row by row (generate expands rows for beams / several samples after the prefill
        mask was recorded)."""
        p = self.padding
        if p is None or not bool(p.any()):
            return None
        if p.shape[0] != batch:
            if batch % p.shape[0]:
                raise ValueError(f"padding was set for {p.shape[0]} rows, the cache now holds {batch}; call "
                                 "cache.set_padding(attention_mask) with the mask of this batch")
            p = p.repeat_interleave(batch // p.shape[0])
        return p

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers passes a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.tokens_held():
            raise ValueError(f"cannot crop {n} tokens: this layer holds {self.tokens_held()}")
        self._crop_newest(n)
        self.cumulative_length -= n

    def _crop_newest(self, n: int) -> None:
        """Drop the newest `n` held tokens (1 <= n <= held; `crop` has checked). Token-aligned storage is sliced."""
        keep = self.tokens_held() - n
        self._map_store(lambda t: t[:, :, :keep])

    # ---- accounting ---------------------------------------------------------------------------------------------
    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer keeps (storage, statistics, codebooks): the bytes `nbytes` counts."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of the storage this layer's tensors hold (shared tensors included; `memory_stats` counts a tensor
        shared by several layers once)."""
        return held_bytes(self.held_tensors())

    def fp16_bytes(self) -> int:
        """Bytes a plain fp16 cache would hold for the tokens this layer has seen."""
        if not self.is_initialized:
            return 0
        batch = self.batch_size()
        tokens = self.cumulative_length
        if self.sliding_window is not None:  # what transformers' sliding layer keeps
            tokens = min(tokens, self.sliding_window - 1)
        return FP16_BYTES * batch * self.num_heads * tokens * (self.head_dim + self.value_dim)

    # ---- input checks -------------------------------------------------------------------------------------------
    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor) or not torch.is_floating_point(t):
                raise ValueError(f"{name} must be a floating-point torch.Tensor, got {getattr(t, 'dtype', type(t))}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be [batch, kv_heads, tokens, head_dim], got shape {tuple(t.shape)}")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(
                f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} disagree on batch/heads/tokens"
            )
        if self.is_initialized:
            if key_states.shape[-1] != self.head_dim or value_states.shape[-1] != self.value_dim:
                raise ValueError(
                    f"head_dim changed from {self.head_dim} to {key_states.shape[-1]} between calls; "
                    "use one cache per model (call cache.reset() before reusing it)"
                )
            if key_states.shape[1] != self.num_heads:
                raise ValueError(f"kv_heads changed from {self.num_heads} to {key_states.shape[1]} between calls")


class CompressedCache(Cache):
    """A `transformers.Cache` whose full-attention layers are `layer_class`; sliding-window layers are
    `layer_class` too when it `supports_sliding`, else what `_make_layer` gives (H2OCache with `quant_bits`: a
    quantized window; paged and CPAC: `uniform.QuantizedSlidingLayers`), else they stay as transformers makes them
    (they are bounded already), so mixed models generate correctly."""

    options_class: type[CacheOptions] = CacheOptions
    layer_class: type[CompressedLayer] = CompressedLayer
    # what generate sets up for the cache (registry._attention_for): the "hf_kvcache" attention, which reports the
    # attention mass its layers rank tokens by; and the fused attention reading the layers' segments in place
    needs_attention_mass: bool = False
    reads_fused: bool = False
    # generate prefills prompts longer than this in chunks of it, straight into the compressed storage (None: in one
    # forward, as transformers does by default); set it on an instance to change it for that cache
    prefill_chunk_size: int | None = 512

    def __init__(self, config: PreTrainedConfig | None = None, **options: Any) -> None:
        self.options = self.options_class.from_dict(options)
        # what `bind` / `set_padding` gave, also handed to layers a config-less cache creates at their first update
        self._binding: FusedBinding | None = None
        self._padding: torch.Tensor | None = None
        if config is None:
            super().__init__(layer_class_to_replicate=self._new_layer)
            return
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        layers = [self._make_layer(t, kw, i) for i, (t, kw) in enumerate(zip(layer_types, layer_kwargs))]
        super().__init__(layers=layers)

    def _new_layer(self):
        """A layer of a cache built without a config, made at the model's first call of that layer: a full-attention
        layer with the cache's options as they are then (`replace_options` reaches layers made later too)."""
        return self._make_layer("full_attention", {}, len(self.layers))

    def replace_options(self, options: CacheOptions) -> None:
        """Run with `options` (this cache's options class) from the next sequence on: every compressed layer replans
        (`CompressedLayer.replan`: at once if it holds nothing, else at `reset()`), layers made later take them.

        Raises:
            ValueError: options of another class, invalid options, or a layer that keeps the options it was built
                with (`replans` False)."""
        if type(options) is not type(self.options):
            raise ValueError(f"replace_options takes {type(self.options).__name__}, got {type(options).__name__}")
        options.validate()
        fixed = sorted({type(layer).__name__ for layer in self._compressed_layers() if not layer.replans})
        if fixed:
            raise ValueError(f"{', '.join(fixed)} keep(s) the options they were built with: build a new "
                             f"{type(self).__name__} with these options instead")
        self.options = options
        for layer in self._compressed_layers():
            layer.replan(options)

    def _make_layer(self, layer_type: str, kwargs: dict, layer_idx: int):
        if layer_type == "full_attention":
            return self.layer_class(self.options)
        if layer_type == "sliding_attention" and self.layer_class.supports_sliding:
            return self.layer_class(self.options, sliding_window=kwargs["sliding_window"])
        if layer_type in ("sliding_attention", "chunked_attention"):
            return DynamicSlidingWindowLayer(**kwargs)
        if layer_type == "dummy":
            return DummyLayer()
        raise ValueError(
            f"{type(self).__name__} supports full, sliding and chunked attention layers, not {layer_type!r}"
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if self.layer_class_to_replicate is None and layer_idx >= len(self.layers):
            raise ValueError(
                f"{type(self).__name__} was built for a config with {len(self.layers)} layers, but the model calls "
                f"layer {layer_idx}; build the cache with the model's own config: "
                f"{type(self).__name__}(config=model.config, ...)"
            )
        if self.layer_class_to_replicate is not None:  # created here (not in transformers) to hand over the binding
            while len(self.layers) <= layer_idx:
                layer = self.layer_class_to_replicate()
                if isinstance(layer, CompressedLayer):
                    layer.fused_binding, layer.padding = self._binding, self._padding
                self.layers.append(layer)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # ---- the fused attention ------------------------------------------------------------------------------------
    def bind(self, model: Any) -> bool:
        """Let `model` read this cache's compressed storage directly whenever it runs the `"hf_kvcache"` attention
        (other attention implementations keep getting dequantized tensors). Returns whether any layer can be read
        that way. `generate` binds (and switches the attention) by itself for caches whose `reads_fused` is set."""
        binding = self._binding = FusedBinding(model.config)
        for layer in self._compressed_layers():
            layer.fused_binding = binding
        # a cache built without a config creates its layers at the first update: they are bound then
        return bool(self._compressed_layers()) or self.layer_class_to_replicate is not None

    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Record the left padding of the batch about to be prefilled (`attention_mask [batch, tokens]`, 0 = pad),
        so that padding positions never enter the statistics (ranges, scales) of real tokens. `generate` calls it.
        Call it yourself before the first forward of a left-padded batch passed as `past_key_values`."""
        padding = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"set_padding takes the 2D [batch, tokens] attention mask, got {tuple(attention_mask.shape)}")
            real = attention_mask.bool()
            # leading zeros of each row (a row of only padding counts all its positions)
            padding = torch.where(real.any(1), real.int().argmax(1), real.shape[1]).to(torch.int64)
        self._padding = padding
        for layer in self._compressed_layers():
            layer.padding = padding

    def unbind(self) -> None:
        self._binding = None
        for layer in self._compressed_layers():
            layer.fused_binding = None

    def _compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def _layer_ropes(self, config: Any, what: str, instead: str, why: str,
                     kinds: tuple[type, ...]) -> list[tuple[Any, KeyRotation]]:
        """Each layer of `kinds` with its RoPE (`rope.KeyRotation`, by layer type: layers of one type share one
        object) from `config`; the errors say that `what` needs it (`why`) and to set `instead` otherwise."""
        if config is None:
            raise ValueError(f"{what} {why}, which needs the config: {type(self).__name__}(config=model.config, ...); "
                             f"or set {instead}")
        text = config.get_text_config(decoder=True)
        types = getattr(text, "layer_types", None) or [None] * len(self.layers)
        ropes: dict[str | None, KeyRotation] = {}
        for layer_type in types:
            if layer_type not in ropes:
                ropes[layer_type] = KeyRotation.from_config(config, layer_type=layer_type, user=what, instead=instead)
        return [(layer, ropes[layer_type]) for layer, layer_type in zip(self.layers, types) if isinstance(layer, kinds)]

    def memory_stats(self) -> dict[str, float]:
        return memory_stats(self)


def memory_stats(cache: Cache) -> dict[str, float]:
    """Bytes really held by every tensor `cache` keeps (each storage once: codes, scales, tails, rotations;
    for transformers' own layers, quantized or not, every tensor found on them), the fp16-equivalent bytes and
    their ratio."""
    held = fp16 = 0
    counted: set[tuple[str, int]] = set()
    for layer in cache.layers:
        if isinstance(layer, CompressedLayer):
            held += held_bytes(layer.held_tensors(), counted)
            fp16 += layer.fp16_bytes()
        else:
            held += held_bytes(tensors_in(layer, set()), counted)
            fp16 += fp16_equivalent(layer)
    return {
        "bytes": held,
        "fp16_bytes": fp16,
        "ratio": fp16 / held if held else float("nan"),
        "tokens": cache.get_seq_length(),
    }
