"""An online quality proxy for quantized tiers: the relative squared error of every block a layer quantizes.

When a block of keys/values `[batch, kv_heads, tokens, dim]` is quantized into a tier, `QualityTracker.record`
decodes it once more and adds `||x - x_hat||^2` and `||x||^2` per tier and tensor (keys / values), measured in the
basis the codes live in (rotations are orthogonal, so the error is the same as in the model's basis; a KVQuant archive
compares pre-RoPE keys). A block re-quantized from a warmer tier adds the error of that step only: the errors of
independent roundings add, so the archive's error relative to the original is about warm + archive.

`proxy(held)` weighs each tier's relative error (keys and values averaged) by the share of held positions it serves:
what fraction of the layer's attention inputs is wrong, and by how much. It costs one decode per quantized block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..quant.kivi import KIVIQuantized, dequantize_kivi
from ..quant.kvquant import NUQQuantized, dequantize_nuq
from ..quant.subspace import SubspaceRows, dequantize_subspace_rows


@dataclass
class TierError:
    """Running sums of one tier: squared error and squared norm of keys and of values, positions recorded."""

    key_err: float = 0.0
    key_norm: float = 0.0
    value_err: float = 0.0
    value_norm: float = 0.0
    tokens: int = 0

    def relative(self) -> float:
        """Mean of the keys' and values' relative squared error (0 before anything was recorded)."""
        k = self.key_err / self.key_norm if self.key_norm else 0.0
        v = self.value_err / self.value_norm if self.value_norm else 0.0
        return 0.5 * (k + v)


def _decode(q) -> torch.Tensor:
    if isinstance(q, KIVIQuantized):
        return dequantize_kivi(q)
    if isinstance(q, NUQQuantized):
        return dequantize_nuq(q)
    if isinstance(q, SubspaceRows):
        return dequantize_subspace_rows(q)
    raise TypeError(f"cannot decode {type(q).__name__}")


@dataclass
class QualityTracker:
    """Per tier name ("warm", "archive"), the `TierError` of every block quantized into it."""

    tiers: dict[str, TierError] = field(default_factory=dict)

    def record(self, tier: str, keys: torch.Tensor, values: torch.Tensor, q_keys, q_values) -> None:
        """`keys`/`values` as they were quantized (float) and their codes (`KIVIQuantized` / `NUQQuantized` / `SubspaceRows`)."""
        e = self.tiers.setdefault(tier, TierError())
        kf, vf = keys.float(), values.float()
        e.key_err += float((_decode(q_keys) - kf).square().sum())
        e.key_norm += float(kf.square().sum())
        e.value_err += float((_decode(q_values) - vf).square().sum())
        e.value_norm += float(vf.square().sum())
        e.tokens += keys.shape[2]

    def error_of(self, tier: str) -> float:
        """Relative error of positions now in `tier` (an archived position carries its warm error too)."""
        err = self.tiers.get(tier, TierError()).relative()
        if tier == "archive" and "warm" in self.tiers and self.tiers.get("archive", TierError()).tokens:
            err += self.tiers["warm"].relative()
        return err

    def proxy(self, held: dict[str, int]) -> float:
        """Relative error of the held positions: each quantized tier's error times its share of `held` (positions
        per tier name; full-precision tiers count with error 0)."""
        total = sum(held.values())
        if not total:
            return 0.0
        return sum(n * self.error_of(t) for t, n in held.items() if t in ("warm", "archive")) / total

    def reset(self) -> None:
        self.tiers = {}
