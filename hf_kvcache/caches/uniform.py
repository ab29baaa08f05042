"""Uniform baselines: every token stored at the same precision (INT8, INT4 with two codes per byte, FP8).

Scales are per token and KV head, over groups of `group_size` channels, so new tokens are appended without touching
the ones already stored. Defaults come from measurements on SmolLM2-135M / Moby Dick (see README, "Uniform caches").

Layers: `coded.CodedLayer` with these options as their format. Sliding-window layers (Gemma-3's local layers) are
quantized too: they keep the newest `sliding_window - 1` tokens, as transformers' sliding layer does (same mask
sizes).

`key_quant="prerope"` (the default for the integer formats when the cache has the model config and can undo its
RoPE) stores keys with RoPE undone, each channel shifted by its mean and divided by the square root of its RMS
(`quant.prerope`; fitted per layer and row from the row's first 32 real keys), before the per-token groups: the
fix for models whose keys carry large per-channel offsets (Qwen2.5's k bias: int4 +44 % -> +2.6 % perplexity).
Dividing by the full RMS equalizes the channels' ranges; by its square root, half-way, lost less on each zoo model
(README, "Uniform caches on the model zoo"). `"token"` quantizes keys as they come (fp8 keeps it by default).

`rotation="hadamard"` multiplies keys (in the frame they are coded in: the normalized pre-RoPE one with `"prerope"`)
and values by a randomized Hadamard rotation (`quant.rotation.hadamard_rotation`, seed 0) before the per-token groups
and by its transpose after decoding: the same bytes, an outlier channel spread over the whole head. The fused kernels
do not read rotated codes, so such a layer hands the attention dequantized keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import native_encode
from ..options import CacheOptions, check_choice, check_positive_int
from ..quant.prerope import PreRopeKeys
from ..quant.rotation import HadamardRotation, hadamard_rotation
from ..quant.uniform import FP8_DTYPES, QuantizedTensor, dequantize, quantize
from .base import CompressedCache
from .coded import CodedLayer

DTYPES = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")
ALIASES = {"fp8": "fp8_e4m3"}
# dtype -> (bits, default group size (None: the whole head), default symmetric)
DEFAULTS = {"int8": (8, None, True), "int4": (4, 32, True), "fp8_e4m3": (8, None, True), "fp8_e5m2": (8, None, True)}
KEY_QUANT = ("token", "prerope")
ROTATIONS = ("none", "hadamard")
KEY_SCALE_POWER = 0.5  # key_quant="prerope": channels divided by the square root of their RMS (README, "Uniform caches")


@dataclass
class UniformQuantOptions(CacheOptions):
    """The uniform formats (a `quant.rows.TokenFormat`: the layers' codes), how keys are quantized and whether keys
    and values are rotated first (module docstring)."""

    dtype: str = "int8"
    group_size: int | None = None
    symmetric: bool | None = None
    # "prerope": keys quantized with RoPE undone, channels normalized (module docstring); "token": as they come;
    # None: "prerope" for the integer formats when the cache has the model config and its RoPE is supported
    key_quant: str | None = None
    rotation: str = "none"  # "hadamard": keys and values rotated before their groups (module docstring)

    @property
    def reads_in_place(self) -> bool:
        """Whether the fused attention reads these codes as they are (not rotated ones)."""
        return self.rotation == "none"

    def validate(self) -> None:
        check_choice("rotation", self.rotation, ROTATIONS)
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

    def rotation_of(self, n: int, device: torch.device) -> HadamardRotation | None:
        """The rotation applied to a last dim of `n` before quantizing (None without one); `n` must be a power of
        two."""
        if self.rotation == "none":
            return None
        if n & (n - 1):
            raise ValueError(f"rotation='hadamard' needs a power-of-two head_dim, got {n}; use rotation='none'")
        return hadamard_rotation(n, 0, device)

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """`x [..., d]` in this format, scales per token over groups of channels (integer formats of `[b, h, n, d]`
        on the CPU: the native encoder, the same bits in one call), rotated first with `rotation`."""
        return self.quantize_into(x, None)

    def quantize_into(self, x: torch.Tensor, out: QuantizedTensor | None) -> QuantizedTensor:
        """`quantize(x)`, written by the native encoder into `out` (rows of a larger storage) where it takes them."""
        r = self.rotation_of(x.shape[-1], x.device)
        if r is not None:
            x = r.rotate(x)
        coded = self.native_codes(x, out=out)
        if coded is not None:
            return coded
        return quantize(x, self.fmt, self.bits, self.resolved_group(x.shape[-1]), self.resolved_symmetric())

    def native_codes(self, x: torch.Tensor, **transform: Any) -> QuantizedTensor | None:
        """This format's codes of `x [b, h, n, d]` from the native encoder (`transform`: its `angles`, `unscale`,
        `frame`, applied first, and `out`), or None where it does not serve (fp8, other ranks, off the CPU, no
        compiler)."""
        if self.fmt != "int" or x.dim() != 4:
            return None
        return native_encode.encode(x, self.bits, self.resolved_group(x.shape[-1]), self.resolved_symmetric(),
                                    **transform)

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of `quantize`: `[..., d]` in `dtype`."""
        r = self.rotation_of(q.n, q.codes.device)
        return dequantize(q, dtype) if r is None else r.unrotate(dequantize(q, torch.float32)).to(dtype)

    def tensors(self, n: int, device: torch.device) -> list[torch.Tensor]:
        """The tensors of the rotation of a last dim of `n` that the codes need to be read (none without one)."""
        r = self.rotation_of(n, device)
        return [] if r is None else r.tensors()

    def rows(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, n: int) -> QuantizedTensor:
        """Codes of this format from their stored tensors (`n`: the dim before packing)."""
        return QuantizedTensor(codes, scale, zero, self.fmt, self.bits, self.resolved_group(n), n)


