"""What a tiered layer chooses from the queries it sees: the rotation of keys / values, key clipping, the archive
format and width (`TierCalibration`, a mixin of `TieredQuantLayer`), and the round trips those choices are scored
on."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ...quant.rotation import hadamard_rotation, is_power_of_two
from ...calibrate import ROTATION_CANDIDATES, LayerRecipe, choose_archive_bits, choose_recipe
from ...calibrate.recipe import QueryAttention, choose_archive_format, choose_key_clipping
from ..archive import FORMAT_CLASSES
from .options import CALIBRATION_GROUPS


# a calibration keeps the keys / values it has round-tripped (to give them again) within this many bytes
KEPT_ROUNDTRIP_BYTES = 64 << 20

RoundTrip = Callable[[str, str], tuple[torch.Tensor, torch.Tensor]]


class TierCalibration:
    """The calibration half of `TieredQuantLayer` (see `layer.TieredQuantLayer`): methods only, the state lives on the
    layer."""

    def _track_prompt(self, held: int, arriving: int) -> None:
        """Follow whether this update continues a chunked prefill: every update after the sequence's first one is
        at least as long as the first, and the first alone was long enough to calibrate on."""
        if held == 0:
            self._first_update, self._prompt_open = arriving, True
        elif arriving < self._first_update:
            self._prompt_open = False
        self._in_chunked_prefill = (held > 0 and self._prompt_open and not self.is_sliding
                                    and self._first_update >= self._least_to_calibrate())

    def _least_to_calibrate(self) -> int:
        """Positions a layer holds before it can calibrate: the tail and CALIBRATION_GROUPS archive groups."""
        return self.plan.tail_length + CALIBRATION_GROUPS * self.plan.archive_group

    def _calibration_waits(self, before: int) -> bool:
        """Whether a calibrating layer keeps its positions in the tail for now rather than calibrate on the first
        `before` (those whose queries it has seen) as this update's come in (`_track_prompt` has seen it).

        It waits for the first forward's queries (they reach the layer after its update), then until enough positions
        (CALIBRATION_GROUPS archive groups past the tail) can be round-tripped to compare candidates; with
        `calibration_positions`, a sequence whose first update alone brought that many (a prompt, or the first chunk
        of a chunked prefill) waits until `calibration_positions` are held or a shorter update arrives (the prompt's
        last chunk, a decoding step); a sliding-window layer (its window may be shorter) does not wait for it."""
        p, queries = self.plan, self._calib_queries
        if queries is None:
            return not self._calib_waited
        if before < self._least_to_calibrate():
            return True
        return self._in_chunked_prefill and before < p.calibration_positions

    def _rotation_candidates(self) -> tuple[str, ...]:
        """The rotations this layer's head dims allow (a Hadamard rotation needs a power of two)."""
        ok_k, ok_v = is_power_of_two(self.head_dim), is_power_of_two(self.value_dim)
        return tuple(c for c in ROTATION_CANDIDATES
                     if (ok_k or c not in ("keys", "both")) and (ok_v or c not in ("values", "both")))

    def _set_rotation(self, rotation: str) -> None:
        """The Hadamard rotations of keys and values (`quant.rotation.HadamardRotation`: signs and small Sylvester
        factors, no matrix; one object per size and seed, shared by every layer)."""
        rot_k, rot_v = rotation in ("keys", "both"), rotation in ("values", "both")
        self.rot_k = hadamard_rotation(self.head_dim, 0, self.device) if rot_k else None
        self.rot_v = hadamard_rotation(self.value_dim, 1, self.device) if rot_v else None

    # ---- calibration ("auto" rotation) ---------------------------------------------------------------------------
    def observe_queries(self, queries: torch.Tensor, scaling: float) -> None:
        """The last queries of a forward, `[batch, heads, <= calibration_queries, head_dim]` (post-RoPE), from the
        "hf_kvcache" attention while this layer calibrates."""
        if self.calibrating:
            # a copy (same strides): a view would keep the forward's whole query tensor alive until calibration
            q = torch.empty_like(queries).copy_(queries.detach())
            prev = self._calib_queries
            if prev is not None and prev.shape[:2] == q.shape[:2]:  # consecutive forwards: consecutive positions
                q = torch.cat([prev, q], dim=2)[:, :, -self.plan.calibration_queries :]
            self._calib_queries, self._calib_scaling = q, float(scaling)

    def _calibrate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Pick the rotation from `keys`/`values` (the held positions `[0, T)` the stored queries are the last of)."""
        queries = self._calib_queries
        if queries is None or keys.shape[2] < self.plan.tail_length + self.plan.archive_group:
            self.recipe = LayerRecipe("none", {}, "no-queries")
        else:
            attention = QueryAttention(queries, keys, values, self._calib_scaling)
            roundtrip = self._kivi_roundtrips(keys, values)
            self.recipe = choose_recipe(attention, roundtrip, self._rotation_candidates(), self._kivi_tiers())
            self._choose_key_clipping(attention, roundtrip)
            self._choose_archive_format(attention, keys, values)
            self._widen_archive(attention, roundtrip)
        self._set_rotation(self.recipe.rotation)
        self.calibrating, self.query_window, self._calib_queries = False, 0, None

    def _clip_choice(self) -> bool:
        """Whether calibration decides the key clipping (`clip_on="auto"` with a clip to apply)."""
        p = self.plan
        return p.clip_on == "auto" and (p.clip_search or p.clip_ratio != 1.0)

    def clips(self, tensor: str) -> bool:
        """Whether `tensor` ("keys" / "values") groups take clip_ratio / clip_search: `clip_on`, or with "auto"
        values always and keys as the recipe says (unclipped until calibrated, or without queries)."""
        on = self.plan.clip_on
        if on == "auto":
            return tensor == "values" or bool(self.recipe is not None and self.recipe.clip_keys)
        return on in (tensor, "both")

    def _choose_key_clipping(self, attention: QueryAttention, roundtrip: RoundTrip) -> None:
        """`clip_on="auto"`: clip the key groups when that lowers the mean attention error of this layer's queries
        over its KIVI tiers, under the chosen rotation, by more than `calibrate.recipe.KEY_CLIP_MARGIN` (recorded in
        the recipe with both errors)."""
        if not self._clip_choice():
            return

        def roundtrips(clip: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
            self.recipe.clip_keys = clip  # what `clips("keys")` reads while quantizing
            return [roundtrip(self.recipe.rotation, t) for t in self._kivi_tiers()]

        clip, errors = choose_key_clipping(attention, roundtrips)
        self.recipe.clip_keys = clip
        self.recipe.errors.update(errors)

    def _choose_archive_format(self, attention: QueryAttention, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`archive_candidates`: give this layer the archive format (of `archive_quantizer` and the candidates) whose
        round trip of the held positions keeps its queries' attention error lowest (`calibrate.recipe.
        choose_archive_format`, another format than `archive_quantizer` only by a margin). The states fitted here are
        dropped: the chosen format is fitted as usual on the first positions archived."""
        p, g = self.plan, self.plan.archive_group
        fit_positions = max(g, self._roundtrip_length(keys.shape[2]) // g // 2 * g)  # what `fit_and_code` fits on
        enough = fit_positions >= p.candidate_fit_per_dim * max(self.head_dim, self.value_dim)
        others = tuple(c for c in (p.archive_candidates or ())
                       if c != p.archive_quantizer and (enough or not FORMAT_CLASSES[c].needs_fit))
        if not others:
            return
        self._set_rotation(self.recipe.rotation)  # KIVI codes live in the rotated basis

        def roundtrip(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            fmt = self._archive_format(name, self.specs["arch"].bits)

            def fit_and_code(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                k, v = fmt.prepare(k, v, 0)
                # fitted on the first half of the groups (KIVI: nothing to fit), so that the other half is coded
                # as later positions are, by a state fitted without them
                fmt.fit(k[:, :, :fit_positions], v[:, :, :fit_positions])
                return fmt.decode(fmt.encode(k, v), 0)

            return self._held_roundtrip(keys, values, fit_and_code)

        name, errors = choose_archive_format(attention, roundtrip, p.archive_quantizer, others)
        for other in (p.archive_quantizer, *others):  # the archive fits its format as usual, on what it archives
            self.formats.pop(other, None)
        self.recipe.archive_format = None if name == p.archive_quantizer else name
        self.recipe.errors.update(errors)

    def _widen_archive(self, attention: QueryAttention, roundtrip: RoundTrip) -> None:
        """`archive_error_target`: give this layer the narrowest KIVI archive width (archive_bits..warm_bits) whose
        round trip under the chosen rotation keeps its queries' attention error within the target."""
        p, base = self.plan, self.specs["arch"]
        if p.archive_error_target is None or "arch" not in self._kivi_tiers():
            return

        def roundtrip_at(width: int) -> tuple[torch.Tensor, torch.Tensor]:
            self.specs["arch"] = dataclasses.replace(base, bits=width)
            return roundtrip(self.recipe.rotation, "arch")

        bits, errors = choose_archive_bits(attention, roundtrip_at, base.bits, p.warm_bits, p.archive_error_target)
        self.specs["arch"] = dataclasses.replace(base, bits=bits)
        self.recipe.errors.update(errors)
        self.recipe.archive_bits = bits if bits != base.bits else None

    def _kivi_tiers(self) -> tuple[str, ...]:
        """The tiers a rotation applies to (KIVI-quantized ones), each distinct spec once."""
        p = self.plan
        tiers = ("warm",) if p.warm_length else ()
        if self._archive_name() == "kivi" and not (tiers and self.specs["warm"] == self.specs["arch"]):
            tiers += ("arch",)
        return tiers

    def _kivi_roundtrips(self, keys: torch.Tensor, values: torch.Tensor) -> RoundTrip:
        """`roundtrip(rotation, tier) -> (keys', values')`: `keys`/`values` of positions `[0, T)` as the KIVI tier
        `tier` ("warm" or "arch", at its width and key clipping when called) would return them under `rotation`:
        everything but the last `tail_length` (in whole archive groups) coded, sinks and the rest exact.

        Keys and values are coded apart, as the tier codes them, and each is kept (within KEPT_ROUNDTRIP_BYTES) by
        what it depends on: its own rotation and its `quantize_kivi` arguments. Rotations "none" / "values" share
        their keys, "none" / "keys" their values; the key clipping's unclipped round trip is the chosen rotation's."""
        kept: dict[tuple, torch.Tensor] = {}
        m = self._roundtrip_length(keys.shape[2])

        def half(x: torch.Tensor, fmt, rot, args: dict, name: str) -> torch.Tensor:
            key = (name, rot is not None, tuple(sorted(args.items())))
            if key not in kept:
                out = self._held(x, fmt.roundtrip(self._mask_outside(x[:, :, :m], 0), rot, args) if m > 0 else None)
                if out.nbytes * (len(kept) + 1) > KEPT_ROUNDTRIP_BYTES:
                    return out
                kept[key] = out
            return kept[key]

        def roundtrip(rotation: str, tier: str) -> tuple[torch.Tensor, torch.Tensor]:
            self._set_rotation(rotation)
            fmt = self.formats["warm"] if tier == "warm" else self._format_at(0)
            ka, va = self.quant_args(fmt.spec)
            return half(keys, fmt, self.rot_k, ka, "keys"), half(values, fmt, self.rot_v, va, "values")

        return roundtrip

    def _roundtrip_length(self, held: int) -> int:
        """How many of `held` positions a calibration round trip codes: all but the last `tail_length`, in whole
        archive groups."""
        g = self.plan.archive_group
        return (held - self.plan.tail_length) // g * g

    def _held_roundtrip(self, keys: torch.Tensor, values: torch.Tensor,
                        code: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]):
        """`keys`/`values` of positions `[0, T)` with all but the last `tail_length` (in whole archive groups) passed
        through `code(keys, values) -> (keys', values')` (padding masked first), sinks and the rest exact."""
        m = self._roundtrip_length(keys.shape[2])
        if m <= 0:
            return self._held(keys, None), self._held(values, None)
        k, v = code(self._mask_outside(keys[:, :, :m], 0), self._mask_outside(values[:, :, :m], 0))
        return self._held(keys, k), self._held(values, v)

    def _held(self, x: torch.Tensor, coded: torch.Tensor | None) -> torch.Tensor:
        """`x` (positions `[0, T)`) in float32 with its first positions replaced by `coded` (None: none), the sink
        positions among them kept exact."""
        out = x.float().clone()
        if coded is not None:
            m = coded.shape[2]
            out[:, :, :m] = coded
            n_sink = min(self.plan.sink_length, m)
            out[:, :, :n_sink] = x[:, :, :n_sink].float()
        return out
