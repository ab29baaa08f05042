"""Uniform baselines: every token stored at the same precision (INT8, INT4 with two codes per byte, FP8).

Scales are per token and KV head, over groups of `group_size` channels, so new tokens are appended without touching
the ones already stored. Defaults come from measurements on SmolLM2-135M / Moby Dick (see README, "Uniform caches").

Sliding-window layers (Gemma-3's local layers) are quantized too: they keep the newest `sliding_window - 1` tokens,
as transformers' sliding layer does (same mask sizes).

`key_quant="prerope"` (the default for the integer formats when the cache has the model config and can undo its
RoPE) stores keys with RoPE undone, each channel shifted by its mean and divided by the square root of its RMS
(`quant.prerope`; fitted per layer and row from the row's first 32 real keys), before the per-token groups: the
fix for models whose keys carry large per-channel offsets (Qwen2.5's k bias: int4 +44 % -> +2.6 % perplexity).
Dividing by the full RMS equalizes the channels' ranges; by its square root, half-way, lost less on each zoo model
(README, "Uniform caches on the model zoo"). `"token"` quantizes keys as they come (fp8 keeps it by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import native_encode
from ..kernels.segments import TokenSegment
from ..options import CacheOptions, check_choice, check_positive_int
from ..quant.prerope import FIT_TOKENS, PreRopeKeys
from ..quant.uniform import FP8_DTYPES, QuantizedTensor, dequantize, quantize
from .base import CompressedCache, CompressedLayer
from .coded import CodedKV

DTYPES = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")
ALIASES = {"fp8": "fp8_e4m3"}
# dtype -> (bits, default group size (None: the whole head), default symmetric)
DEFAULTS = {"int8": (8, None, True), "int4": (4, 32, True), "fp8_e4m3": (8, None, True), "fp8_e5m2": (8, None, True)}
KEY_QUANT = ("token", "prerope")
KEY_SCALE_POWER = 0.5  # key_quant="prerope": channels divided by the square root of their RMS (README, "Uniform caches")


@dataclass
class UniformQuantOptions(CacheOptions):
    dtype: str = "int8"
    group_size: int | None = None
    symmetric: bool | None = None
    # "prerope": keys quantized with RoPE undone, channels normalized (module docstring); "token": as they come;
    # None: "prerope" for the integer formats when the cache has the model config and its RoPE is supported
    key_quant: str | None = None

    def validate(self) -> None:
        if self.key_quant is not None:
            check_choice("key_quant", self.key_quant, KEY_QUANT)
        self.dtype = ALIASES.get(self.dtype, self.dtype)
        check_choice("dtype", self.dtype, DTYPES + tuple(ALIASES))
        check_positive_int("group_size", self.group_size, allow_none=True)
        if self.symmetric is not None and not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be True, False or None, got {self.symmetric!r}")
        if self.dtype in FP8_DTYPES and self.symmetric is False:
            raise ValueError("fp8 formats are symmetric; leave symmetric unset")

    @property
    def bits(self) -> int:
        return DEFAULTS[self.dtype][0]

    @property
    def fmt(self) -> str:
        return self.dtype if self.dtype in FP8_DTYPES else "int"

    def resolved_group(self, head_dim: int) -> int:
        group = self.group_size or DEFAULTS[self.dtype][1] or head_dim
        if head_dim % group:
            raise ValueError(f"group_size={group} must divide head_dim={head_dim}")
        return group

    def resolved_symmetric(self) -> bool:
        return DEFAULTS[self.dtype][2] if self.symmetric is None else self.symmetric

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """`x [..., d]` in this format, scales per token over groups of channels (integer formats of `[b, h, n, d]`
        on the CPU: the native encoder, the same bits in one call)."""
        coded = self.native_codes(x)
        if coded is not None:
            return coded
        return quantize(x, self.fmt, self.bits, self.resolved_group(x.shape[-1]), self.resolved_symmetric())

    def native_codes(self, x: torch.Tensor, **transform: Any) -> QuantizedTensor | None:
        """This format's codes of `x [b, h, n, d]` from the native encoder (`transform`: its `angles`, `unscale`
        and `frame`, applied first), or None where it does not serve (fp8, other ranks, off the CPU, no compiler)."""
        if self.fmt != "int" or x.dim() != 4:
            return None
        return native_encode.encode(x, self.bits, self.resolved_group(x.shape[-1]), self.resolved_symmetric(),
                                    **transform)


@dataclass
class UniformPreRopeKeys(PreRopeKeys):
    """`PreRopeKeys` whose codes are the uniform cache's own format (`options`) instead of KIVI groups."""

    options: UniformQuantOptions | None = None

    def codes(self, x: torch.Tensor) -> QuantizedTensor:
        return self.options.quantize(x)

    def decode_codes(self, q: QuantizedTensor) -> torch.Tensor:
        return dequantize(q, torch.float32)

    def encode_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> QuantizedTensor:
        """`quantize_pre(derotate(keys, positions))` of a fitted codec (post-RoPE `keys [b, h, n, d]`, `positions`
        `[n]` or `[b, 1, n]`): on the CPU in one native call (the same bits), else through those two."""
        if self.fitted and self.options.fmt == "int":  # the angles only where the encoder may serve
            coded = self.options.native_codes(keys, angles=self.rope.cos_sin_at(positions), unscale=self.rope.scaling,
                                              frame=(self.shift, self.scale))
            if coded is not None:
                return coded
        return self.quantize_pre(self.derotate(keys, positions))


