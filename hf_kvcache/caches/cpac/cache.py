"""`CPACCache`: the container of CPAC layers, their shared memory budget and key rotation, and their statistics."""

from __future__ import annotations

import math
from typing import Any

from transformers import PreTrainedConfig

from ...rope import KeyRotation
from ..base import CompressedCache
from ..base import memory_stats as _memory_stats
from ..uniform import QuantizedSlidingLayers
from .layer import CPACLayer, _Budget
from .options import CPACOptions


class CPACCache(QuantizedSlidingLayers, CompressedCache):
    """Cross-page adaptive compression. `CPACCache(config=model.config, memory_budget=0.5, delta_bits=8)`. Sliding-window
    layers (Gemma-3) hold their window per token in `sliding_dtype` (`QuantizedSlidingLayers`)."""

    options_class = CPACOptions
    layer_class = CPACLayer
    needs_attention_mass = True  # generate(cache_implementation="cpac") switches the model to the hf_kvcache attention

    def __init__(self, config: PreTrainedConfig | None = None, **options: Any) -> None:
        parsed = CPACOptions.from_dict(options)
        self._budget = _Budget(parsed)
        self._rotation = None
        if parsed.key_space == "derotated":
            if config is None:
                raise ValueError("key_space='derotated' needs config=model.config (its RoPE parameters)")
            self._rotation = KeyRotation.from_config(config)
        super().__init__(config, **options)
        self._attach_sliding_key_codecs(config)
        self._budget.options = self.options

    def _make_layer(self, layer_type: str, kwargs: dict, layer_idx: int):
        if layer_type == "full_attention":
            return CPACLayer(self.options, self._budget, self._rotation)
        return super()._make_layer(layer_type, kwargs, layer_idx)

    def sliding_dtype(self) -> str | None:
        return "int8" if self.options.sliding_dtype == "auto" else self.options.sliding_dtype

    def cpac_layers(self) -> list[CPACLayer]:
        return [layer for layer in self.layers if isinstance(layer, CPACLayer)]

    def compress_ready(self) -> int:
        """Compress every page that is ready now, in every layer (normally done by update / observe_attention)."""
        return sum(layer.compress_ready() for layer in self.cpac_layers())

    def memory_stats(self) -> dict[str, float]:
        """Bytes held (sum of nbytes), fp16 equivalent and ratio, pages per kind (keys and values counted apart),
        bytes per kind, the pressure the thresholds follow, the measured pressure and the current threshold."""
        stats = _memory_stats(self)
        for layer in self.cpac_layers():
            for k, v in layer.page_counts().items():
                stats[k] = stats.get(k, 0) + v
            for k, v in layer.bytes_by_kind().items():
                stats[f"{k}_bytes"] = stats.get(f"{k}_bytes", 0) + v
        stats["tail_tokens"] = max((layer.tail_tokens() for layer in self.cpac_layers()), default=0)
        stats["pressure"] = self._budget.pressure()
        stats["measured_pressure"] = self._budget.measured_pressure()
        stats["threshold"] = self._budget.threshold()
        return stats

    def timing_stats(self) -> dict[str, float]:
        """Time spent compressing / decompressing, per block (one page of one row and KV head, keys and values),
        summed over the layers since the cache was made."""
        t = {"compress_s": 0.0, "compress_blocks": 0, "decompress_s": 0.0, "decompress_blocks": 0}
        for layer in self.cpac_layers():
            for k in t:
                t[k] += layer.timing[k]
        t["compress_ms_per_block"] = 1e3 * t["compress_s"] / t["compress_blocks"] if t["compress_blocks"] else math.nan
        t["decompress_ms_per_block"] = (
            1e3 * t["decompress_s"] / t["decompress_blocks"] if t["decompress_blocks"] else math.nan
        )
        return t
