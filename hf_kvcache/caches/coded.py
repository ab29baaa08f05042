"""`CodedKV`: the storage half of a layer that holds keys and values as per-token codes, written once for the uniform
layer (`caches.uniform`) and the evicting cache's quantized sliding-window layer (`caches.window`).

Such a layer keeps `key_codes` and `value_codes` (token-aligned quantized tensors, `quant.rows.TokenRows`: every
field `[batch, kv_heads, tokens, ...]`), optionally `pending_keys` (keys in the model's dtype while a pre-RoPE frame
waits for its statistics) and a `key_codec` whose statistics count as held. A sliding-window layer
(`sliding_window` set) keeps only the newest `sliding_window - 1` tokens, as transformers' sliding layer does, and
cannot be cropped once it has dropped tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..quant.rows import TokenRows
from .base import CompressedLayer


def check_window_crop(layer: CompressedLayer, n: int) -> None:
    """Raise when `layer` (a sliding-window layer) has dropped tokens: cropping `n` cannot restore them."""
    if layer.cumulative_length > layer.tokens_held():
        raise ValueError(
            f"cannot crop {n} token(s): this sliding-window layer has dropped the tokens before its window, so "
            "it cannot become the layer that never saw the cropped ones; crop before the window fills"
        )


class CodedKV:
    """Mixin for a `CompressedLayer` holding per-token codes (see the module docstring): the storage methods the base
    declares (`tokens_held`, `batch_size`, `_map_store`, `held_tensors`, `_crop_newest`), the sliding window's drop
    and the reset of what it holds."""

    key_codes: TokenRows | None = None
    value_codes: TokenRows | None = None
    pending_keys: torch.Tensor | None = None
    key_codec = None  # a pre-RoPE key codec (its `tensors()`: the statistics held), or None
    sliding_window: int | None = None

    def tokens_held(self) -> int:
        return 0 if self.value_codes is None else self.value_codes.tokens

    def batch_size(self) -> int:
        return 0 if self.value_codes is None else self.value_codes.codes.shape[0]

    def _map_store(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.key_codes is not None:
            self.key_codes = self.key_codes.map_rows(fn)
        if self.value_codes is not None:
            self.value_codes = self.value_codes.map_rows(fn)
        if self.pending_keys is not None:
            self.pending_keys = fn(self.pending_keys)

    def held_tensors(self) -> list[torch.Tensor]:
        held = [t for q in (self.key_codes, self.value_codes) if q is not None for t in q.tensors()]
        held += [] if self.pending_keys is None else [self.pending_keys]
        return held + ([] if self.key_codec is None else self.key_codec.tensors())

    def _crop_newest(self, n: int) -> None:
        check_window_crop(self, n)
        keep = self.tokens_held() - n
        self._map_store(lambda t: t[:, :, :keep])

    @staticmethod
    def _joined(held: TokenRows | None, new: TokenRows) -> TokenRows:
        """`new` appended to `held` along the tokens."""
        return new if held is None else held.cat(new)

    def _keep_window(self) -> None:
        """With `sliding_window`, drop the tokens no later query can see (copies: no view keeps them alive)."""
        drop = self.tokens_held() - (self.sliding_window - 1) if self.sliding_window is not None else 0
        if drop > 0:
            self._map_store(lambda t: t[:, :, drop:].clone())

    def _clear_codes(self) -> None:
        """Forget the codes, the pending keys and the key codec's statistics (for `reset`)."""
        self.key_codes = self.value_codes = self.pending_keys = None
        if self.key_codec is not None:
            self.key_codec.shift = self.key_codec.scale = None