@dataclass
class UniformPreRopeKeys(PreRopeKeys):
    """`PreRopeKeys` whose codes are the uniform cache's own format (`options`) instead of KIVI groups."""

    options: UniformQuantOptions | None = None

    def codes(self, x: torch.Tensor) -> QuantizedTensor:
        return self.options.quantize(x)

    def decode_codes(self, q: QuantizedTensor) -> torch.Tensor:
        return self.options.dequantize(q, torch.float32)

    def encode_keys(self, keys: torch.Tensor, positions: torch.Tensor, out: QuantizedTensor | None = None
                    ) -> QuantizedTensor:
        """`quantize_pre(derotate(keys, positions))` of a fitted codec (post-RoPE `keys [b, h, n, d]`, `positions`
        `[n]` or `[b, 1, n]`): on the CPU in one native call (the same bits; written into `out` where it takes
        them), else through those two."""
        if self.fitted and self.options.fmt == "int" and self.options.rotation == "none":  # where the encoder serves
            angles = self.rope.cos_sin_shared(positions)
            coded = self.options.native_codes(keys, angles=angles, unscale=self.rope.scaling,
                                              frame=(self.shift, self.scale), out=out)
            if coded is not None:
                return coded
        return self.quantize_pre(self.derotate(keys, positions))


# the uniform cache's layer under the name it was exported by: `coded.CodedLayer` holding `UniformQuantOptions` codes
UniformQuantLayer = CodedLayer


class UniformQuantCache(CompressedCache):
    """INT8 / INT4 / FP8 KV cache. `UniformQuantCache(config=model.config, dtype="int4")`; sliding-window layers
    hold their window quantized; `key_quant` see the module docstring (`self.key_quant`: the mode in use)."""

    options_class = UniformQuantOptions
    layer_class = CodedLayer
    reads_fused = True  # generate binds the cache to the model and runs the fused attention over its codes

    def __init__(self, config: Any = None, **options: Any) -> None:
        super().__init__(config, **options)
        self.key_quant = attach_prerope_keys(self, config, self.options)


def attach_prerope_keys(cache: CompressedCache, config: Any, options: UniformQuantOptions) -> str:
    """Give every `CodedLayer` of `cache` a pre-RoPE key codec when `options.key_quant` asks for one (None:
    for the integer formats when the config's RoPE can be undone); returns the mode in use, also written into
    `options.key_quant` (the lossless codec rebuilds from it)."""
    key_quant = options.key_quant or ("prerope" if options.fmt == "int" and config is not None else "token")
    if key_quant == "prerope":
        try:
            ropes = cache._layer_ropes(config, "key_quant='prerope'", "key_quant='token'", "undoes RoPE on the keys",
                                       kinds=(CodedLayer,))
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
    a uniform format, `CodedLayer(options, sliding_window=...)` in `sliding_dtype()` (None: left as transformers makes
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
            return CodedLayer(self._sliding_options, sliding_window=kwargs["sliding_window"])
        return super()._make_layer(layer_type, kwargs, layer_idx)

    def _attach_sliding_key_codecs(self, config: Any) -> None:
        if self._sliding_options is not None:
            attach_prerope_keys(self, config, self._sliding_options)
