"""How the codec reads and rebuilds each kind of cache layer: one small adapter per layer kind.

* `layer_kv(layer)`: keys and values `[batch, kv_heads, tokens, head_dim]` of what any layer holds (the lossy codec
  codes these): hf-kvcache layers through `materialize()`, transformers layers through `.keys` / `.values`.
* `LAYER_CODECS`: for the lossless codec, per exact layer class, `state(layer) -> LayerState` (scalars + every tensor
  the layer keeps) and `restore(layer, state)` (refill a freshly built layer of that class). hf-kvcache layers keep
  their tensors by name (`layer.state_tensors()`; tiered layers as typed tiers, `caches.tiers`); the derived state (rotation matrices, tier specs, dtypes) is rebuilt by calling
  `layer.lazy_initialization` with empty tensors of the stored shapes, then the tensors are put back. When a layer
  class changes how it keeps its tensors, only its adapter here changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..caches.base import CompressedLayer
from ..caches.tiered import KIVILayer, TieredQuantLayer
from ..caches.tiers import LayerTiers
from ..caches.coded import CodedLayer


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"corrupt KV blob: unknown dtype {name!r}")
    return dt


def layer_kv(layer: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[batch, kv_heads, tokens, head_dim]` of every token `layer` has seen (raises if the layer
    dropped some: evicting caches and sliding windows cannot be restored as a plain prefix)."""
    if not getattr(layer, "is_initialized", False):
        raise ValueError(f"layer {index} holds no tokens; encode a cache after a forward pass")
    if isinstance(layer, DynamicSlidingWindowLayer) or getattr(layer, "is_sliding", False):
        raise ValueError(
            f"layer {index} is a sliding-window layer: it keeps only its window, so the codec cannot restore it as a "
            "prefix; the codec supports caches whose layers hold every token seen"
        )
    if isinstance(layer, CompressedLayer):
        seen, held = layer.get_seq_length(), layer.tokens_held()
        if held != seen:
            raise ValueError(
                f"layer {index} ({type(layer).__name__}) holds {held} of the {seen} tokens it has seen (evicted or "
                "not yet stored); the codec needs every token of the prefix: encode a non-evicting cache"
            )
        return layer.materialize()
    if isinstance(layer, DynamicLayer):
        return layer.keys, layer.values
    raise ValueError(
        f"layer {index} is a {type(layer).__name__}, which the codec cannot read; supported: transformers' "
        "DynamicLayer and hf-kvcache layers"
    )


@dataclass
class LayerState:
    """Everything needed to rebuild one layer: scalars (JSON) and named tensors (cpu)."""

    scalars: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _store_state(layer: CompressedLayer) -> LayerState:
    scalars = {
        "cumulative_length": layer.cumulative_length,
        "dtype": dtype_name(layer.dtype),
        "num_heads": layer.num_heads,
        "head_dim": layer.head_dim,
        "value_dim": layer.value_dim,
        "batch": layer.batch_size(),
    }
    # every other plain attribute (flags, counters, names) the layer keeps, so that state a layer class adds later
    # travels too; objects and tensors are rebuilt by lazy_initialization instead
    scalars["attrs"] = {k: v for k, v in vars(layer).items() if k not in scalars and _plain(v)}
    return LayerState(scalars, {name: t.detach().cpu().contiguous() for name, t in layer.state_tensors().items()})


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _store_restore(layer: CompressedLayer, state: LayerState, device: torch.device) -> None:
    s = state.scalars
    dt = dtype_of(s["dtype"])
    b = s["batch"]
    # derived state (tier specs, tail dtype, rotations) comes from the layer's own lazy_initialization
    layer.lazy_initialization(torch.empty(b, s["num_heads"], 0, s["head_dim"], dtype=dt, device=device),
                              torch.empty(b, s["num_heads"], 0, s["value_dim"], dtype=dt, device=device))
    if isinstance(layer, TieredQuantLayer):
        layer.load_tiers(LayerTiers.from_state(s["tiers"], state.tensors, device))
    else:
        layer.load_state_tensors({name: t.to(device) for name, t in state.tensors.items()})
    layer.cumulative_length = s["cumulative_length"]
    for k, v in s.get("attrs", {}).items():
        if _plain(getattr(layer, k, None)):  # never replace an object the layer built (a recipe, a rotation)
            setattr(layer, k, v)


