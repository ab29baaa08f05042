"""Bytes a cache holds: each tensor's storage counted once (`held_bytes`), every tensor reachable from a layer that is
not ours (`tensors_in`), and what an fp16 cache would hold for a transformers layer (`fp16_equivalent`).
`caches.base.memory_stats` adds them up over a cache's layers."""

from __future__ import annotations

from typing import Any

import torch
from transformers import cache_utils

FP16_BYTES = 2
SCALE_ZERO_BYTES = 4  # one fp16 scale and one fp16 zero per quantization group
# before transformers 5.21 its quantized layers' base is QuantizedLayer
BaseQuantizedLayer = getattr(cache_utils, "BaseQuantizedLayer", None) or cache_utils.QuantizedLayer


def tensors_in(obj: Any, seen: set[int], depth: int = 0) -> list[torch.Tensor]:
    """Every plain tensor reachable from `obj` (attributes, tuples, lists, dicts; wrapper tensor subclasses such as
    optimum-quanto's QTensor through their inner tensors), each object visited once."""
    if depth > 6 or id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None:
            names, _ = obj.__tensor_flatten__()
            return [t for n in names for t in tensors_in(getattr(obj, n), seen, depth + 1)]
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in tensors_in(item, seen, depth + 1)]


def held_bytes(tensors: list[torch.Tensor], counted: set[tuple[str, int]] | None = None) -> int:
    """Bytes of the storage behind `tensors`, each storage once (a view holds all of its storage alive; shared
    tensors such as one rotation matrix used by every layer count once). `counted` carries over between calls."""
    counted = set() if counted is None else counted
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in counted or storage.data_ptr() == 0:
            continue
        counted.add(key)
        total += storage.nbytes()
    return total


def fp16_equivalent(layer: Any) -> int:
    """Bytes an fp16 cache would hold for the tokens a transformers layer has seen."""
    if isinstance(layer, BaseQuantizedLayer):
        per_token = 0
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                per_token += t.shape[0] * t.shape[1] * t.shape[3]
        if not per_token:
            for q in (layer._quantized_keys, layer._quantized_values):
                q = q[0] if isinstance(q, tuple) and isinstance(q[0], torch.Tensor) else q
                shape = tuple(q[1].get("shape", ())) if isinstance(q, tuple) else tuple(getattr(q, "shape", ()))
                if len(shape) == 4:
                    per_token += shape[0] * shape[1] * shape[3]
        return FP16_BYTES * per_token * getattr(layer, "cumulative_length", 0)
    return sum(t.numel() * FP16_BYTES for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, torch.Tensor))