class UniformQuantLayer(CodedKV, CompressedLayer):
    """Keys and values quantized per token: `key_codes` / `value_codes` (`QuantizedTensor`: codes, scale and, when
    asymmetric, zero, each `[batch, kv_heads, tokens, ...]`), and `pending_keys` (model dtype) while pre-RoPE key
    statistics wait for rows to fill. With `sliding_window`, only the newest `sliding_window - 1` tokens are kept.
    Storage methods and the window's drop: `CodedKV`."""

    options: UniformQuantOptions
    supports_sliding = True

    def __init__(self, options: UniformQuantOptions, sliding_window: int | None = None) -> None:
        super().__init__(options)
        if sliding_window is not None:
            check_positive_int("sliding_window", sliding_window)
            self.sliding_window = sliding_window
            self.is_sliding = True
        self.key_codec: UniformPreRopeKeys | None = None  # key_quant="prerope"; set by UniformQuantCache
        self.rows_fitted: torch.Tensor | None = None  # [batch] bool while some rows' key statistics are not fitted
        self.key_codes: QuantizedTensor | None = None
        self.value_codes: QuantizedTensor | None = None
        self.pending_keys: torch.Tensor | None = None  # every key so far, while some row is not fitted (prerope)

    def _positions(self, start: int, n: int, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The true positions of cache indices start..start+n-1 (`[batch, 1, n]`: the index minus the row's left
        padding, so a padded row's keys are undone at the positions the model rotated them at, as alone) and which
        hold real tokens (`[batch, 1, n]` bool; None when no row is padded)."""
        index = torch.arange(start, start + n, device=self.device)
        pad = self.row_padding(batch)
        if pad is None:
            return index, None
        positions = (index[None] - pad.to(index.device)[:, None]).unsqueeze(1)
        return positions, positions >= 0

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.key_codec is None:
            self.key_codes = self._joined(self.key_codes, self.options.quantize(key_states))
        else:
            self._append_prerope(key_states)
        self.value_codes = self._joined(self.value_codes, self.options.quantize(value_states))
        self._keep_window()

    def _append_prerope(self, keys: torch.Tensor) -> None:
        """`key_quant="prerope"`: each row's key statistics are fitted from its own real keys once it has seen
        `FIT_TOKENS` real tokens (left padding does not count). Until every row is fitted the keys of all rows are
        held as they come (`pending_keys`, model dtype; a fitted row reads them through its codes, exactly what it
        would hold alone); then they, and every later key, are stored as codes of the pre-RoPE frame, each key
        quantized once."""
        codec, n, seen, b = self.key_codec, keys.shape[2], self.cumulative_length, keys.shape[0]
        pending, self.pending_keys = self.pending_keys, None
        if pending is None and codec.fitted:  # every row fitted
            positions, _ = self._positions(seen - n, n, b)
            self.key_codes = self._joined(self.key_codes, codec.encode_keys(keys, positions))
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
                self.key_codes = self._joined(self.key_codes, codec.quantize_pre(pre))
                return
        self.pending_keys = keys

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending_keys is None:
            return self._segment().dequantize(self.dtype)
        values = dequantize(self.value_codes, self.dtype)
        keys = self.pending_keys  # some row not fitted yet: fitted rows read their keys through their codes
        if self.rows_fitted is None:
            return keys, values
        positions, _ = self._positions(self.cumulative_length - keys.shape[2], keys.shape[2], keys.shape[0])
        codec = self.key_codec
        coded = codec.dequantize(codec.quantize_pre(codec.derotate(keys, positions)), positions, self.dtype)
        return torch.where(self.rows_fitted.view(-1, 1, 1, 1), coded, keys), values

    def _segment(self) -> TokenSegment:
        """The held codes (every row's key statistics fitted), pre-RoPE keys with their true positions."""
        keys, values = self.key_codes, self.value_codes
        if self.key_codec is None:
            return TokenSegment(keys, values)
        held = keys.codes.shape[2]
        positions, _ = self._positions(self.cumulative_length - held, held, keys.codes.shape[0])
        return TokenSegment(keys, values, self.key_codec, positions)

    def attention_segments(self) -> list | None:
        """The held codes as one `TokenSegment` the fused attention reads in place (once the key statistics of every
        row are fitted); None otherwise (the layer then hands over dequantized tensors)."""
        if self.pending_keys is not None or self.key_codes is None:
            return None
        return [self._segment()]

    # ---- storage and accounting (the rest: `CodedKV`) ----------------------------------------------------------
    def held_tensors(self) -> list[torch.Tensor]:
        return super().held_tensors() + ([] if self.rows_fitted is None else [self.rows_fitted])

    def _map_rows(self, fn) -> None:
        super()._map_rows(fn)
        codec = self.key_codec
        if codec is not None and codec.fitted:  # statistics per row (`per_row`): they follow their rows
            codec.shift, codec.scale = fn(codec.shift), fn(codec.scale)
        if self.rows_fitted is not None:
            self.rows_fitted = fn(self.rows_fitted)

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
        self.key_codes, self.value_codes = (self._loaded(tensors, prefix, n)
                                            for prefix, n in (("k", self.head_dim), ("v", self.value_dim)))
        if tensors:
            raise ValueError(f"unknown tensors for a uniform layer: {sorted(tensors)}")
        if shift is not None:
            self.key_codec.shift, self.key_codec.scale = shift, scale

    def _loaded(self, tensors: dict[str, torch.Tensor], prefix: str, n: int) -> QuantizedTensor | None:
        """The `QuantizedTensor` named `prefix` in `tensors` (popped), in this layer's format; None if absent."""
        codes = tensors.pop(f"{prefix}_codes", None)
        scale, zero = tensors.pop(f"{prefix}_scale", None), tensors.pop(f"{prefix}_zero", None)
        if codes is None:
            return None
        o = self.options
        return QuantizedTensor(codes, scale, zero, o.fmt, o.bits, o.resolved_group(n), n)

    def reset(self) -> None:
        super().reset()
        self.rows_fitted = None
        self._clear_codes()


class UniformQuantCache(CompressedCache):
    """INT8 / INT4 / FP8 KV cache. `UniformQuantCache(config=model.config, dtype="int4")`; sliding-window layers
    hold their window quantized; `key_quant` see the module docstring (`self.key_quant`: the mode in use)."""

    options_class = UniformQuantOptions
    layer_class = UniformQuantLayer
    reads_fused = True  # generate binds the cache to the model and runs the fused attention over its codes

    def __init__(self, config: Any = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.key_quant = attach_prerope_keys(self, config, self.options)


def attach_prerope_keys(cache: CompressedCache, config: Any, options: UniformQuantOptions) -> str:
    """Give every `UniformQuantLayer` of `cache` a pre-RoPE key codec when `options.key_quant` asks for one (None:
    for the integer formats when the config's RoPE can be undone); returns the mode in use, also written into
    `options.key_quant` (the lossless codec rebuilds from it)."""
    key_quant = options.key_quant or ("prerope" if options.fmt == "int" and config is not None else "token")
    if key_quant == "prerope":
        try:
            ropes = cache._layer_ropes(config, "key_quant='prerope'", "key_quant='token'", "undoes RoPE on the keys",
                                       kinds=(UniformQuantLayer,))
        except ValueError:
            if options.key_quant == "prerope":
                raise
            ropes, key_quant = [], "token"  # the default on a RoPE it cannot undo: keys as they come
        for layer, rope in ropes:
            layer.key_codec = UniformPreRopeKeys(rope, options.bits, scale_power=KEY_SCALE_POWER, per_row=True,
                                                 options=options)
    options.key_quant = key_quant
    return key_quant


SLIDING_DTYPES = ("auto", None) + DTYPES + tuple(ALIASES)


class QuantizedSlidingLayers:
    """For a cache whose own layers keep every token (paged, CPAC), placed before `CompressedCache` in its bases: its
    sliding-window layers (Gemma-3's local layers: most of its cache at a few thousand tokens) hold their window in
    a uniform format, `UniformQuantLayer(sliding_window=...)` in `sliding_dtype()` (None: left as transformers makes
    them, in the model's dtype), keys pre-RoPE where the RoPE can be undone. The cache calls
    `_attach_sliding_key_codecs(config)` at the end of its `__init__`."""

    _sliding_options: UniformQuantOptions | None = None

    def sliding_dtype(self) -> str | None:
        """The uniform format of the sliding-window layers (`options.sliding_dtype`; a cache resolves "auto")."""
        return self.options.sliding_dtype

    def _make_layer(self, layer_type: str, kwargs: dict, layer_idx: int):
        dtype = self.sliding_dtype()
        if layer_type == "sliding_attention" and dtype is not None:
            if self._sliding_options is None:
                self._sliding_options = UniformQuantOptions(dtype=dtype)
            return UniformQuantLayer(self._sliding_options, sliding_window=kwargs["sliding_window"])
        return super()._make_layer(layer_type, kwargs, layer_idx)

    def _attach_sliding_key_codecs(self, config: Any) -> None:
        if self._sliding_options is not None:
            attach_prerope_keys(self, config, self._sliding_options)
