"""Keys quantized per token in the pre-RoPE frame, each channel shifted and scaled first: `PreRopeKeys`.

Why: a cache that evicts tokens holds them in an arbitrary, changing set of positions, so it quantizes per token (a
group never spans two slots). Per-token groups of post-RoPE keys fail on models whose keys carry large per-channel
offsets (Qwen2.5's k bias): a few channels set every group's range and crush the rest, and RoPE spins those offsets
with the position, so no fixed correction fits them. Undoing RoPE first makes each channel's statistics position-
free; subtracting each channel's mean and dividing by its RMS then gives every channel a comparable range, which
per-token groups quantize about as well as KIVI's per-channel groups do (the error of a channel scales with its RMS).

Codes: `KIVIQuantized` of `(R(-t) k_t - shift) / scale` (`[batch, kv_heads, tokens, packed]`, per-token fp16 scale /
zero), read back as `R(t) (x * scale + shift)`. `shift` / `scale` are float32 `[1, kv_heads, 1, head_dim]`, fitted
once per layer (`fit`) from the first keys it sees (shared by every batch row, so a reorder or a batch selection
leaves them valid). Positions are the cache's indices: with left padding a row's true positions differ from them by
a constant, and undoing then redoing RoPE at the same index is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..rope import KeyRotation
from .kivi import KIVIQuantized, dequantize_kivi, quantize_kivi

MIN_SCALE = 1e-4  # a channel whose keys never vary is divided by this rather than by 0
FIT_TOKENS = 32  # keys a layer has seen when it fits the per-channel shift and scale (from the keys it holds then)


@dataclass
class PreRopeKeys:
    """Quantizer of one layer's keys (see the module docstring): `rope` the model's RoPE for the layer, `bits` /
    `group_size` the KIVI per-token groups; `shift` / `scale` (float32 `[1, kv_heads, 1, head_dim]`, `[batch, ...]`
    with `per_row`) are None until `fit` (until then keys are quantized pre-RoPE with no shift and a unit scale);
    `scale` is the channel's RMS about its mean to the power `scale_power`."""

    rope: KeyRotation
    bits: int
    group_size: int | None = None
    shift: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    scale_power: float = 1.0  # each channel is divided by its RMS to this power (1: unit RMS; 0: shifted only)
    per_row: bool = False  # statistics `[batch, ...]` of each row's own keys (a row then codes as it would alone)

    @property
    def fitted(self) -> bool:
        return self.shift is not None

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.shift is None else [self.shift, self.scale]

    def derotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE `keys [b, h, n, d]` at `positions` (broadcastable to `[b, h, n]`) -> pre-RoPE, float32."""
        return self.rope.derotate_at(keys, positions)

    def fit(self, pre: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Per-channel mean and RMS about it of pre-RoPE keys `pre [b, h, n, d]`, over rows and tokens (over each
        row's tokens with `per_row`; a row with no real token takes the statistics of all rows), counting only the
        tokens where `weight [b, h, n]` (bool) is True when given."""
        w = torch.ones(pre.shape[:-1], device=pre.device) if weight is None else weight.float()
        w = w.unsqueeze(-1)

        def moments(dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            count = w.sum(dim=dims, keepdim=True)
            mean = (pre * w).sum(dim=dims, keepdim=True) / count.clamp_min(1.0)
            var = ((pre - mean).square() * w).sum(dim=dims, keepdim=True) / count.clamp_min(1.0)
            return count, mean, var

        _, shift, var = moments((0, 2))
        if self.per_row:
            count, row_shift, row_var = moments((2,))
            shift, var = torch.where(count > 0, row_shift, shift), torch.where(count > 0, row_var, var)
        scale = var.sqrt().clamp_min(MIN_SCALE)
        self.shift, self.scale = shift, scale if self.scale_power == 1.0 else scale.pow(self.scale_power)

    def codes(self, x: torch.Tensor) -> KIVIQuantized:
        """The per-token codes of normalized keys `x [b, h, n, d]` (KIVI groups of `group_size`); a subclass may
        store another format (`caches.uniform`)."""
        return quantize_kivi(x, self.bits, self.group_size or x.shape[-1], axis="token")

    def decode_codes(self, q: KIVIQuantized) -> torch.Tensor:
        """Inverse of `codes`: `[b, h, n, d]` float32."""
        return dequantize_kivi(q, torch.float32)

    def quantize_pre(self, pre: torch.Tensor) -> KIVIQuantized:
        """Codes of pre-RoPE keys `pre [b, h, n, d]` (float32)."""
        if self.fitted:
            pre = (pre - self.shift) / self.scale
        return self.codes(pre)

    def dequantize_pre(self, q: KIVIQuantized) -> torch.Tensor:
        """The pre-RoPE keys `[b, h, n, d]` (float32) that `q` holds."""
        pre = self.decode_codes(q)  # a new tensor: scaled and shifted in place
        return pre.mul_(self.scale).add_(self.shift) if self.fitted else pre

    def encode(self, keys: torch.Tensor, start: int, held: KIVIQuantized | None = None,
               held_valid: torch.Tensor | None = None) -> tuple[KIVIQuantized | None, KIVIQuantized]:
        """Codes of the new post-RoPE `keys [b, h, n, d]` (positions start..start+n-1), and the codes of the keys
        held already (`held`, their padding flags `held_valid [b, h, held]`). The stats are fitted, from the held
        and the new keys, once the positions seen reach `FIT_TOKENS` (a layer that holds fewer, a small budget or a
        short window, fits from what it holds); the few keys held before then (quantized pre-RoPE with no shift and
        a unit scale) are quantized again with them, so their new codes come back; otherwise `held` comes back as it
        is."""
        n = keys.shape[2]
        pre = self.derotate(keys, torch.arange(start, start + n, device=keys.device))
        if not self.fitted and start + n >= FIT_TOKENS:
            if held is None:
                self.fit(pre)
            else:
                old = self.dequantize_pre(held)
                valid = held_valid if held_valid is not None else torch.ones(
                    old.shape[:-1], dtype=torch.bool, device=old.device)
                new = torch.ones(pre.shape[:-1], dtype=torch.bool, device=pre.device)
                self.fit(torch.cat([old, pre], 2), torch.cat([valid, new], 2))
                held = self.quantize_pre(old)
        return held, self.quantize_pre(pre)

    def dequantize(self, q: KIVIQuantized, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The post-RoPE keys `[b, h, n, d]` in `dtype` that `q` holds for the slots at `positions [b, h, n]`."""
        return self.rope.rotate_at(self.dequantize_pre(q), positions).to(dtype)
