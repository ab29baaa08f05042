"""`H2OLayer`: one model layer of an evicting cache -- what the attention reports, and the eviction it triggers.

Data flow of one forward: `update` appends the new tokens (`slots.SlotLayer`; quantized with `quant`: attention then
sees the held tokens dequantized and the new ones exact) and returns everything held; the `"hf_kvcache"` attention
reports the last queries (`observe_queries`: policies that read a window of queries, and mass policies until they
evict, for `crop`), which keys the mask lets any query see (`observe_visible_keys`) and the attention mass each key
received, summed over the query heads of its group and over the queries (`observe_attention`; computed only for
the policies that rank by it, `uses_mass`: the others get `None` and their attention stays torch SDPA); the layer
adds the mass to the scores (fading them by the policy's decay first) and evicts down to the budget with its policy
(`evict`). Between two forwards a layer holds at most `budget` tokens (`budget + evict_every - 1` with
`evict_every`); during one, at most `budget` + the new tokens. A policy that reads a window keeps the queries of the
last `window` positions in a ring (`policy.ring.QueryRing`, 16 bits, 8 with `quant` when it holds more than one),
from which the layer recomputes, at each eviction, the attention those queries give the held tokens
(`policy.attention.window_attention`), over one forward or several decoding steps alike.

Positions and masks after eviction: `get_seq_length()` counts tokens seen, so RoPE positions of new tokens continue
from there; `get_mask_sizes(q)` returns `(held + q, seen - held)`, so transformers' mask builder places the held
slots at positions `seen - held .. seen - 1`, all before every new query. Left padding: padding keys are marked
invalid from the mask and evicted before any real token, and kept slots stay in order of position, so the padding
slots a row still holds are at its front -- exactly those transformers' mask (built from the 2D padding mask) marks
as padding, and the shared `[batch, 1, q, kv]` mask is right for every head, although heads keep different tokens.
A layer holding fewer slots than the first (per-layer budgets) reads the mask's last columns (`mask_from_end`).
Right padding is not supported (generate never produces it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ...policy import SlotView
from ...policy.attention import window_attention, window_logits
from ...policy.ring import QueryRing
from ...rope import KeyRotation
from .crop import check_not_evicted, crop_problem, mass_span, scores_without
from .merge import fold_evicted
from .options import EvictOptions
from .slots import RowFn, SlotLayer

if TYPE_CHECKING:
    from .reconstruct import ContextScoring

MERGE_WINDOW = 32  # queries whose attention weighs a merge (the ring holds at least that many with a Merge policy)

MISSING_MASS = (
    "{cls}: the attention mass of the previous forward never arrived. This cache (policy={policy!r}) evicts tokens "
    "using the attention they receive and the padding of each row, which only the 'hf_kvcache' attention reports "
    "(it also serves sdpa models, in any loop, while hf_kvcache.serve_plain_loops is on; eager, flash and flex "
    "attention report nothing): load the model with attn_implementation='hf_kvcache' (or call "
    "model.set_attn_implementation('hf_kvcache')), then cache.reset(). generate(cache_implementation='h2o') switches "
    "the model by itself."
)


class H2OLayer(SlotLayer):
    """One layer's kept tokens (`slots`), plus the queries of the last `query_window` positions (`ring`) for
    policies that read them (see the module docstring)."""

    mask_from_end = True  # a layer holding fewer slots than the first reads the mask's last columns

    def __init__(self, options: EvictOptions | None = None) -> None:
        super().__init__(options if options is not None else EvictOptions())
        self.window = self.policy.query_window()  # the queries the policy reads (`view.window`)
        self.crop_window = self.policy.crop_queries
        self.budget_scale = 1.0  # this layer's share of the budget (`Pyramid`); set by H2OCache
        self.rope: KeyRotation | None = None  # the model's RoPE, for policies that need it; set by H2OCache
        self._pending = 0  # tokens of the last update still waiting for their attention mass
        # why a crop left scores it could not correct (the next update raises it); None when they are right
        self.stale_after_crop: str | None = None
        self.hold = False  # evict nothing by itself (a context waiting to be scored, `reconstruct.held_for_scoring`)
        self.scoring: "ContextScoring | None" = None  # set while a reconstruction forward runs (`reconstruct`)
        self._clear_queries()

    def _clear_queries(self) -> None:
        self.ring: QueryRing | None = None  # the last `query_window` queries
        self._new_queries = 0

    @property
    def wants_attention_mass(self) -> bool:
        """The policies that rank by the attention mass (`uses_mass`) ask for it, outside a reconstruction forward."""
        return self.scoring is None and self.policy.uses_mass

    @property
    def wants_visible_keys(self) -> bool:
        """Every policy: the padding flags of new tokens and the end of each forward (where the layer evicts); not
        inside a reconstruction forward, whose tokens leave no trace."""
        return self.scoring is None

    @property
    def query_window(self) -> int:
        """Queries the `"hf_kvcache"` attention reports (`observe_queries`): the policy's window (at least
        `MERGE_WINDOW` with a Merge policy), plus `crop_window` while `crop` may have to undo what they did
        (`tracks_crop`)."""
        if self.scoring is not None:  # a reconstruction forward: all its queries
            return self.scoring.queries
        window = max(self.window, MERGE_WINDOW) if self.policy.merging is not None else self.window
        return window + (self.crop_window if self.tracks_crop() else 0)

    def tracks_crop(self) -> bool:
        """Whether the ring keeps queries for `crop`: for the policies that accumulate attention mass, while nothing
        was evicted (crop raises after that), unless the budget never evicts (a ratio of 1.0)."""
        if not self.policy.uses_mass or self._dropped():
            return False
        b = self.options.budget
        return not (isinstance(b, float) and b * self.budget_scale >= 1.0)

    def _begin_update(self) -> None:
        self._decoded_keys = None
        if self._pending:
            raise RuntimeError(MISSING_MASS.format(cls=type(self).__name__, policy=self.policy.core.name))
        if self.stale_after_crop:
            raise ValueError(self.stale_after_crop)
        self._expand()

    def _end_update(self, new_tokens: int) -> None:
        self._pending = new_tokens  # their attention mass is reported by the attention of this forward

    def held_tensors(self) -> list[torch.Tensor]:
        return super().held_tensors() + ([] if self.ring is None else self.ring.tensors())

    # ---- what the attention function reports --------------------------------------------------------------------
    def observe_queries(self, queries: torch.Tensor, scaling: float) -> None:
        """The last `query_window` queries of this forward `[batch, heads, w, head_dim]` (post-RoPE): kept in a ring
        of the last `query_window` queries, with their positions and padding flags; 16-bit for window policies (what
        they read; 8-bit with `quant` when the ring holds more than one query), the model's dtype for the mass
        policies (`crop` recomputes the mass they gave as the attention computed it)."""
        if self.scoring is not None:
            self.scoring.observe(self, queries, scaling)
            return
        if not self._pending or not self.query_window:
            return
        w = queries.shape[2]
        if w > self._pending:
            raise ValueError(f"{w} queries reported for {self._pending} new tokens")
        dtype = self.dtype
        if self.window and self.quantized and self.query_window > 1:
            dtype = torch.int8  # one query per head (tova) costs too few bytes to round: 8-bit rings moved its ranks
        elif self.window:
            dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float16
        end = self.cumulative_length
        new = QueryRing.of_forward(queries, end - self._pending, end, scaling, dtype)
        keep = self.query_window
        self.ring = new.last(keep) if self.ring is None else self.ring.extend(new, keep)
        self._new_queries = w

    def observe_visible_keys(self, visible: torch.Tensor | None) -> None:
        if visible is None or not self._pending:
            return
        n = self._pending
        valid = self.slots.valid
        if visible.shape != (valid.shape[0], valid.shape[2]):
            raise ValueError(f"visible keys {tuple(visible.shape)} do not match the held slots {tuple(valid.shape)}")
        valid[:, :, -n:] &= visible[:, None, -n:].to(valid.device)
        if self._new_queries and self.ring is not None:  # a padding position is no query either
            self.ring.mark_invisible(visible, self._new_queries)

    def observe_attention(self, mass: torch.Tensor | None) -> None:
        if not self._pending:
            return  # e.g. the attention of a layer called twice per forward: count the first call only
        valid = self.slots.valid
        if mass is not None and mass.shape != valid.shape:
            raise ValueError(f"attention mass {tuple(mass.shape)} does not match the held slots {tuple(valid.shape)}")
        if self.policy.uses_mass:
            if mass is None:
                raise ValueError(f"policy {self.policy.core.name!r} ranks by the attention mass, and none was reported")
            scores = self.slots.scores
            decay = self.policy.mass_decay
            if decay is not None:  # the held tokens' mass fades per new query; the new mass is added as it came
                scores.mul_(decay ** self._pending)
            scores += mass.to(scores.device, torch.float32)
        self._pending = 0
        self._new_queries = 0
        self.evict()
        self._decoded_keys = None
        if self.ring is not None and len(self.ring) > self.query_window:  # evicted: crop can no longer undo
            self.ring = self.ring.last(self.query_window) if self.query_window else None

    # ---- eviction -----------------------------------------------------------------------------------------------
    def slot_view(self) -> tuple[SlotView, torch.Tensor | None]:
        """What the policy sees of the held slots, and with a Merge policy the logits `[batch, kv_heads, group,
        ring, slots]` of every query of the ring over them (what a fold weighs by; the policy's window is their last
        rows, so they are computed once for both)."""
        s, policy = self.slots, self.policy
        uses_window = self.window > 0
        if uses_window and self.ring is None:
            raise RuntimeError(
                f"policy {policy.core.name!r} ranks tokens by the attention of the last queries, which the "
                "'hf_kvcache' attention reports (layer.observe_queries) before the attention mass; call "
                "observe_queries(query[:, :, -layer.query_window:], scaling) first when driving the layer by hand"
            )
        keys = self.held_keys() if (policy.uses_keys or uses_window) else None
        view = SlotView(s.scores, s.positions, s.valid, seen=self.cumulative_length, keys=keys, rope=self.rope,
                        key_bias=s.log_weight)
        if policy.uses_values:
            view.values = self._plain(s.values)
        ring_logits = None
        if policy.merging is not None:  # merge policies all read a window of queries
            r = self.ring
            ring_logits = window_logits(r.queries, r.positions, r.valid, keys, s.positions, s.valid, r.scaling,
                                        key_bias=s.log_weight)
        if uses_window:
            r = self.ring.last(self.window)
            if policy.uses_queries:  # the policy reads the queries themselves
                view.queries, view.query_positions, view.query_valid = r.queries, r.positions, r.valid
                view.scaling = r.scaling
            else:
                if ring_logits is not None:
                    logits = ring_logits[:, :, :, -len(r):]
                else:
                    logits = window_logits(r.queries, r.positions, r.valid, keys, s.positions, s.valid, r.scaling,
                                           key_bias=s.log_weight)
                view.window = window_attention(logits, view.values if policy.by_output_error else None)
        return view, ring_logits

    def evict(self, budget: int | None = None, protect_last: int = 0) -> None:
        """Keep the policy's `budget` slots of every (row, KV head) (default: the options' budget for the tokens
        seen, once the layer holds `evict_every` tokens over it), the `protect_last` newest real tokens among them
        whatever their score. Ragged heads (`AdaKV`) share `budget x kv_heads` slots and are stored compactly. While
        `hold` is set only an explicit `budget` evicts."""
        if self.slots is None or (budget is None and self.hold):
            return
        slack = 0
        if budget is None:
            budget = self.options.budget_for(self.cumulative_length, self.budget_scale)
            slack = (self.options.evict_every or 1) - 1
        if self.policy.ragged_heads:
            view, ring_logits = self.slot_view()
            keep = self.policy.select_across_heads(view, budget, protect_last=protect_last)
            if keep is not None and self.policy.merging is not None:
                self._fold(view, ring_logits, keep)
            self._compact(keep if keep is not None else self.slots.positions >= 0)
            return
        if budget + slack >= self.tokens_held():
            return
        view, ring_logits = self.slot_view()
        keep = self.policy.select(view, budget, protect_last=protect_last)
        if keep is not None:
            if self.policy.merging is not None:
                mask = torch.zeros_like(self.slots.valid).scatter_(-1, keep, True)
                self._fold(view, ring_logits, mask)
            self.slots = self.slots.select(keep)

    def _fold(self, view: SlotView, logits: torch.Tensor, keep: torch.Tensor) -> None:
        """Merge: fold the real tokens about to be evicted (not in `keep [batch, kv_heads, slots]`) into kept slots
        (`merge.fold_evicted`), weighted by the attention of the queries the ring holds (their `logits`, from
        `slot_view`)."""
        s, r = self.slots, self.ring
        b, h, g, w, slots = logits.shape
        held = view.values if view.values is not None else self._plain(s.values)
        values, log_weight = fold_evicted(
            logits.view(b, h, g * w, slots), r.positions.repeat(g), s.positions, view.keys, keep, s.valid & ~keep,
            held, s.log_weight, self.policy.merging.similarity,
        )
        if self.quantized:  # quantize again only the slots a fold changed; the others keep their codes
            changed = (values != held).any(-1)
            new = self.options.quant.quantize(values)
            values = dataclasses.replace(s.values, **{
                name: torch.where(changed[..., None], getattr(new, name), getattr(s.values, name))
                for name in ("codes", "scale", "zero")
            })
        self.slots = dataclasses.replace(s, values=values, log_weight=log_weight)  # new tensors: a copy may share `s`

    def key_bias(self) -> torch.Tensor | None:
        """`[batch, kv_heads, slots]` float32 for the keys the last `update` returned: the log of the tokens each slot
        stands for (`Merge(mode="mass")`), which the `"hf_kvcache"` attention adds to its logits; None otherwise."""
        merging = self.policy.merging
        if merging is None or merging.mode != "mass" or self.slots is None or self.counts is not None:
            return None
        return self.slots.log_weight

    def key_mask(self) -> torch.Tensor | None:
        """`[batch, kv_heads, slots]` bool for the keys the last `update` returned: False for the slots a head does not
        hold (and padding); the `"hf_kvcache"` attention masks them per head. None unless heads hold different
        counts (`AdaKV`), or while every head holds every slot (nothing to mask beyond the model's own mask, so the
        attention keeps torch SDPA's fast paths)."""
        if not self.policy.ragged_heads or self.counts is not None or self.slots is None:
            return None
        valid = self.slots.valid
        return None if bool(valid.all()) else valid

    # ---- positions, masks, batch contract -----------------------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.tokens_held()
        return held + query_length, self.cumulative_length - held

    def evicted(self) -> int:
        """Tokens evicted by the head that evicted most (0 while a forward is under way)."""
        return self._dropped() if self._pending == 0 else 0

    def _dropped(self) -> int:
        """Tokens evicted so far by the head that evicted most (the new tokens of a forward count as held)."""
        if self.counts is not None:
            held = int(self.counts.min()) if self.counts.numel() else 0
        elif self.policy.ragged_heads and self.slots is not None:
            held = int((self.slots.positions >= 0).sum(-1).min())
        else:
            held = self.tokens_held()
        return self.cumulative_length - held

    def _batch_op(self, op, fn: RowFn) -> None:
        compact = self.counts is not None
        self._expand()
        op()
        if compact:
            self._compact(self.slots.positions >= 0)
        if self.ring is not None:
            self.ring = self.ring.map_rows(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._batch_op(lambda: super(H2OLayer, self).reorder_cache(beam_idx),
                       lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch_op(lambda: super(H2OLayer, self).batch_select_indices(indices), lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_op(lambda: super(H2OLayer, self).batch_repeat_interleave(repeats),
                       lambda t: t.repeat_interleave(repeats, dim=0))

    def _crop_newest(self, n: int) -> None:
        """Drop the newest `n` tokens and what their queries did: the mass they gave (taken out of the scores,
        `crop.scores_without`) and their queries in the ring, so the layer is the one that never saw them."""
        check_not_evicted(n, self._dropped(), self.cumulative_length)
        keep = self.cumulative_length - n
        compact = self.counts is not None
        self._expand()
        if self.tracks_crop():
            self._undo_mass(keep)
        super()._crop_newest(n)
        if compact:
            self._compact(self.slots.positions >= 0)
        if self.ring is not None:  # queries of cropped positions go too
            self.ring = self.ring.before(keep)

    def _undo_mass(self, keep: int) -> None:
        """Take out of the scores what the queries of positions `keep ..` gave (`crop`); when it cannot, the next
        update raises why (`stale_after_crop`)."""
        seen, ring, decay = self.cumulative_length, self.ring, self.policy.mass_decay
        start, part_end = mass_span(ring, keep, decay)
        quant = self.options.quant
        problem = crop_problem(seen - keep, seen, start, ring, None if quant is None else quant.bits,
                                    self.policy.core.name, self.crop_window)
        if problem is not None:  # a copy cropped to be encoded (the prefix store) goes on; this layer may not
            self.stale_after_crop = problem
            return
        s = self.slots
        att = ring.attention(self.held_keys(), s.positions, s.valid, start, seen)  # [b, h, seen - start, slots]
        scores = scores_without(s.scores, att, ring, keep, seen, start, part_end, decay)
        self.slots = dataclasses.replace(s, scores=scores)  # new tensors: a copy may share `s`

    def reset(self) -> None:
        super().reset()
        self._pending = 0
        self.stale_after_crop = None
        self.hold = False
        self.scoring = None
        self._clear_queries()
