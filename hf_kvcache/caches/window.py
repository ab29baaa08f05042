"""`QuantizedWindowLayer`: a sliding-window layer (Gemma-3's local layers) that holds its window quantized.

`H2OCache` with `quant` (`quant.token.TokenQuant`) uses it for the model's sliding-window layers. Those layers see
only the last `sliding_window` positions, so there is nothing to evict by score: the layer keeps the newest
`sliding_window - 1` tokens, as transformers' sliding layer does (same mask sizes), stored as KIVI per-token codes
of `quant.bits` (keys pre-RoPE, shifted and scaled per channel with `key_quant="prerope"`: `quant.prerope`). Without
it those layers would stay in the model's dtype and hold most of the cache (15 of Gemma-3-270M's 18 layers).

Storage: `keys` / `values`: `KIVIQuantized` (codes `[batch, kv_heads, held, packed]`, fp16 scale / zero `[.., groups]`);
the held tokens are the positions `seen - held .. seen - 1`.
"""

from __future__ import annotations

import torch

from ..options import check_positive_int
from ..quant.kivi import KIVIQuantized, dequantize_kivi
from ..quant.prerope import PreRopeKeys
from ..quant.token import TokenQuant
from .base import CompressedLayer


def check_window_crop(layer: CompressedLayer, n: int) -> None:
    """Raise when `layer` (a sliding-window layer) has dropped tokens: cropping `n` cannot restore them."""
    if layer.cumulative_length > layer.tokens_held():
        raise ValueError(
            f"cannot crop {n} token(s): this sliding-window layer has dropped the tokens before its window, so "
            "it cannot become the layer that never saw the cropped ones; crop before the window fills"
        )


class QuantizedWindowLayer(CompressedLayer):
    """The newest `sliding_window - 1` tokens of a sliding-window layer, quantized (see the module docstring)."""

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
        keys = new_k if held_k is None else held_k.cat(new_k)
        values = new_v if self.value_codes is None else self.value_codes.cat(new_v)
        drop = keys.tokens - (self.sliding_window - 1)
        if drop > 0:  # positions no later query can see; copies, so that no view keeps the dropped rows alive
            keys, values = keys.slice(drop).clone(), values.slice(drop).clone()
        self.key_codes, self.value_codes = keys, values

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.tokens_held()
        if self.key_codec is None:
            keys = dequantize_kivi(self.key_codes, self.dtype)
        else:
            positions = torch.arange(self.cumulative_length - held, self.cumulative_length, device=self.device)
            keys = self.key_codec.dequantize(self.key_codes, positions, self.dtype)
        return keys, dequantize_kivi(self.value_codes, self.dtype)

    def tokens_held(self) -> int:
        return 0 if self.key_codes is None else self.key_codes.tokens

    def batch_size(self) -> int:
        return 0 if self.key_codes is None else self.key_codes.codes.shape[0]

    def held_tensors(self) -> list[torch.Tensor]:
        stats = [] if self.key_codec is None else self.key_codec.tensors()
        held = [] if self.key_codes is None else self.key_codes.tensors() + self.value_codes.tensors()
        return held + stats

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for kind, q in (("key", self.key_codes), ("value", self.value_codes)):
            if q is not None:
                out.update({f"{kind}_codes": q.codes, f"{kind}_scale": q.scale, f"{kind}_zero": q.zero})
        return out

    def _map_store(self, fn) -> None:
        if self.key_codes is not None:
            self.key_codes, self.value_codes = self.key_codes.map_rows(fn), self.value_codes.map_rows(fn)

    def _crop_newest(self, n: int) -> None:
        check_window_crop(self, n)
        keep = self.tokens_held() - n
        self.key_codes, self.value_codes = self.key_codes.slice(0, keep), self.value_codes.slice(0, keep)

    def reset(self) -> None:
        super().reset()
        self.key_codes = self.value_codes = None
        if self.key_codec is not None:
            self.key_codec.shift = self.key_codec.scale = None
