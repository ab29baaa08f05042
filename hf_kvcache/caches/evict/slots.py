"""`Slots`: what one evicting layer holds; `DecodedKeys`, the keys of a step decoded once; `SlotLayer`, the
storage half of the evicting layer.

Every tensor is `[batch, kv_heads, slots, ...]` while rectangular (each head's slots in order of position), or flat
`[kept, ...]` in (row, head, position) order while compact (ragged heads, `policy.wrappers.AdaKV`, between
forwards). Keys and values are in the model's dtype or, with `quant`, `KIVIQuantized` codes per token
(`quant.token.TokenQuant`), which gather, concatenate and compact like any other slot tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

import torch

from ...policy.reconstruct import UNSCORED
from ...quant.kivi import KIVIQuantized, dequantize_kivi
from ...quant.prerope import PreRopeKeys
from ..accounting import FP16_BYTES
from ..base import CompressedLayer

if TYPE_CHECKING:
    from .options import EvictOptions

Stored = Union[torch.Tensor, KIVIQuantized]  # keys / values: in the model's dtype, or KIVI codes per token
RowFn = Callable[[torch.Tensor], torch.Tensor]


def _map(x: Stored, fn: RowFn) -> Stored:
    return x.map_rows(fn) if isinstance(x, KIVIQuantized) else fn(x)


@dataclass
class Slots:
    """The slots one evicting layer holds. Rectangular: every tensor `[batch, kv_heads, slots, ...]`, each head's slots
    in order of position; compact (ragged heads, `AdaKV`, between forwards): every tensor flat `[kept, ...]`, in (row,
    head, position) order.

    `keys` / `values [.., head_dim]`: in the model's dtype, or (`quant`) KIVI codes packed along head_dim with
    per-token fp16 scale and zero `[.., groups]`; `positions` int32 (-1: a slot a head does not hold); `valid` bool
    (False for padding and empty slots); `scores` float32, the attention mass received (policies that `uses_mass`
    only);
    `log_weight` float32, the log of the tokens each slot stands for (0 unless evicted tokens were folded into it;
    `Merge(mode="mass")` only)."""

    keys: Stored
    values: Stored
    positions: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor | None = None
    log_weight: torch.Tensor | None = None

    def named(self) -> dict[str, torch.Tensor]:
        """Every tensor by name: `keys` / `values`, or `key_codes`, `key_scale`, `key_zero`, `value_*`; `positions`,
        `valid`, `scores`."""
        out = {}
        for kind, x in (("key", self.keys), ("value", self.values)):
            if isinstance(x, KIVIQuantized):
                out.update({f"{kind}_codes": x.codes, f"{kind}_scale": x.scale, f"{kind}_zero": x.zero})
            else:
                out[f"{kind}s"] = x
        out["positions"], out["valid"] = self.positions, self.valid
        if self.scores is not None:
            out["scores"] = self.scores
        if self.log_weight is not None:
            out["log_weight"] = self.log_weight
        return out

    def tensors(self) -> list[torch.Tensor]:
        return list(self.named().values())

    def map_rows(self, fn: RowFn) -> "Slots":
        """`fn` applied to every tensor (all share their leading dims: a batch-dim operation, a gather or a mask
        along the slots)."""
        return Slots(_map(self.keys, fn), _map(self.values, fn), fn(self.positions), fn(self.valid),
                        None if self.scores is None else fn(self.scores),
                        None if self.log_weight is None else fn(self.log_weight))

    def select(self, index: torch.Tensor) -> "Slots":
        """The slots `index [batch, kv_heads, k]` of each row and head (rectangular storage). Whole slots are copied
        as rows of a flat view (`index_select`), several times faster than an element-wise `gather`."""
        b, h, k = index.shape
        slots = self.positions.shape[2]
        rows = (torch.arange(b * h, device=index.device) * slots)[:, None] + index.reshape(b * h, k)
        rows = rows.reshape(-1)

        def take(t: torch.Tensor) -> torch.Tensor:
            flat = t.reshape(b * h * slots, *t.shape[3:])
            return flat.index_select(0, rows).view(b, h, k, *t.shape[3:])

        return self.map_rows(take)

    def cat(self, newer: "Slots") -> "Slots":
        """These slots followed by `newer` (rectangular storage)."""

        def join(a: Any, b: Any) -> Any:
            if a is None:
                return None
            return a.cat(b) if isinstance(a, KIVIQuantized) else torch.cat([a, b], dim=2)

        return Slots(*(join(getattr(self, f.name), getattr(newer, f.name)) for f in dataclasses.fields(self)))

    def compact(self, keep: torch.Tensor) -> "Slots":
        """Rectangular -> compact: the slots where `keep [batch, kv_heads, slots]` (bool) is True, flat."""
        return self.map_rows(lambda t: t[keep])

    def expand(self, counts: torch.Tensor) -> "Slots":
        """Compact -> rectangular `[batch, kv_heads, M, ...]` (M: the largest of `counts [batch, kv_heads]`), each
        head's slots at the end, the missing ones in front holding nothing (positions -1, valid False, zeros)."""
        m = int(counts.max()) if counts.numel() else 0
        present = torch.arange(m, device=counts.device) >= (m - counts)[..., None]

        def place(t: torch.Tensor, fill: int = 0) -> torch.Tensor:
            out = t.new_full((*counts.shape, m, *t.shape[1:]), fill)
            out[present] = t
            return out

        out = self.map_rows(place)
        out.positions = place(self.positions, -1)
        return out


