"""`TieredQuantLayer`: one layer's sink / archive / warm / tail storage (see the package docstring), and `KIVILayer`."""

from __future__ import annotations

import dataclasses

import torch

from ...options import CacheOptions, check_positive_int
from ...quant.kivi import KIVIQuantized, dequantize_kivi
from ...quant.subspace import SubspaceRows
from ...rope import KeyRotation
from ...quant.rotation import is_power_of_two
from ...kernels.segments import FullSegment, QuantSegment, SubspaceSegment
from ...calibrate import LayerRecipe
from ...calibrate.quality import QualityTracker
from ..base import CompressedLayer
from ..budget import RatioBudget, fitted_warm_floor
from ..archive import ArchiveFormat, KIVIFormat
from ..tiers import TierSpec, LayerTiers, PlainTier, QuantTier, SegmentedTier, format_label, format_of, same_format
from .options import TIERS, TieredQuantOptions, KIVIOptions, largest_divisor, needs_rope
from .calibration import TierCalibration
from .formats import ArchiveFormatChoice


class TieredQuantLayer(TierCalibration, ArchiveFormatChoice, CompressedLayer):
    """One layer's archive / warm / tail storage plus the sink overlay (see the package docstring).

    The tiers are a `tiers.LayerTiers` (`sink`, `archive`, `warm`, `tail`): `PlainTier`s of `[batch, heads, tokens,
    dim]` tensors and `QuantTier`s of packed codes with their fp16 scales and zeros (per-channel key scales are
    `[batch, heads, tokens / group, dim]`: not token-aligned, hence the own `crop`). Reordering and selecting beams
    only index dim 0 of every held tensor, which holds the batch everywhere, so the base class's beam and batch
    methods serve this layer (checked by the tests). What calibration chooses is in `calibration.TierCalibration`,
    which format codes which positions in `formats.ArchiveFormatChoice`.
    """

    options: TieredQuantOptions
    replans = True  # new thresholds from `AdaptiveThresholds` reach the layer (`replan`)

    def __init__(self, options: TieredQuantOptions | None = None, sliding_window: int | None = None) -> None:
        super().__init__(options if options is not None else TieredQuantOptions())
        self.recipe: LayerRecipe | None = None  # given, or chosen by calibration (rotation="auto")
        self.calibrating = False
        self.query_window = 0
        # while calibrating: the last queries seen (`[batch, heads, <= calibration_queries, head_dim]`), their
        # scaling, and whether the first update already waited for them
        self._calib_queries: torch.Tensor | None = None
        self._calib_scaling = 1.0
        self._calib_waited = False
        self._first_update = 0  # positions the sequence's first update brought (`_track_prompt`)
        self._prompt_open = False  # no update shorter than the first has arrived yet (`_in_chunked_prefill`)
        self._in_chunked_prefill = False
        # a sliding-window layer: archive groups no future query can see are dropped, and no sinks are kept (the
        # first positions leave the window); `dropped` counts the positions before the first one held
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.in_hybrid = False  # a full layer of a model that also has sliding-window layers (set by the cache)
        self.dropped = 0
        self.tiers = LayerTiers()
        # the archive formats by name ("warm": the warm tier's KIVI codes); their fitted state (KVQuant codebooks,
        # subspace bases) is fitted on the first positions archived and kept for later sequences; and the model's
        # RoPE the pre-RoPE formats un-rotate keys with (set by the cache from the model config)
        self.formats: dict[str, ArchiveFormat] = {}
        self.rope: KeyRotation | None = None
        self.switches: list[dict] = []  # adaptive archive: {position, from, to} of every format switch
        self._in_flight = 0
        self.quality = QualityTracker()  # error of every block quantized in this sequence (`quality_metrics`)
        self.budget: RatioBudget | None = None  # the cache's memory target (`target_ratio`), set by the cache
        self.ratio_floor: RatioBudget | None = None  # the cap on the warm tier (`min_ratio`), set by the cache
        if self.is_sliding:
            check_positive_int("sliding_window", sliding_window)
        self.plan: TieredQuantOptions = self._plan()

    def _plan(self) -> TieredQuantOptions:
        """The tiered options this layer runs with (KIVI maps its own options onto them; a sliding layer takes the
        `sliding` overrides and keeps no sinks: its first positions leave the window; a full layer of a model with
        sliding-window layers takes the `hybrid_full` overrides)."""
        plan = self._options_as_tiered()
        if self.is_sliding:
            return plan.for_sliding()
        return plan.for_hybrid_full() if self.in_hybrid else plan

    def _options_as_tiered(self) -> TieredQuantOptions:
        return self.options

    def replan(self, options: CacheOptions) -> None:
        """Run with `options` from the next sequence on: at once if the layer holds nothing, else at `reset()` (the
        tiers already stored keep the widths and group sizes they were written with)."""
        self.options = options
        if not self.is_initialized:
            self.plan = self._plan()

    # ---- setup --------------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        p = self.plan
        head_dim, value_dim = key_states.shape[-1], value_states.shape[-1]
        self.specs: dict[str, TierSpec] = {}
        for tier, bits, group in (("warm", p.warm_bits, p.group_size), ("arch", p.archive_bits, p.archive_group)):
            vg = p.value_group_size or largest_divisor(value_dim, group)
            kg = group if p.key_axis == "channel" else (p.value_group_size or min(group, head_dim))
            if value_dim % vg:
                raise ValueError(f"value_group_size={vg} must divide the value head_dim={value_dim}")
            if p.key_axis == "token" and head_dim % kg:
                raise ValueError(f"per-token key groups of {kg} channels must divide head_dim={head_dim}")
            self.specs[tier] = TierSpec(bits, kg, vg, p.archive_key_bits if tier == "arch" else None)
        if p.rotation not in ("auto", "static", "none"):
            for flag, dim in ((p.rotation in ("keys", "both"), head_dim), (p.rotation in ("values", "both"), value_dim)):
                if flag and not is_power_of_two(dim):
                    raise ValueError(f"rotation={p.rotation!r} needs a power-of-two head_dim, got {dim}")
        super().lazy_initialization(key_states, value_states)
        if p.tail_dtype == "auto":
            self.tail_dtype = key_states.dtype if key_states.dtype in (torch.float16, torch.bfloat16) else torch.float16
        else:
            self.tail_dtype = getattr(torch, p.tail_dtype) if p.tail_dtype else key_states.dtype
        self.rot_dtype = getattr(torch, p.rotation_dtype) if p.rotation_dtype else torch.float32
        self.formats["warm"] = KIVIFormat(self, self.specs["warm"])
        if needs_rope(p, () if self.recipe is None else (self.recipe.archive_format,)) and self.rope is None:
            raise ValueError(f"archive_quantizer={p.archive_quantizer!r} (or the format of the layer's recipe, or of "
                             "archive_candidates) undoes RoPE with the model's rope_theta: "
                             "build the cache with the model config, TieredQuantCache(config=model.config, ...)")
        for name, dim in (("head_dim", head_dim), ("value head_dim", value_dim)):
            if p.archive_rank is not None and p.archive_rank > dim:
                raise ValueError(f"archive_rank={p.archive_rank} exceeds the {name} {dim}: choose at most {dim}, or "
                                 "None (every direction)")
        if self.recipe is None and p.rotation == "static":
            self.recipe = LayerRecipe("values" if is_power_of_two(value_dim) else "none", source="static")
        elif self.recipe is None and p.rotation != "auto":
            self.recipe = LayerRecipe(p.rotation)
        if self.recipe is not None and self.recipe.archive_bits is not None:  # given, or chosen by calibration
            self.specs["arch"] = dataclasses.replace(self.specs["arch"], bits=self.recipe.archive_bits)
        chooses = len(self._rotation_candidates()) > 1 or self._clip_choice()
        self.calibrating = self.recipe is None and chooses and bool(self._kivi_tiers())
        if self.recipe is None and not self.calibrating:
            self.recipe = LayerRecipe("none")
        self.query_window = p.calibration_queries if self.calibrating else 0
        self._set_rotation(self.recipe.rotation if self.recipe is not None else "none")

    def quant_args(self, tier: "str | TierSpec") -> tuple[dict, dict]:
        """The `quantize_kivi` keyword arguments of keys and of values for `tier` (a name or a spec)."""
        p, spec = self.plan, (self.specs[tier] if isinstance(tier, str) else tier)
        clip = dict(clip_ratio=p.clip_ratio, clip_search=p.clip_search)
        k_clip = clip if self.clips("keys") else {}
        v_clip = clip if self.clips("values") else {}
        return (
            dict(group_size=spec.key_group, axis=p.key_axis, bits=spec.kbits, **k_clip),
            dict(group_size=spec.value_group, axis="token", bits=spec.bits, **v_clip),
        )

    supports_sliding = True

    def reset(self) -> None:
        """Forget the held tokens; a recipe chosen by calibration and fitted codebooks / bases stay (they belong to
        the model, not the text)."""
        super().reset()
        self.tiers = LayerTiers()
        self.switches = []
        self.quality.reset()
        self.plan = self._plan()
        self.dropped = 0
        self._calib_waited, self._calib_queries, self._first_update = False, None, 0
        self._prompt_open = self._in_chunked_prefill = False

    # ---- tier bookkeeping ---------------------------------------------------------------------------------------
    def tokens_held(self) -> int:
        return self.tiers.held()

    def batch_size(self) -> int:
        return self.tiers.batch()

    def _map_store(self, fn) -> None:
        self.tiers = self.tiers.map_rows(fn)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.tiers.state()[1]

    def load_tiers(self, tiers: LayerTiers) -> None:
        """Put back tiers read from `state_tensors` / `tiers.state()` (the codec's restore), the formats' fitted
        state (codebooks, bases) and the adaptive archive's switches included."""
        self.tiers = tiers
        self.switches = []
        pos, prev = self._tier_starts()["archive"], None
        for q in self._segments(tiers.archive):
            if format_of(q)[0] != "kivi":  # KIVI codes carry everything they need; the fitted formats take it back
                self._tier_format(q).adopt(q)
            label = format_label(q)
            if prev is not None and prev != label:
                self.switches.append({"position": pos, "from": prev, "to": label})
            pos, prev = pos + q.tokens, label

    @staticmethod
    def _segments(q) -> list[QuantTier]:
        return [] if q is None else q.segments()

    def held_tensors(self) -> list[torch.Tensor]:
        """`stored_tensors`, plus, while the layer calibrates, the queries it holds to choose from."""
        queries = [] if self._calib_queries is None else [self._calib_queries]
        return [*self.stored_tensors(), *queries]

    def stored_tensors(self) -> list[torch.Tensor]:
        """The stored tiers (codebooks included) and the tensors of the Hadamard rotations (signs and Sylvester
        factors) the layer reads them with: what it keeps for as long as it holds the tokens."""
        extra = [t for r in (getattr(self, n, None) for n in ("rot_k", "rot_v")) if r is not None
                 for t in r.tensors()]
        return [*self.tiers.tensors(), *extra]

    def tier_tokens(self) -> dict[str, int]:
        """Positions each tier serves (a sink position counts as a sink, not in the tier under it)."""
        t = self.tiers
        sink = t.tokens("sink")
        out, lo = {"sink": sink}, 0
        for tier in ("archive", "warm", "tail"):
            hi = lo + t.tokens(tier)
            out[tier] = hi - lo - max(0, min(hi, sink) - lo)
            lo = hi
        return out

    @staticmethod
    def _plain(k: torch.Tensor, v: torch.Tensor) -> PlainTier | None:
        return PlainTier(k, v) if k.shape[2] else None

    # ---- quantize / dequantize ----------------------------------------------------------------------------------
    def _mask_outside(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """`x` holds positions `start..` of every row: give its sink positions the values of the first non-sink
        position (or 0), and each row's left-padding positions the values of its first real position, so that
        neither widens its group's range (the sinks' real values live in the sink tier; padding is never
        attended)."""
        n = x.shape[2]
        n_sink = min(self.plan.sink_length, start + n) - start
        padding = self.row_padding(x.shape[0])
        if n_sink <= 0 and (padding is None or not bool((padding > start).any())):
            return x
        x = x.clone()
        if n_sink > 0:
            x[:, :, :n_sink] = x[:, :, n_sink : n_sink + 1] if n_sink < n else 0
        if padding is not None:
            first_real = (padding - start).clamp(0, n - 1).to(x.device)  # [batch]
            fill = x.gather(2, first_real.view(-1, 1, 1, 1).expand(-1, x.shape[1], 1, x.shape[3]))
            pads = (torch.arange(start, start + n, device=x.device).view(1, 1, n, 1) < padding.to(x.device).view(-1, 1, 1, 1))
            x = torch.where(pads, fill, x)
        return x

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor, tier: str, start: int = 0, rotated: bool = False,
                  track: bool = False) -> QuantTier:
        """Quantize positions `start..` for `tier` ("warm": KIVI codes; "arch": the archive format of `start`,
        fitted first if it needs fitting and is not yet): KIVI codes in the rotated basis (`rotated`: the input is
        in it already), or nuq / subspace codes of the pre-RoPE keys and of the values. `track`: add the block's
        error to `quality` (blocks stored, not calibration round trips), measured where the codes live."""
        fmt = self.formats["warm"] if tier == "warm" else self._format_at(start)
        if not fmt.fitted:
            self._fit_archive(fmt, keys, values, start)
        keys, values = fmt.prepare(keys, values, start, rotated)
        q = fmt.encode(keys, values)
        if track:
            self.quality.record("archive" if tier == "arch" else tier, keys, values, q.keys, q.values)
        return q

    def _fit_archive(self, fmt: ArchiveFormat, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Fit `fmt` (KVQuant codebooks, subspace bases) on positions `start..` (the first ones archived, and, when
        it follows them, the warm tier after them); kept for later sequences too."""
        warm, end = self.tiers.warm, start + keys.shape[2]
        if warm is not None and self._tier_starts()["warm"] + self._in_flight == end:
            wk, wv = self._dequantize(warm, end)
            keys, values = torch.cat([keys.float(), wk], 2), torch.cat([values.float(), wv], 2)
        fmt.fit(*fmt.prepare(keys, values, start))

    def _dequantize(self, q, start: int, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 keys and values of (a slice of) a quantized tier that starts at position `start` (KIVI tiers still
        rotated when `rotated`); a `SegmentedTier` segment by segment."""
        if isinstance(q, SegmentedTier):
            parts, pos = [], start
            for seg in q.parts:
                parts.append(self._dequantize(seg, pos, rotated))
                pos += seg.tokens
            return torch.cat([k for k, _ in parts], 2), torch.cat([v for _, v in parts], 2)
        if isinstance(q.keys, KIVIQuantized):
            return self.formats["warm"].decode(q, start, rotated)
        return self._tier_format(q).decode(q, start, rotated)

    def _tier_starts(self) -> dict[str, int]:
        a = self.dropped
        return {"archive": a, "warm": a + self.tiers.tokens("archive")}

    # ---- storing ------------------------------------------------------------------------------------------------
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        p, t = self.plan, self.tiers
        new = PlainTier(*(x if x.dtype == self.tail_dtype else x.to(self.tail_dtype)
                          for x in (key_states, value_states)))
        held = self.tokens_held()
        prompt_was_chunked = self._in_chunked_prefill
        self._track_prompt(held, new.tokens)
        if held < p.sink_length:
            m = min(p.sink_length - held, new.tokens)
            sink = new.slice(0, m)  # a copy: a view would keep the whole chunk's storage alive
            t.sink = sink if t.sink is None else t.sink.cat(sink)
        tail = new.slice(0) if t.tail is None else t.tail.cat(new)  # never a view of the model's tensors
        unit = p.group_size if p.warm_length else p.archive_group
        excess = tail.tokens - p.tail_length
        if excess >= unit and self.calibrating:
            before = tail.tokens - new.tokens  # positions the queries seen so far end at
            if self._calibration_waits(before):
                self._calib_waited = True
                t.tail = tail
                return
            self._calibrate(tail.keys[:, :, :before], tail.values[:, :, :before])
        if excess >= unit:
            m = excess // unit * unit
            self._graduate(tail.keys[:, :, :m], tail.values[:, :, :m])
            tail = tail.slice(m)
        t.tail = tail
        if p.prefill_warm_positions and prompt_was_chunked and not self._in_chunked_prefill:
            self._archive_warm_excess()  # the prompt ended: what it kept warm goes to the archive now
        self._drop_outside_window()

    def _graduate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Whole groups leaving the tail (oldest first) go to the warm tier, or to the archive without one."""
        p, t = self.plan, self.tiers
        start = self.dropped + t.tokens("archive") + t.tokens("warm")
        keys, values = self._mask_outside(keys, start), self._mask_outside(values, start)
        if p.warm_length == 0:
            for off, n, _ in self._format_runs(start, keys.shape[2]):
                k, v = keys[:, :, off : off + n], values[:, :, off : off + n]
                self._append_archive(self._quantize(k, v, "arch", start + off, track=True), start + off)
            return
        q = self._quantize(keys, values, "warm", track=True)
        t.warm = q if t.warm is None else t.warm.cat(q)
        self._archive_warm_excess()

    def _archive_warm_excess(self) -> None:
        """The warm tier's oldest whole archive groups beyond `_warm_target` go to the archive."""
        p, t = self.plan, self.tiers
        if t.warm is None:
            return
        ga = p.archive_group
        excess = t.warm.tokens - self._warm_target()
        if excess < ga or self._waits_to_fit():
            return
        m = excess // ga * ga
        old, t.warm = t.warm.slice(0, m), t.warm.slice(m)
        start = self._tier_starts()["archive"] + t.tokens("archive")
        for off, n, fmt in self._format_runs(start, m):
            self._in_flight = m - off  # positions between the archive's end and the warm tier (`_fit_archive`)
            block = old.slice(off, off + n) if n < m else old
            if fmt.moves(self.specs["warm"]):  # same KIVI codes: moved as they are
                self._append_archive(block, start + off)
                continue
            # re-quantized from the warm values (full precision is gone by now): in the rotated basis for KIVI, as
            # plain keys for the fitted formats (which undo their RoPE)
            rk, rv = self._dequantize(block, start + off, rotated=fmt.rotated)
            q = self._quantize(rk, rv, "arch", start + off, rotated=fmt.rotated, track=True)
            self._append_archive(q, start + off)
        self._in_flight = 0

    def _warm_target(self) -> int:
        """Positions the warm tier keeps now: warm_length (less what pays for a fitted archive state, with
        `fitted_state_from_warm`), warm_fraction of the positions seen (of the window), or what the memory target
        allows (`budget`, full-attention layers), whichever is most; at most what `min_ratio` allows (`ratio_floor`,
        full-attention layers), but never below the first."""
        p = self.plan
        seen = self.cumulative_length if self.sliding_window is None else min(self.cumulative_length, self.sliding_window)
        floor = fitted_warm_floor(self) if p.fitted_state_from_warm and not self.is_sliding else p.warm_length
        target = max(floor, int(p.warm_fraction * seen) // p.group_size * p.group_size)
        if self.budget is not None and not self.is_sliding:
            target = max(target, self.budget.warm_positions(self))
        if self.ratio_floor is not None and not self.is_sliding:
            target = max(floor, min(target, self.ratio_floor.warm_positions(self)))
        if self._in_chunked_prefill:
            target = max(target, p.prefill_warm_positions)
        return target

    def _append_archive(self, q: QuantTier, start: int) -> None:
        """`q` (positions `start..`) after the archive; a change of format is recorded in `switches`."""
        t = self.tiers
        if t.archive is not None:
            before, now = self._segments(t.archive)[-1], q
            if not same_format(before, now):
                self.switches.append({"position": start, "from": format_label(before), "to": format_label(now)})
        t.archive = q if t.archive is None else t.archive.cat(q)

    def _drop_outside_window(self) -> None:
        """Sliding layers: drop the archive's oldest whole groups that no later query can attend (a query at
        position P sees keys after P - sliding_window)."""
        t = self.tiers
        if not self.is_sliding or t.archive is None:
            return
        g = self.plan.archive_group
        first_visible = self.cumulative_length - self.sliding_window + 1
        m = min(t.archive.tokens, max(0, first_visible - self.dropped)) // g * g
        if m:
            t.archive = t.archive.slice(m) if m < t.archive.tokens else None
            self.dropped += m

    # ---- reading ------------------------------------------------------------------------------------------------
    def _dequantize_tiers_into(self, out_k: torch.Tensor, out_v: torch.Tensor) -> int:
        """Dequantize archive then warm into the first positions of `out_k` / `out_v`; returns how many.

        A rotated KIVI tier is dequantized into a contiguous scratch buffer (in `rotation_dtype`) and un-rotated with
        one Walsh-Hadamard transform over all its tokens, written back into `out`; the other formats are decoded
        (RoPE put back)."""
        pos, start = 0, self._tier_starts()["archive"]
        for q in [*self._segments(self.tiers.archive), *self._segments(self.tiers.warm)]:
            n = q.tokens
            start += n
            if not isinstance(q.keys, KIVIQuantized):
                k, v = self._dequantize(q, start - n)
                out_k[:, :, pos : pos + n].copy_(k)
                out_v[:, :, pos : pos + n].copy_(v)
                pos += n
                continue
            for part, out, rot in ((q.keys, out_k, self.rot_k), (q.values, out_v, self.rot_v)):
                if rot is None:
                    dequantize_kivi(part, out=out[:, :, pos : pos + n])
                    continue
                scratch = torch.empty(*out.shape[:2], n, out.shape[3], dtype=self.rot_dtype, device=out.device)
                dequantize_kivi(part, out=scratch)
                out[:, :, pos : pos + n].copy_(rot.unrotate(scratch))
            pos += n
        return pos

    def materialize_into(self, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """Dequantize the held tokens straight into `out_k` / `out_v` (`[batch, kv_heads, held, dim]`)."""
        t = self.tiers
        pos = self._dequantize_tiers_into(out_k, out_v)
        for plain, at in ((t.tail, pos), (t.sink, 0)):
            if plain is not None:
                out_k[:, :, at : at + plain.tokens].copy_(plain.keys)
                out_v[:, :, at : at + plain.tokens].copy_(plain.values)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        out_k, out_v = self._empty(self.tokens_held())
        self.materialize_into(out_k, out_v)
        return out_k, out_v

    def attention_segments(self) -> list | None:
        """archive | warm | tail as segments the fused attention reads in place (no copy), plus the full-precision
        sinks as an overlay of the positions they replace in a quantized tier (while the sinks are still in the tail,
        the tail holds them exactly and no overlay is needed). Rotated tiers carry their rotation: the attention
        rotates the queries instead of un-rotating the keys; a subspace archive carries its bases (and, for pre-RoPE
        keys, the layer's RoPE from its first position). None (the layer then hands over dequantized tensors) for the
        per-token-keys ablation and a KVQuant archive."""
        t = self.tiers
        quantized = [*self._segments(t.archive), *self._segments(t.warm)]
        if (self.plan.key_axis != "channel" or self.head_dim != self.value_dim
                or any(not isinstance(q.keys, (KIVIQuantized, SubspaceRows)) for q in quantized)):
            return None
        segments, start = [], self._tier_starts()["archive"]
        for q in quantized:
            k, v = q.keys, q.values
            if isinstance(k, SubspaceRows):
                rope = self.rope if self._tier_format(q).prerope else None
                segments.append(SubspaceSegment(k, v, rope, start))
            else:
                segments.append(QuantSegment(k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, k.bits, v.bits,
                                             k.group_size, v.group_size, self.head_dim, self.rot_k, self.rot_v))
            start += q.tokens
        if t.tail is not None:
            segments.append(FullSegment(t.tail.keys, t.tail.values))
        overlaid = min(t.tokens("sink"), t.tokens("archive") + t.tokens("warm"))
        if overlaid:
            segments.append(FullSegment(t.sink.keys[:, :, :overlaid], t.sink.values[:, :, :overlaid], overlay_at=0))
        return segments

    # ---- batch / beam contract ----------------------------------------------------------------------------------
    def _crop_newest(self, n: int) -> None:
        """Tail tokens are simply dropped. A crop that reaches into a quantized tier reopens the groups it cuts: their
        surviving tokens go back to the tail as their dequantized values (and are quantized again when they
        graduate). Sinks past the new end are dropped too."""
        t = self.tiers
        cut = min(n, t.tokens("tail"))
        if cut:
            t.tail = t.tail.slice(0, t.tail.tokens - cut) if cut < t.tail.tokens else None
            n -= cut
        for name in ("warm", "archive"):
            q = getattr(t, name)
            if n == 0 or q is None:
                continue
            g = self.plan.group_size if name == "warm" else self.plan.archive_group
            count = q.tokens
            reopen = min(-(-n // g) * g, count)
            drop = min(n, reopen)
            start = self._tier_starts()[name] + count - reopen
            opened = q.slice(count - reopen)
            setattr(t, name, q.slice(0, count - reopen) if reopen < count else None)
            n -= drop
            if reopen > drop:  # n is 0 now and the tail is empty: the survivors become the tail
                k, v = self._dequantize(opened, start)
                keep, dt = reopen - drop, self.tail_dtype
                t.tail = PlainTier(k[:, :, :keep].to(dt).contiguous(), v[:, :, :keep].to(dt).contiguous())
        end = self.tokens_held()
        if t.tokens("sink") > end:
            t.sink = t.sink.slice(0, end) if end else None
        archive_end = self._tier_starts()["warm"]  # switches past the archive's new end are undone
        self.switches = [s for s in self.switches if s["position"] < archive_end]

    # ---- accounting ---------------------------------------------------------------------------------------------
    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Bytes held and positions served by each tier of this layer."""
        tokens = self.tier_tokens()
        return {
            name: {"bytes": sum(x.nbytes for x in tier.tensors()) if tier is not None else 0, "tokens": tokens[name]}
            for name, tier in ((n, getattr(self.tiers, n)) for n in TIERS)
        }


class KIVILayer(TieredQuantLayer):
    """Residual window + one quantized tier: the tiered layer without a warm tier."""

    options: KIVIOptions

    def __init__(self, options: KIVIOptions | None = None, sliding_window: int | None = None) -> None:
        super().__init__(options if options is not None else KIVIOptions(), sliding_window)

    def _options_as_tiered(self) -> TieredQuantOptions:
        return self.options.as_tiered()
