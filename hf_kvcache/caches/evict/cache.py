"""`H2OCache`: token eviction -- heavy hitters (H2O), TOVA, SnapKV, expected attention, key norm, recency, attention
sinks, strides, a hybrid, or any registered policy -- optionally storing the kept tokens quantized.

    cache = H2OCache(config=model.config, budget=0.2, policy="snapkv")      # keep 20 % of the tokens seen
    cache = H2OCache(config=model.config, budget=0.4, policy=AdaKV(TOVAPolicy()), quant=TokenQuant(bits=4))
    model.generate(ids, cache_implementation="h2o", cache_config={"budget": 256, "policy": "tova", "quant_bits": 4})

Options: `options.EvictOptions` (budget, policy, quantization; the flat `cache_config` keys map onto them). Layers:
`layer.H2OLayer` (storage `[batch, kv_heads, kept, ...]` per layer in `slots.Slots`; each KV head keeps its own tokens,
the same count for every head and row so the tensors stay rectangular, except with `AdaKV`, stored compactly between
forwards). With `quant`, the model's sliding-window layers hold their window quantized (`caches.coded`).

Every policy needs the `"hf_kvcache"` attention (for the scores, and for the padding of the new tokens). With another
attention implementation the next `update` raises an error that says what to set; `generate(cache_implementation=
"h2o")` switches the model by itself (`needs_attention_mass`). `crop` works while nothing was evicted yet
(`crop`).
"""

from __future__ import annotations

from typing import Any

from ...quant.prerope import PreRopeKeys
from ..base import CompressedCache, CompressedLayer
from ..coded import CodedLayer
from .layer import MISSING_MASS, H2OLayer
from .options import EvictOptions
from .reconstruct import share_across_layers


class H2OCache(CompressedCache):
    """Evicting KV cache: `H2OCache(config=model.config, budget=0.2, policy="h2o")`. See the module docstring."""

    options_class = EvictOptions
    layer_class = H2OLayer
    needs_attention_mass = True  # generate(cache_implementation=...) switches the model to the hf_kvcache attention

    def __init__(self, config: Any = None, **options: Any) -> None:
        super().__init__(config, **options)
        policy, quant = self.options.policy, self.options.quant
        if policy.needs_rope():
            what = f"policy={policy.core.name!r}"
            for layer, rope in self._layer_ropes(config, what, "future=0", "moves the recent queries by the model's "
                                                 "RoPE", kinds=(H2OLayer,)):
                layer.rope = rope
        if self.options.prerope_keys:
            what = "quant_bits with key_quant='prerope' (the default)"
            ropes = self._layer_ropes(config, what, "key_quant='token'", "undoes RoPE on the keys",
                                      kinds=(H2OLayer, CodedLayer))
            for layer, rope in ropes:
                layer.key_codec = PreRopeKeys(rope, quant.bits, quant.group_size)
        if policy.layer_scales(2) != [1.0, 1.0]:
            if config is None:
                raise ValueError("pyramid (per-layer budgets) needs the model config: "
                                 "H2OCache(config=model.config, ...)")
            # the first evicting layer holds the most slots: the shared attention mask is built for it, and every
            # later layer reads the mask's last columns (`mask_from_end`)
            layers = [layer for layer in self.layers if isinstance(layer, H2OLayer)]
            for layer, scale in zip(layers, policy.layer_scales(len(layers))):
                layer.budget_scale = scale

    def _make_layer(self, layer_type: str, kwargs: dict, layer_idx: int):
        """With `quant`, sliding-window layers hold their window as codes of that format (`coded.CodedLayer`)."""
        if layer_type == "sliding_attention" and self.options.quant is not None:
            return CodedLayer(self.options.quant, sliding_window=kwargs["sliding_window"])
        return super()._make_layer(layer_type, kwargs, layer_idx)

    def evict_to(self, tokens: int, protect_last: int = 0) -> None:
        """Evict now, between two forwards, every layer down to `tokens` slots per (row, KV head) (`Pyramid`: that
        many x the layer's scale), scored by the policy as at the end of a forward (window policies with the last
        queries seen), keeping the `protect_last` newest tokens whatever their score.

        For a compression at a chosen point -- e.g. once a question has been prefilled after its context (question-
        aware passkey, `hf_kvcache.eval.suites.passkey`): build the cache with `budget=1.0` (it then never evicts by
        itself), prefill, call `evict_to(context_budget + question_tokens, protect_last=question_tokens)`, decode.
        A cache whose own budget is smaller evicts again at the end of the next forward."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"evict_to keeps `tokens` slots per KV head: an int >= 1, got {tokens!r}")
        if isinstance(protect_last, bool) or not isinstance(protect_last, int) or not 0 <= protect_last <= tokens:
            raise ValueError(
                f"protect_last must be an int in [0, tokens={tokens}] (the newest tokens kept), got {protect_last!r}"
            )
        layers = [layer for layer in self.layers if isinstance(layer, H2OLayer) and layer.slots is not None]
        for layer in layers:
            if layer._pending:
                raise RuntimeError(MISSING_MASS.format(cls=type(layer).__name__, policy=layer.policy.core.name))
        if layers and self.options.policy.core.joint_layers:
            share_across_layers(layers, tokens, protect_last)
        for layer in layers:
            budget = max(protect_last, 1, round(tokens * layer.budget_scale))
            layer._expand()
            layer.evict(budget, protect_last)  # ragged heads: compact again
            if layer.ring is not None and len(layer.ring) > layer.query_window:  # evicted: crop can no longer undo
                layer.ring = layer.ring.last(layer.query_window) if layer.query_window else None

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """(keys, offset) of the mask of layer `layer_idx`'s kind, built for the evicting layer that holds the most
        slots (per-layer budgets: `Pyramid`, joint layer budgets); a layer holding fewer reads its last columns
        (`H2OLayer.mask_from_end`). Takes the arguments of `transformers.Cache.get_mask_sizes`."""
        kv_length, kv_offset = super().get_mask_sizes(*args, **kwargs)
        layer_idx = kwargs["layer_idx"] if "layer_idx" in kwargs else (args[1] if len(args) > 1 else 0)
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if not isinstance(layer, H2OLayer) or layer.slots is None:
            return kv_length, kv_offset
        extra = max(other.tokens_held() for other in self.layers if isinstance(other, H2OLayer)) - layer.tokens_held()
        return kv_length + extra, kv_offset - extra

    def tokens_held(self, layer_idx: int = 0) -> int:
        """Slots held per (row, KV head) by layer `layer_idx`."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer.tokens_held() if isinstance(layer, CompressedLayer) else 0
