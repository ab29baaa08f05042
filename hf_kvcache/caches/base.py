"""`CompressedLayer` (one model layer's compressed storage) and `CompressedCache` (the thin container).

Attention hook: `update` tags the key tensor it returns with `LAYER_ATTR` (the layer itself), so the registered
`"hf_kvcache"` attention function can find the layer, read its compressed storage directly, and, when the layer sets
`wants_attention_mass`, report the attention each held token received through `observe_attention`.

A layer keeps everything it stores in `self.store`, a dict of tensors laid out `[batch, kv_heads, tokens, ...]`.
Because every stored tensor has the batch on dim 0 and the tokens on dim 2, beam reordering, batch selection,
repetition and cropping are implemented once here. A layer whose storage is not token-aligned overrides them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, QuantizedLayer
from transformers.cache_utils import get_layer_types_and_kwargs

from ..options import CacheOptions
from ..kernels.segments import positions_held

FP16_BYTES = 2
LAYER_ATTR = "_hf_kvcache_layer"


def layer_of(keys: torch.Tensor) -> "CompressedLayer | None":
    """The hf-kvcache layer that returned `keys` from `update`, if any."""
    return getattr(keys, LAYER_ATTR, None)


class CompressedLayer(DynamicLayer):
    """Base of every hf-kvcache layer: input checks, token counting, byte accounting, the batch/beam contract.

    Subclasses implement `append(keys, values)` (store new tokens) and `materialize()` (keys and values of the
    stored tokens, in the model's dtype, for attention implementations that need plain tensors).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True
    wants_attention_mass = False  # set by policies (H2O, CPAC) that rank tokens by the attention they receive
    # Set by the fused attention kernel once it has seen this layer: `update` then hands over a compressed view
    # (`fused_view`) and placeholder tensors instead of dequantized keys/values. Only layers that implement
    # `attention_segments` are ever enrolled; `reset` clears it.
    fused_reader = False

    def __init__(self, options: CacheOptions | None = None) -> None:
        super().__init__()
        self.options = options
        self.store: dict[str, torch.Tensor] = {}
        self.cumulative_length = 0

    # ---- what subclasses provide -------------------------------------------------------------------------------
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attention_segments(self) -> list | None:
        """The held tokens as `hf_kvcache.kernels.segments` (quantized / full), in key order; None when this layer
        has no storage the fused attention can read directly."""
        return None

    def fused_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` for the fused attention: snapshot the stored segments (references, no copy; storage is replaced,
        never written in place), store the new tokens, and return zero-stride placeholders tagged with this layer.
        The attention reads `self.fused_view = (segments, new keys, new values)`."""
        segments = self.attention_segments() or []
        self.cumulative_length += key_states.shape[-2]
        self.append(key_states, value_states)
        self.fused_view = (segments, key_states, value_states)
        total = positions_held(segments) + key_states.shape[-2]
        b, h = key_states.shape[:2]
        keys = key_states.new_zeros(()).expand(b, h, total, key_states.shape[-1])
        values = value_states.new_zeros(()).expand(b, h, total, value_states.shape[-1])
        setattr(keys, LAYER_ATTR, self)
        return keys, values

    def observe_attention(self, mass: torch.Tensor) -> None:
        """Attention mass `[batch, kv_heads, tokens]` received by the keys of the last `update` (held tokens first,
        then the new ones), summed over the query heads of each KV group and over the query positions."""

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
        """Store the new tokens; return keys and values of everything held (past decoded, new tokens as given)."""
        self._check_states(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.fused_reader:
            return self.fused_update(key_states, value_states)
        if self.tokens_held() > 0:
            past_k, past_v = self.materialize()
            keys = torch.cat([past_k, key_states], dim=-2)
            values = torch.cat([past_v, value_states], dim=-2)
        else:
            keys, values = key_states, value_states
        self.cumulative_length += key_states.shape[-2]
        self.append(key_states, value_states)
        setattr(keys, LAYER_ATTR, self)
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen (also when some were evicted), so that positions stay right."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens_held() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = {}
        self.cumulative_length = 0
        self.fused_reader = False
        self.fused_view = None
        self.keys = self.values = None
        self.is_initialized = False

    def tokens_held(self) -> int:
        first = next(iter(self.store.values()), None)
        return 0 if first is None else first.shape[2]

    def _map_store(self, fn) -> None:
        self.store = {name: fn(t) for name, t in self.store.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_store(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_store(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_store(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers passes a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.tokens_held():
            raise ValueError(f"cannot crop {n} tokens: this layer holds {self.tokens_held()}")
        keep = self.tokens_held() - n
        self._map_store(lambda t: t[:, :, :keep])
        self.cumulative_length -= n

    # ---- accounting ---------------------------------------------------------------------------------------------
    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.store.values())

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held_tensors())

    def fp16_bytes(self) -> int:
        """Bytes a plain fp16 cache would hold for the tokens this layer has seen."""
        if not self.is_initialized:
            return 0
        batch = next(iter(self.store.values())).shape[0] if self.store else 0
        return FP16_BYTES * batch * self.num_heads * self.cumulative_length * (self.head_dim + self.value_dim)

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
    """A `transformers.Cache` whose full-attention layers are `layer_class`; sliding-window layers stay as
    transformers makes them (they are bounded already), so mixed models generate correctly."""

    options_class: type[CacheOptions] = CacheOptions
    layer_class: type[CompressedLayer] = CompressedLayer

    def __init__(self, config: PreTrainedConfig | None = None, **options: Any) -> None:
        self.options = self.options_class.from_dict(options)
        if config is None:
            super().__init__(layer_class_to_replicate=functools.partial(self.layer_class, self.options))
            return
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        layers = [self._make_layer(t, kw, i) for i, (t, kw) in enumerate(zip(layer_types, layer_kwargs))]
        super().__init__(layers=layers)

    def _make_layer(self, layer_type: str, kwargs: dict, layer_idx: int):
        if layer_type == "full_attention":
            return self.layer_class(self.options)
        if layer_type in ("sliding_attention", "chunked_attention"):
            return DynamicSlidingWindowLayer(**kwargs)
        if layer_type == "dummy":
            return DummyLayer()
        raise ValueError(
            f"{type(self).__name__} supports full, sliding and chunked attention layers, not {layer_type!r}"
        )

    def memory_stats(self) -> dict[str, float]:
        return memory_stats(self)


def _quantized_peer_bytes(q: Any) -> tuple[int, tuple | None]:
    """(real bytes, logical [batch, heads, tokens, dim] shape) of the quantized states of a transformers
    `QuantizedLayer`: an optimum-quanto QTensor (packed `_data`, `_scale`, `_shift`) or an hqq (codes, meta) tuple."""
    if q is None:
        return 0, None
    if isinstance(q, tuple):  # hqq: (packed codes, meta dict with scale / zero)
        codes, meta = q
        held = codes.nbytes + sum(meta[k].nbytes for k in ("scale", "zero") if isinstance(meta.get(k), torch.Tensor))
        return held, tuple(meta.get("shape", ())) or None
    held = 0
    for name in ("_data", "_scale", "_shift"):
        t = getattr(q, name, None)
        inner = getattr(t, "_data", None)  # quanto's PackedTensor reports the unpacked shape; its `_data` is packed
        t = inner if isinstance(inner, torch.Tensor) else t
        if isinstance(t, torch.Tensor):
            held += t.nbytes
    return held, tuple(q.shape)


def _peer_quantized_layer_bytes(layer: Any) -> tuple[int, int]:
    """transformers' `QuantizedLayer` (quanto / hqq backends): quantized states plus the residual keys/values."""
    held = per_token = 0
    for q, residual in ((getattr(layer, "_quantized_keys", None), layer.keys),
                        (getattr(layer, "_quantized_values", None), layer.values)):
        b, shape = _quantized_peer_bytes(q)
        held += b
        if isinstance(residual, torch.Tensor):
            held += residual.nbytes
        if shape is not None and len(shape) == 4:
            per_token += shape[0] * shape[1] * shape[3]
        elif isinstance(residual, torch.Tensor) and residual.dim() == 4:
            per_token += residual.shape[0] * residual.shape[1] * residual.shape[3]
    fp16 = FP16_BYTES * per_token * getattr(layer, "cumulative_length", 0)
    return held, fp16


def _layer_bytes(layer: Any) -> tuple[int, int]:
    """(bytes held, fp16 bytes of a plain cache of the same tokens) for any transformers or hf-kvcache layer."""
    if isinstance(layer, CompressedLayer):
        return layer.nbytes(), layer.fp16_bytes()
    if isinstance(layer, QuantizedLayer):
        return _peer_quantized_layer_bytes(layer)
    held = fp16 = 0
    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
        if isinstance(t, torch.Tensor):
            held += t.nbytes
            fp16 += t.numel() * FP16_BYTES
    return held, fp16


def memory_stats(cache: Cache) -> dict[str, float]:
    """Bytes really held by the tensors of `cache`, the fp16-equivalent bytes and their ratio."""
    held = fp16 = 0
    for layer in cache.layers:
        h, f = _layer_bytes(layer)
        held, fp16 = held + h, fp16 + f
    return {
        "bytes": held,
        "fp16_bytes": fp16,
        "ratio": fp16 / held if held else float("nan"),
        "tokens": cache.get_seq_length(),
    }