CALIB_QUERIES = "calib_queries"  # a calibrating tiered layer's queries `[batch, heads, <= window, head_dim]`


def _tiered_state(layer: TieredQuantLayer) -> LayerState:
    """The tiers and plain attributes, plus the per-layer recipe (the rotation chosen by calibration) where the
    layer has one."""
    state = _store_state(layer)
    state.scalars["tiers"] = layer.tiers.state()[0]
    recipe = getattr(layer, "recipe", None)
    if recipe is not None and hasattr(recipe, "to_dict"):
        state.scalars["recipe"] = recipe.to_dict()
    if layer.calibrating and layer._calib_queries is not None:  # queries seen, choice not made yet: they travel
        state.tensors[CALIB_QUERIES] = layer._calib_queries.detach().cpu().contiguous()
    return state


def _tiered_restore(layer: TieredQuantLayer, state: LayerState, device: torch.device) -> None:
    s = state.scalars
    if "recipe" in s:  # set before lazy_initialization, which builds the rotation from it
        from ..calibrate import LayerRecipe

        layer.recipe = LayerRecipe.from_dict(s["recipe"])
    tensors = dict(state.tensors)
    queries = tensors.pop(CALIB_QUERIES, None)
    _store_restore(layer, LayerState(s, tensors), device)
    if queries is not None:  # a layer restored mid-calibration chooses from the queries the original saw
        layer._calib_queries = queries.to(device)


def _dynamic_state(layer: DynamicLayer) -> LayerState:
    return LayerState({"dtype": dtype_name(layer.keys.dtype)},
                      {"keys": layer.keys.detach().cpu().contiguous(), "values": layer.values.detach().cpu().contiguous()})


def set_dynamic_layer(layer: DynamicLayer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Fill an empty transformers `DynamicLayer` with keys / values `[batch, kv_heads, tokens, head_dim]`."""
    layer.lazy_initialization(k[:, :, :0], v[:, :, :0])
    layer.keys, layer.values = k, v
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = k.shape[2]


def _dynamic_restore(layer: DynamicLayer, state: LayerState, device: torch.device) -> None:
    k, v = state.tensors["keys"].to(device), state.tensors["values"].to(device)
    layer.lazy_initialization(k[:, :, :0], v[:, :, :0])
    layer.keys, layer.values = k, v
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = k.shape[2]


@dataclass
class LayerCodec:
    kind: str
    state: Callable[[Any], LayerState]
    restore: Callable[[Any, LayerState, torch.device], None]


# exact class -> adapter; subclasses are not matched implicitly (their state may differ)
LAYER_CODECS: dict[type, LayerCodec] = {
    DynamicLayer: LayerCodec("dynamic", _dynamic_state, _dynamic_restore),
    CodedLayer: LayerCodec("uniform", _store_state, _store_restore),
    TieredQuantLayer: LayerCodec("tiered", _tiered_state, _tiered_restore),
    KIVILayer: LayerCodec("kivi", _tiered_state, _tiered_restore),
}


def layer_codec(layer: Any, index: int) -> LayerCodec:
    codec = LAYER_CODECS.get(type(layer))
    if codec is None:
        names = sorted(c.__name__ for c in LAYER_CODECS)
        raise ValueError(
            f"layer {index} is a {type(layer).__name__}: lossless mode supports {names}; use mode='lossy' for it"
        )
    if not getattr(layer, "is_initialized", False):
        raise ValueError(f"layer {index} holds no tokens; encode a cache after a forward pass")
    return codec
