"""`CodedLayer`: the one layer that holds keys and values as per-token codes. It is the uniform cache's layer, and the
quantized sliding-window layer of every cache that has one (uniform, evicting, paged, CPAC: Gemma-3's local layers).

What the codes are comes from a `TokenFormat` (`quant.rows`): `UniformQuantOptions` (INT8 / INT4 / FP8, scales per
token over groups of channels; the fused attention reads them in place) or `quant.token.TokenQuant` (KIVI per-token
groups, the evicting cache's format). Keys may be held in a pre-RoPE frame (`key_codec`, a `quant.prerope.PreRopeKeys`)
whose per-channel statistics are fitted in one of two ways, which the codec declares:

- `per_row=True` (the uniform format's `UniformPreRopeKeys`): each batch row's statistics come from its own first
  `FIT_TOKENS` real tokens (left padding does not count); until every row is fitted the keys are held as they come
  (`pending_keys`, model dtype), and RoPE is undone at each row's true positions.
- `per_row=False` (the evicting cache's `PreRopeKeys`): one set of statistics per layer, fitted once the positions
  seen reach `FIT_TOKENS` from the keys held then, which are coded again with them; RoPE is undone at the cache's
  indices.

Storage: `key_codes` / `value_codes` (token-aligned `quant.rows.TokenRows`, every field `[batch, kv_heads, held,
...]`; on the CPU views of the first rows of a `quant.rows.RowBuffer`'s storage, whose spare rows a decode step
writes its token into and which count as held), `pending_keys` while some row waits for its statistics, and the key codec's statistics (counted as held).
With `sliding_window` the layer keeps only the newest `sliding_window - 1` tokens, as transformers' sliding layer
does (same mask sizes), and cannot be cropped once it has dropped tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..kernels.segments import TokenSegment
from ..options import check_positive_int
from ..quant.prerope import FIT_TOKENS, PreRopeKeys
from ..quant.rows import RowBuffer, TokenFormat, TokenRows
from ..rope import version_of
from .base import CompressedLayer


_RANGES: dict[tuple, tuple[torch.Tensor, int]] = {}


def index_range(start: int, n: int, device: torch.device) -> torch.Tensor:
    """`arange(start, start + n)` on `device`, the same tensor while it is asked again unchanged (every layer of a
    decode step asks for the same ranges: its angles are then computed once); callers only read it."""
    key = (start, n, device, torch.is_inference_mode_enabled())
    hit = _RANGES.get(key)
    if hit is not None and hit[1] == version_of(hit[0]):
        return hit[0]
    if len(_RANGES) >= 8:
        _RANGES.clear()
    index = torch.arange(start, start + n, device=device)
    _RANGES[key] = (index, version_of(index))
    return index


def check_window_crop(layer: CompressedLayer, n: int) -> None:
    """Raise when `layer` (a sliding-window layer) has dropped tokens: cropping `n` cannot restore them."""
    if layer.cumulative_length > layer.tokens_held():
        raise ValueError(
            f"cannot crop {n} token(s): this sliding-window layer has dropped the tokens before its window, so "
            "it cannot become the layer that never saw the cropped ones; crop before the window fills"
        )


class CodedLayer(CompressedLayer):
    """Keys and values as per-token codes of `fmt` (see the module docstring); `sliding_window`: keep only the newest
    `sliding_window - 1` tokens.

    Args:
        fmt: the codes' format (`UniformQuantOptions` or `TokenQuant`); also the layer's `options`.
        sliding_window: the model's window for a sliding-window layer, None for a full-attention layer.
    """

    supports_sliding = True

    def __init__(self, fmt: TokenFormat, sliding_window: int | None = None) -> None:
        super().__init__(fmt)
        self.format = fmt
        if sliding_window is not None:
            check_positive_int("sliding_window", sliding_window)
            self.sliding_window = sliding_window
            self.is_sliding = True
        self.key_codec: PreRopeKeys | None = None  # pre-RoPE keys; set by the cache
        self.rows_fitted: torch.Tensor | None = None  # [batch] bool while some rows' key statistics are not fitted
        self.key_codes: TokenRows | None = None
        self.value_codes: TokenRows | None = None
        self.pending_keys: torch.Tensor | None = None  # every key so far, while some row is not fitted (per_row)
        self.key_buffer: RowBuffer = RowBuffer()  # spare rows the key codes are appended into
        self.value_buffer: RowBuffer = RowBuffer()

    def _new_buffers(self) -> None:
        """Fresh `RowBuffer`s for the keys' and values' codes (no spare rows: the next append allocates them)."""
        self.key_buffer, self.value_buffer = RowBuffer(), RowBuffer()

    def _positions(self, start: int, n: int, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The positions at which RoPE is undone for cache indices start..start+n-1: with a per-row key codec and
        left padding `[batch, 1, n]` (the index minus the row's padding, so a padded row's keys are undone where the
        model rotated them, as alone), else the indices `[n]`; and which hold real tokens (`[batch, 1, n]` bool;
        None when no row is padded or the codec is shared)."""
        index = index_range(start, n, self.device)
        pad = self.row_padding(batch) if self.key_codec.per_row else None
        if pad is None:
            return index, None
        positions = (index[None] - pad.to(index.device)[:, None]).unsqueeze(1)
        return positions, positions >= 0

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        codec, n = self.key_codec, key_states.shape[2]
        if codec is None:
            self.key_codes = self.key_buffer.append(self.key_codes, self._coded(key_states, self.key_buffer,
                                                                                self.key_codes))
        elif codec.per_row:
            self._append_row_fitted(key_states)
        else:
            held, new = codec.encode(key_states, self.cumulative_length - n, self.key_codes)
            self.key_codes = self.key_buffer.append(held, new)
        self.value_codes = self.value_buffer.append(self.value_codes, self._coded(value_states, self.value_buffer,
                                                                                  self.value_codes))
        self._keep_window()

    def _coded(self, x: torch.Tensor, buffer: RowBuffer, held: TokenRows | None) -> TokenRows:
        """The codes of `x` in the format, written into `buffer`'s spare rows behind `held` where the format and the
        buffer take them (`TokenFormat.quantize_into`, `RowBuffer.spare`)."""
        into = getattr(self.format, "quantize_into", None)
        out = None if into is None else buffer.spare(held, x.shape[2])
        return self.format.quantize(x) if out is None else into(x, out)

    def _append_row_fitted(self, keys: torch.Tensor) -> None:
        """Pre-RoPE keys with statistics per row (module docstring): each row is fitted from its own real keys once
        it has seen `FIT_TOKENS` real tokens. Until every row is fitted the keys of all rows are held as they come
        (`pending_keys`; a fitted row reads them through its codes, exactly what it would hold alone); then they,
        and every later key, are stored as codes of the pre-RoPE frame, each key quantized once."""
        codec, n, seen, b = self.key_codec, keys.shape[2], self.cumulative_length, keys.shape[0]
        pending, self.pending_keys = self.pending_keys, None
        if pending is None and codec.fitted:  # every row fitted
            positions, _ = self._positions(seen - n, n, b)
            out = self.key_buffer.spare(self.key_codes, n)
            self.key_codes = self.key_buffer.append(self.key_codes, codec.encode_keys(keys, positions, out=out))
            return
        keys = keys.clone() if pending is None else torch.cat([pending, keys], 2)  # never a view of the input
        held = keys.shape[2]
        pad = self.row_padding(b)
        real_seen = torch.full((b,), seen, device=keys.device) if pad is None else seen - pad
        ready = real_seen >= FIT_TOKENS
        fitted = self.rows_fitted if self.rows_fitted is not None else torch.zeros_like(ready)
        if bool((ready & ~fitted).any()):
            positions, real = self._positions(seen - held, held, b)
            pre = codec.derotate(keys, positions)
            old = (codec.shift, codec.scale)
            codec.fit(pre, None if real is None else real.expand(pre.shape[:-1]))
            if old[0] is not None:  # rows fitted earlier keep their statistics
                keep = fitted.view(-1, 1, 1, 1)
                codec.shift, codec.scale = torch.where(keep, old[0], codec.shift), torch.where(keep, old[1], codec.scale)
            self.rows_fitted = fitted = fitted | ready
            if bool(fitted.all()):
                self.rows_fitted = None
                self.key_codes = self.key_buffer.append(self.key_codes, codec.quantize_pre(pre))
                return
        self.pending_keys = keys

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.format.dequantize(self.value_codes, self.dtype)
        codec, keys = self.key_codec, self.pending_keys
        if keys is None:
            if codec is None:
                return self.format.dequantize(self.key_codes, self.dtype), values
            return codec.dequantize(self.key_codes, self._held_positions(), self.dtype), values
        if self.rows_fitted is None:  # no row fitted yet: the keys as they came
            return keys, values
        positions, _ = self._positions(self.cumulative_length - keys.shape[2], keys.shape[2], keys.shape[0])
        coded = codec.dequantize(codec.quantize_pre(codec.derotate(keys, positions)), positions, self.dtype)
        return torch.where(self.rows_fitted.view(-1, 1, 1, 1), coded, keys), values

    def attention_segments(self) -> list | None:
        """The held codes as one `TokenSegment` the fused attention reads in place (a format it reads, once the key
        statistics of every row are fitted); None otherwise (the layer then hands over dequantized tensors)."""
        if not self.format.reads_in_place or self.pending_keys is not None or self.key_codes is None:
            return None
        keys, values = self.key_codes, self.value_codes
        if self.key_codec is None:
            return [TokenSegment(keys, values)]
        return [TokenSegment(keys, values, self.key_codec, self._held_positions())]

    def _held_positions(self) -> torch.Tensor:
        """The positions at which the held key codes' RoPE is redone (`_positions` of the held tokens)."""
        held, batch = self.key_codes.codes.shape[2], self.key_codes.codes.shape[0]
        return self._positions(self.cumulative_length - held, held, batch)[0]

    # ---- storage and accounting -------------------------------------------------------------------------------
    def tokens_held(self) -> int:
        return 0 if self.value_codes is None else self.value_codes.tokens

    def batch_size(self) -> int:
        return 0 if self.value_codes is None else self.value_codes.codes.shape[0]

    def _map_store(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._new_buffers()  # the spare rows go with the old storage
        if self.key_codes is not None:
            self.key_codes = self.key_codes.map_rows(fn)
        if self.value_codes is not None:
            self.value_codes = self.value_codes.map_rows(fn)
        if self.pending_keys is not None:
            self.pending_keys = fn(self.pending_keys)

    def _map_rows(self, fn) -> None:
        super()._map_rows(fn)
        codec = self.key_codec
        if codec is not None and codec.fitted and codec.per_row:  # statistics per row: they follow their rows
            codec.shift, codec.scale = fn(codec.shift), fn(codec.scale)
        if self.rows_fitted is not None:
            self.rows_fitted = fn(self.rows_fitted)

    def held_tensors(self) -> list[torch.Tensor]:
        held = [t for q in (self.key_codes, self.value_codes) if q is not None for t in q.tensors()]
        held += [] if self.pending_keys is None else [self.pending_keys]
        held += [] if self.key_codec is None else self.key_codec.tensors()
        extra = getattr(self.format, "tensors", None)  # optional in a `TokenFormat`: e.g. a rotation's tensors
        if extra is not None and self.value_codes is not None:  # shared by the layers (one storage, counted once)
            dims = {self.value_dim} | ({self.head_dim} if self.key_codes is not None else set())
            held += [t for n in sorted(dims) for t in extra(n, self.device)]
        return held + ([] if self.rows_fitted is None else [self.rows_fitted])

    def _crop_newest(self, n: int) -> None:
        check_window_crop(self, n)
        keep = self.tokens_held() - n
        self._map_store(lambda t: t[:, :, :keep])

    def _keep_window(self) -> None:
        """With `sliding_window`, drop the tokens no later query can see (copies: no view keeps them alive)."""
        drop = self.tokens_held() - (self.sliding_window - 1) if self.sliding_window is not None else 0
        if drop > 0:
            self._map_store(lambda t: t[:, :, drop:].clone())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The stored codes and scales by name (`k_codes`, `k_scale`, `k_zero`, the same for `v`; `k_pending`), plus
        `key_shift` / `key_scale` once pre-RoPE keys are fitted and `key_rows_fitted` while some row is not."""
        out = {}
        for prefix, q in (("k", self.key_codes), ("v", self.value_codes)):
            if q is not None:
                out.update({f"{prefix}_{name}": getattr(q, name) for name in q.row_fields()})
        if self.pending_keys is not None:
            out["k_pending"] = self.pending_keys
        if self.key_codec is not None and self.key_codec.fitted:
            out.update(key_shift=self.key_codec.shift, key_scale=self.key_codec.scale)
        if self.rows_fitted is not None:
            out["key_rows_fitted"] = self.rows_fitted
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `state_tensors` (after `lazy_initialization`, which sets the head dims): the key statistics go
        back to the codec, the codes to `key_codes` / `value_codes`."""
        tensors = dict(tensors)
        shift, scale = tensors.pop("key_shift", None), tensors.pop("key_scale", None)
        self.rows_fitted = tensors.pop("key_rows_fitted", None)
        if shift is not None and self.key_codec is None:
            raise ValueError("these codes hold pre-RoPE keys, but this cache stores keys as they come: rebuild it "
                             "with key_quant='prerope' and the model config")
        self.pending_keys = tensors.pop("k_pending", None)
        self._new_buffers()
        self.key_codes, self.value_codes = (self._loaded(tensors, prefix, n)
                                            for prefix, n in (("k", self.head_dim), ("v", self.value_dim)))
        if tensors:
            raise ValueError(f"unknown tensors for a coded layer: {sorted(tensors)}")
        if shift is not None:
            self.key_codec.shift, self.key_codec.scale = shift, scale

    def _loaded(self, tensors: dict[str, torch.Tensor], prefix: str, n: int) -> TokenRows | None:
        """The codes named `prefix` in `tensors` (popped), in this layer's format; None if absent."""
        fields = {name: tensors.pop(f"{prefix}_{name}", None) for name in ("codes", "scale", "zero")}
        return None if fields["codes"] is None else self.format.rows(n=n, **fields)

    def reset(self) -> None:
        super().reset()
        self.rows_fitted = None
        self.key_codes = self.value_codes = self.pending_keys = None
        self._new_buffers()
        if self.key_codec is not None:
            self.key_codec.shift = self.key_codec.scale = None