@dataclass
class DecodedKeys:
    """Quantized keys (`codes`, at `positions`) and their decoding in the model's dtype `[batch, kv_heads, slots,
    head_dim]` (all but the `tail` slots until they are read)."""

    codes: KIVIQuantized
    positions: torch.Tensor
    keys: torch.Tensor
    tail: tuple[KIVIQuantized, torch.Tensor] | None = None  # codes and positions of newer slots, not decoded yet


class SlotLayer(CompressedLayer):
    """The storage half of an evicting layer (`layer.H2OLayer` adds the eviction): `slots` (rectangular, or compact
    with `counts [batch, kv_heads]` while ragged heads hold different counts), their quantization, the keys a step
    decoded (`_decoded_keys`), the read accessors and the layout changes."""

    options: "EvictOptions"

    def __init__(self, options: "EvictOptions") -> None:
        super().__init__(options)
        self.policy = options.policy
        self.key_codec: PreRopeKeys | None = None  # quant with key_quant="prerope"; set by H2OCache
        self.slots: Slots | None = None  # what the layer holds (None before the first update)
        self.counts: torch.Tensor | None = None  # [batch, kv_heads] slots held while the storage is compact
        self._decoded_keys: DecodedKeys | None = None  # this step's decoded keys (`_plain_keys`)

    @property
    def quantized(self) -> bool:
        return self.options.quant is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        quant = self.options.quant
        if quant is not None:
            quant.check_dims(key_states.shape[-1], value_states.shape[-1])
            if quant.prerope_keys and self.key_codec is None:
                raise ValueError(
                    "quant_bits with key_quant='prerope' (the default) quantizes keys with the model's RoPE undone, "
                    "which the layer gets from H2OCache(config=model.config, ...); or set key_quant='token'"
                )
        super().lazy_initialization(key_states, value_states)

    # ---- writing ----------------------------------------------------------------------------------------------------
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, n = key_states.shape[:3]
        start = self.cumulative_length - n
        dev = key_states.device
        quant = self.options.quant
        if self.key_codec is not None:
            keys, values = self._quantize_keys(key_states, start), quant.quantize(value_states)
        elif quant is not None:
            keys, values = quant.quantize(key_states), quant.quantize(value_states)
        else:
            keys, values = key_states, value_states
        merging = self.policy.merging
        new = Slots(
            keys, values,
            positions=torch.arange(start, start + n, dtype=torch.int32, device=dev).expand(b, h, n).contiguous(),
            valid=torch.ones(b, h, n, dtype=torch.bool, device=dev),
            scores=self._new_scores(b, h, n, dev),
            log_weight=(torch.zeros(b, h, n, dtype=torch.float32, device=dev)
                        if merging is not None and merging.mode == "mass" else None),
        )
        memo, held = self._decoded_keys, self.slots
        self.slots = new if held is None else held.cat(new)
        if memo is not None and held is not None and memo.codes is held.keys and memo.positions is held.positions:
            # the held keys the attention decoded stay valid: the eviction decodes only the new ones
            self._decoded_keys = DecodedKeys(self.slots.keys, self.slots.positions, memo.keys, (keys, new.positions))
        else:
            self._decoded_keys = None

    def _new_scores(self, b: int, h: int, n: int, dev: torch.device) -> torch.Tensor | None:
        """`[b, h, n]` float32 scores of new slots: 0 for mass policies, `UNSCORED` for policies scored between
        forwards (`scored_outside`), None for the others."""
        if self.policy.uses_mass:
            return torch.zeros(b, h, n, dtype=torch.float32, device=dev)
        if self.policy.scored_outside:
            return torch.full((b, h, n), UNSCORED, dtype=torch.float32, device=dev)
        return None

    def _quantize_keys(self, keys: torch.Tensor, start: int) -> KIVIQuantized:
        """`key_quant="prerope"`: codes of the new `keys [b, h, n, d]` (positions start..start+n-1); the held keys
        are quantized again when the codec fits its statistics now (`PreRopeKeys.encode`)."""
        s = self.slots
        held, new = self.key_codec.encode(keys, start, None if s is None else s.keys, None if s is None else s.valid)
        if s is not None and held is not s.keys:
            self.slots = dataclasses.replace(s, keys=held)
        return new

    # ---- reading ----------------------------------------------------------------------------------------------------
    def _plain(self, x: Stored) -> torch.Tensor:
        return dequantize_kivi(x, self.dtype) if isinstance(x, KIVIQuantized) else x

    def _plain_keys(self, slots: Slots, keep: bool = False) -> torch.Tensor:
        """The keys of rectangular `slots` in the model's dtype (RoPE redone at their positions with `key_codec`).

        Quantized keys are decoded once per step: the held keys the attention of a forward reads (`materialize`,
        `keep`) are kept, and the eviction after it gets them with only the new tokens decoded (`_decoded_keys`,
        dropped once the step has evicted)."""
        if not isinstance(slots.keys, KIVIQuantized):
            return slots.keys
        memo = self._decoded_keys
        if memo is not None and memo.codes is slots.keys and memo.positions is slots.positions:
            if memo.tail is not None:
                memo.keys = torch.cat([memo.keys, self._decode_keys(*memo.tail)], 2)
                memo.tail = None
            return memo.keys
        keys = self._decode_keys(slots.keys, slots.positions)
        if keep:
            self._decoded_keys = DecodedKeys(slots.keys, slots.positions, keys)
        return keys

    def _decode_keys(self, codes: KIVIQuantized, positions: torch.Tensor) -> torch.Tensor:
        if self.key_codec is None:
            return dequantize_kivi(codes, self.dtype)
        return self.key_codec.dequantize(codes, positions, self.dtype)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._plain_keys(self.slots, keep=True), self._plain(self.slots.values)

    def plain_storage(self) -> bool:
        return not self.quantized and self.counts is None

    def stored_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slots.keys, self.slots.values

    def held_keys(self) -> torch.Tensor:
        """`[batch, kv_heads, slots, head_dim]` the held keys in the model's dtype (dequantized when quantized)."""
        return self._plain_keys(self.slots)

    def _rect(self) -> Slots:
        if self.slots is None:
            raise ValueError("this evicting layer holds no tokens yet: read it after a forward")
        return self.slots if self.counts is None else self.slots.expand(self.counts)

    def held_positions(self) -> torch.Tensor:
        """`[batch, kv_heads, slots]` int64: the position of each held slot (-1: a slot a head does not hold);
        rectangular also while the storage is compact, as the other `held_*` accessors."""
        return self._rect().positions.long()

    def held_valid(self) -> torch.Tensor:
        """`[batch, kv_heads, slots]` bool: False for padding and for slots a head does not hold."""
        return self._rect().valid

    def held_scores(self) -> torch.Tensor | None:
        """`[batch, kv_heads, slots]` float32: the attention mass each slot received (None unless the policy
        `uses_mass`)."""
        return self._rect().scores

    def held_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[batch, kv_heads, slots, head_dim]` and values `[.., value_dim]` held, in the model's dtype
        (dequantized when quantized; zeros in the slots a head does not hold)."""
        r = self._rect()
        return self._plain_keys(r), self._plain(r.values)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.slots is None else self.slots.named()

    # ---- layout and accounting ------------------------------------------------------------------------------------
    def _compact(self, keep: torch.Tensor) -> None:
        """Keep the slots `keep [batch, kv_heads, slots]` (bool), flat (`Slots.compact`), with
        `self.counts [batch, kv_heads]`."""
        self.counts = keep.sum(-1)
        self.slots = self.slots.compact(keep)

    def _expand(self) -> None:
        """Compact -> rectangular (`Slots.expand`)."""
        if self.counts is not None:
            counts, self.counts = self.counts, None
            self.slots = self.slots.expand(counts)

    def tokens_held(self) -> int:
        if self.counts is not None:
            return int(self.counts.max()) if self.counts.numel() else 0
        return 0 if self.slots is None else self.slots.positions.shape[2]

    def batch_size(self) -> int:
        if self.counts is not None:
            return self.counts.shape[0]
        return 0 if self.slots is None else self.slots.positions.shape[0]

    def _map_store(self, fn: RowFn) -> None:
        if self.slots is not None:
            self.slots = self.slots.map_rows(fn)

    def held_tensors(self) -> list[torch.Tensor]:
        slots = [] if self.slots is None else self.slots.tensors()
        stats = [] if self.key_codec is None else self.key_codec.tensors()
        decoded = [] if self._decoded_keys is None else [self._decoded_keys.keys]  # only between update and evict
        return slots + stats + decoded + ([] if self.counts is None else [self.counts])

    def fp16_bytes(self) -> int:
        if self.counts is None:
            return super().fp16_bytes()
        per_token = self.head_dim + self.value_dim
        return FP16_BYTES * self.counts.shape[0] * self.num_heads * self.cumulative_length * per_token

    def reset(self) -> None:
        super().reset()
        self.slots = None
        self.counts = None
        if self.key_codec is not None:
            self.key_codec.shift = self.key_codec.scale = None
