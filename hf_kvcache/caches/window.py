"""`QuantizedWindowLayer`: a sliding-window layer (Gemma-3's local layers) that holds its window quantized.

`H2OCache` with `quant` (`quant.token.TokenQuant`) uses it for the model's sliding-window layers. Those layers see
only the last `sliding_window` positions, so there is nothing to evict by score: the layer keeps the newest
`sliding_window - 1` tokens, as transformers' sliding layer does (same mask sizes), stored as KIVI per-token codes
of `quant.bits` (keys pre-RoPE, shifted and scaled per channel with `key_quant="prerope"`: `quant.prerope`). Without
it those layers would stay in the model's dtype and hold most of the cache (15 of Gemma-3-270M's 18 layers).

Storage (`caches.coded.CodedKV`): `key_codes` / `value_codes`, `KIVIQuantized` (codes `[batch, kv_heads, held,
packed]`, fp16 scale / zero `[.., groups]`); the held tokens are the positions `seen - held .. seen - 1`.
"""

from __future__ import annotations

import torch

from ..options import check_positive_int
from ..quant.kivi import KIVIQuantized, dequantize_kivi
from ..quant.prerope import PreRopeKeys
from ..quant.token import TokenQuant
from .base import CompressedLayer
from .coded import CodedKV


class QuantizedWindowLayer(CodedKV, CompressedLayer):
    """The newest `sliding_window - 1` tokens of a sliding-window layer, quantized (see the module docstring); storage
    and the window's drop: `CodedKV`."""

    supports_sliding = True

    def __init__(self, quant: TokenQuant, sliding_window: int) -> None:
        super().__init__()
        check_positive_int("sliding_window", sliding_window)
        self.quant = quant
        self.sliding_window = sliding_window
        self.is_sliding = True
        self.key_codec: PreRopeKeys | None = None  # key_quant="prerope"; set by H2OCache
        self.key_codes: KIVIQuantized | None = None
        self.value_codes: KIVIQuantized | None = None

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n = key_states.shape[2]
        held_k = self.key_codes
        if self.key_codec is not None:
            held_k, new_k = self.key_codec.encode(key_states, self.cumulative_length - n, held_k)
        else:
            new_k = self.quant.quantize(key_states)
        new_v = self.quant.quantize(value_states)
        self.key_codes = self._joined(held_k, new_k)
        self.value_codes = self._joined(self.value_codes, new_v)
        self._keep_window()

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.tokens_held()
        if self.key_codec is None:
            keys = dequantize_kivi(self.key_codes, self.dtype)
        else:
            positions = torch.arange(self.cumulative_length - held, self.cumulative_length, device=self.device)
            keys = self.key_codec.dequantize(self.key_codes, positions, self.dtype)
        return keys, dequantize_kivi(self.value_codes, self.dtype)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for kind, q in (("key", self.key_codes), ("value", self.value_codes)):
            if q is not None:
                out.update({f"{kind}_codes": q.codes, f"{kind}_scale": q.scale, f"{kind}_zero": q.zero})
        return out

    def reset(self) -> None:
        super().reset()
        self._clear_codes()
