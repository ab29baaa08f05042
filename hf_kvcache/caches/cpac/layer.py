"""`CPACLayer`: one model layer of a `CPACCache` (see the package docstring); `_Budget`: the memory pressure its
layers share."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from ...quant.packing import packed_length
from ...rope import KeyRotation
from ..base import FP16_BYTES, CompressedLayer
from .delta import _delta_group, decode_delta, encode_delta
from .features import combine_features, importance_weight, page_features, threshold_for_pressure
from .options import STREAMS, CPACOptions

logger = logging.getLogger(__package__)

RAW, BASE, DELTA = 0, 1, 2


def _take(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`table[idx]` where entries of `idx` that do not matter may be out of range (they read row 0)."""
    if table.shape[0] == 0:
        return torch.zeros(idx.shape + table.shape[1:], dtype=table.dtype, device=table.device)
    return table[idx.clamp(0, table.shape[0] - 1)]


class _Budget:
    """Memory pressure shared by the CPAC layers of one cache (and the one-time fallback note)."""

    def __init__(self, options: CPACOptions) -> None:
        self.options = options
        self.layers: list[CPACLayer] = []
        self.noted_fallback = False

    def bytes(self) -> tuple[int, int]:
        held = fp16 = 0
        for layer in self.layers:
            if layer.is_initialized:
                held, fp16 = held + layer.nbytes(), fp16 + layer.fp16_bytes()
        return held, fp16

    def measured_pressure(self) -> float:
        budget = self.options.memory_budget
        if budget is None:
            return float("nan")
        held, fp16 = self.bytes()
        limit = budget if isinstance(budget, int) else budget * fp16
        return held / limit if limit > 0 else 0.0

    def pressure(self) -> float:
        """Pressure the thresholds follow: fixed `pressure`, else measured against `memory_budget`, else 0."""
        if self.options.pressure is not None:
            return float(self.options.pressure)
        if self.options.memory_budget is None:
            return 0.0
        return self.measured_pressure()

    def threshold(self) -> float:
        return threshold_for_pressure(self.pressure(), self.options.thresholds, self.options.pressure_levels)


class CPACLayer(CompressedLayer):
    """One model layer of a `CPACCache` (see the module docstring for the storage)."""

    options: CPACOptions
    wants_attention_mass = True

    def __init__(
        self, options: CPACOptions | None = None, budget: _Budget | None = None, rotation: KeyRotation | None = None
    ) -> None:
        options = options or CPACOptions()
        super().__init__(options)
        self.budget = budget or _Budget(options)
        self.budget.layers.append(self)
        if options.key_space == "derotated" and rotation is None:
            raise ValueError("key_space='derotated' needs the model's RoPE: build the cache with config=model.config")
        self.rotation = rotation if options.key_space == "derotated" else None
        self.timing = {"compress_s": 0.0, "compress_blocks": 0, "decompress_s": 0.0, "decompress_blocks": 0}
        self._reset_state()

    def _reset_state(self) -> None:
        self.n_pages = 0  # compressed pages (the same for every row and head)
        self._pending = False  # pages may be ready, waiting for the attention mass of the last update
        self._mass_mode: bool | None = None  # does observe_attention follow each update?
        self._mass_seen = False
        self._last_query_len = 0

    def reset(self) -> None:
        super().reset()
        self._reset_state()

    # ---- set-up -------------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self.rotation is not None and 2 * self.rotation.inv_freq.numel() != self.head_dim:
            raise ValueError(
                f"key_space='derotated': the config's RoPE covers {2 * self.rotation.inv_freq.numel()} dims but "
                f"keys have head_dim={self.head_dim}"
            )
        o, dev = self.options, key_states.device
        b, h, p = key_states.shape[0], key_states.shape[1], o.page_size
        fd = o.torch_full_dtype
        for s, d in (("k", self.head_dim), ("v", self.value_dim)):
            groups = (p * d) // _delta_group(o.scale_of(s), p, d)
            self.store[f"{s}_tail"] = torch.zeros(b, h, 0, d, dtype=fd, device=dev)
            self.store[f"{s}_full"] = torch.zeros(0, p, d, dtype=fd, device=dev)
            packed = packed_length(p * d, o.delta_bits)
            self.store[f"{s}_dcodes"] = torch.zeros(0, packed, dtype=torch.uint8, device=dev)
            self.store[f"{s}_dscale"] = torch.zeros(0, groups, dtype=torch.float16, device=dev)
            if o.delta_asymmetric:
                self.store[f"{s}_dzero"] = torch.zeros(0, groups, dtype=torch.float16, device=dev)
            self.store[f"{s}_dbase"] = torch.zeros(0, dtype=torch.int32, device=dev)
            self.store[f"{s}_slot"] = torch.zeros(b, h, 0, dtype=torch.int32, device=dev)
            self.store[f"{s}_mode"] = torch.zeros(b, h, 0, dtype=torch.int8, device=dev)
        self.store["imp_mass"] = torch.zeros(b, h, 0, dtype=torch.float32, device=dev)
        self.store["imp_obs"] = torch.zeros(0, dtype=torch.float32, device=dev)

    # ---- sizes --------------------------------------------------------------------------------------------------
    @property
    def batch_rows(self) -> int:
        return self.store["k_tail"].shape[0] if self.store else 0

    def tail_tokens(self) -> int:
        return self.store["k_tail"].shape[2] if self.store else 0

    def tokens_held(self) -> int:
        return self.n_pages * self.options.page_size + self.tail_tokens() if self.store else 0

    def fp16_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return FP16_BYTES * self.batch_rows * self.num_heads * self.cumulative_length * (self.head_dim + self.value_dim)

    # ---- update / attention mass --------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self._pending:  # the attention after the last update reported no mass: rank without it from now on
            self._pending = False
            self._mass_mode = False
            if not self.budget.noted_fallback:
                self.budget.noted_fallback = True
                logger.warning(
                    "CPACCache: no attention mass reached the cache (it arrives only with "
                    "attn_implementation='hf_kvcache'); page importance falls back to uniform (0 for every page: "
                    "no importance weighting, no importance protection; recent pages stay protected)"
                )
            self.compress_ready()
        return super().update(key_states, value_states, *args, **kwargs)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        fd = self.options.torch_full_dtype
        for s, x in (("k", key_states), ("v", value_states)):
            self.store[f"{s}_tail"] = torch.cat([self.store[f"{s}_tail"], x.to(fd)], dim=2)
        pages_now = -(-self.tokens_held() // self.options.page_size)
        grow = pages_now - self.store["imp_obs"].shape[0]
        if grow > 0:
            mass = self.store["imp_mass"]
            self.store["imp_mass"] = torch.cat([mass, mass.new_zeros(*mass.shape[:2], grow)], dim=2)
            self.store["imp_obs"] = torch.cat([self.store["imp_obs"], mass.new_zeros(grow)])
        self._last_query_len = key_states.shape[2]
        if self._mass_mode is False:
            self.compress_ready()
        else:  # wait for observe_attention (or, if it never comes, for the next update)
            self._pending = True

    def observe_attention(self, mass: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        n = self.tokens_held()
        expected = (self.batch_rows, self.num_heads, n)
        if tuple(mass.shape) != expected:
            raise ValueError(
                f"observe_attention expects mass [batch, kv_heads, tokens] = {list(expected)} (held tokens, then "
                f"the new ones), got {list(mass.shape)}"
            )
        p = self.options.page_size
        pages = self.store["imp_obs"].shape[0]
        q = min(self._last_query_len, n)
        obs = torch.full((pages * p,), float(q), device=mass.device)
        obs[n - q : n] = torch.arange(q, 0, -1, dtype=torch.float32, device=mass.device)  # causal: i-th new token
        obs[n:] = 0
        padded = torch.nn.functional.pad(mass.float(), (0, pages * p - n))
        self.store["imp_mass"] = self.store["imp_mass"] + padded.reshape(*padded.shape[:2], pages, p).sum(-1)
        self.store["imp_obs"] = self.store["imp_obs"] + obs.reshape(pages, p).sum(-1)
        self._mass_mode = True
        self._mass_seen = True
        if self._pending:
            self._pending = False
            self.compress_ready()

    def importance(self) -> torch.Tensor:
        """`[batch, heads, pages]` in [0, 1]: mean attention per query, over the largest of the row and head;
        all zeros while no attention mass was ever observed (uniform fallback)."""
        mass = self.store["imp_mass"]
        if not self._mass_seen:
            return torch.zeros_like(mass)
        per_query = mass / self.store["imp_obs"].clamp_min(1.0)
        return per_query / per_query.amax(-1, keepdim=True).clamp_min(1e-30)

    # ---- compression ----------------------------------------------------------------------------------------------
    def compress_ready(self) -> int:
        """Compress every page that is full and older than the `recent_pages` newest full pages; returns how many
        pages (per row and head) were compressed."""
        if not self.is_initialized:
            return 0
        o = self.options
        p = o.page_size
        ready = self.tokens_held() // p - o.recent_pages - self.n_pages
        if ready <= 0:
            return 0
        t0 = time.perf_counter()
        b, h = self.batch_rows, self.num_heads
        n = b * h
        start = self.n_pages * p
        # pages to compress, in the space they are stored in (keys de-rotated when key_space="derotated")
        new_pages = {}
        for s in STREAMS:
            x = self.store[f"{s}_tail"][:, :, : ready * p]
            x = self.rotation.derotate(x, start) if (s == "k" and self.rotation is not None) else x.float()
            new_pages[s] = x.reshape(n, ready, p, x.shape[-1])
        imp = self.importance().reshape(n, -1)
        protect = o.protect_importance if self._mass_seen else None
        for streams, feature_streams in o.groups:
            self._compress_group(streams, feature_streams, new_pages, imp, protect, ready)
        for s in STREAMS:
            self.store[f"{s}_tail"] = self.store[f"{s}_tail"][:, :, ready * p :].clone()
        self.n_pages += ready
        self.timing["compress_s"] += time.perf_counter() - t0
        self.timing["compress_blocks"] += ready * n
        return ready

    def _compress_group(self, streams, feature_streams, new_pages, imp, protect, ready) -> None:
        """Decide and store `ready` pages of `streams` one after the other (a page may use a base made just before),
        for every row and head at once; `feature_streams` give the features that decide."""
        o = self.options
        n = self.batch_rows * self.num_heads
        first = self.n_pages
        # features of the base candidates: every page already compressed (only bases are eligible)
        pool_feats = {s: page_features(self.store[f"{s}_full"], o.n_dct, o.features) for s in feature_streams}
        mode = self.store[f"{streams[0]}_mode"].reshape(n, first)
        cand = (
            combine_features(
                *[_take(pool_feats[s], self.store[f"{s}_slot"].reshape(n, first).long()) for s in feature_streams]
            )
            if feature_streams
            else None
        )
        is_base = mode == BASE
        rows = torch.arange(n, device=mode.device)
        for j in range(ready):
            page = first + j
            feats = {s: page_features(new_pages[s][:, j], o.n_dct, o.features) for s in feature_streams}
            new_feat = combine_features(*[feats[s] for s in feature_streams]) if feats else None
            threshold = self.budget.threshold()
            protected = imp[:, page] >= (protect if protect is not None else math.inf)
            best = torch.full((n,), float("-inf"), device=mode.device)
            best_q = torch.zeros(n, dtype=torch.long, device=mode.device)
            if new_feat is not None and is_base.any():
                sim = torch.einsum("nf,nqf->nq", new_feat, cand)
                if o.importance_weighting:
                    sim = sim * importance_weight(imp[:, page : page + 1], imp[:, :page])
                best, best_q = sim.masked_fill(~is_base, float("-inf")).max(dim=-1)
            # important pages stay as they are: never a delta, nor a base
            to_delta = (best >= threshold) & ~protected
            can_base = torch.ones_like(to_delta) if o.max_bases is None else is_base.sum(-1) < o.max_bases
            can_base &= ~protected
            new_mode = torch.where(to_delta, DELTA, torch.where(can_base, BASE, RAW)).to(torch.int8)
            for s in streams:
                if o.zero_reference(s):  # quantized directly (ablation / values in reference="keys")
                    s_delta = ~protected
                    s_mode = torch.where(s_delta, DELTA, RAW).to(torch.int8)
                    base_rows = torch.full((int(s_delta.sum()),), -1, dtype=torch.long, device=mode.device)
                else:
                    s_delta, s_mode = to_delta, new_mode
                    slot_all = self.store[f"{s}_slot"].reshape(n, -1)
                    base_rows = slot_all[rows[to_delta], best_q[to_delta]].long()
                self._store_page(s, new_pages[s][:, j], s_delta, base_rows, s_mode)
                if s in pool_feats:
                    pool_feats[s] = torch.cat([pool_feats[s], feats[s][~s_delta]])
            if new_feat is not None:
                cand = torch.cat([cand, new_feat.unsqueeze(1)], dim=1)
            is_base = torch.cat([is_base, (new_mode == BASE).unsqueeze(1)], dim=1)
            mode = torch.cat([mode, new_mode.unsqueeze(1)], dim=1)

    def _store_page(self, s, page, to_delta, base_rows, new_mode) -> None:
        """Append one page `[n, P, D]` (fp32, storage space) of stream `s`: full rows to the pool, the others as
        deltas against their base row of the pool (-1: against zero); record slot and mode."""
        o, st = self.options, self.store
        b, h = self.batch_rows, self.num_heads
        full = st[f"{s}_full"]
        keep = ~to_delta
        slot = torch.empty(b * h, dtype=torch.int32, device=page.device)
        n_keep = int(keep.sum())
        slot[keep] = torch.arange(full.shape[0], full.shape[0] + n_keep, dtype=torch.int32, device=page.device)
        if n_keep:
            st[f"{s}_full"] = torch.cat([full, page[keep].to(full.dtype)])
        n_delta = b * h - n_keep
        if n_delta:
            delta = page[to_delta] - self._bases(s, base_rows)
            codes, scales, zeros = encode_delta(delta, o.delta_bits, o.scale_of(s), not o.delta_asymmetric)
            have = st[f"{s}_dcodes"].shape[0]
            slot[to_delta] = torch.arange(have, have + n_delta, dtype=torch.int32, device=page.device)
            st[f"{s}_dcodes"] = torch.cat([st[f"{s}_dcodes"], codes])
            st[f"{s}_dscale"] = torch.cat([st[f"{s}_dscale"], scales])
            if zeros is not None:
                st[f"{s}_dzero"] = torch.cat([st[f"{s}_dzero"], zeros])
            st[f"{s}_dbase"] = torch.cat([st[f"{s}_dbase"], base_rows.to(torch.int32)])
        st[f"{s}_slot"] = torch.cat([st[f"{s}_slot"], slot.reshape(b, h, 1)], dim=2)
        st[f"{s}_mode"] = torch.cat([st[f"{s}_mode"], new_mode.reshape(b, h, 1)], dim=2)

    # ---- decompression ------------------------------------------------------------------------------------------
    def _bases(self, s: str, base_rows: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 base pages of `base_rows` (rows of the pool, or of `table`); zeros where the row is -1."""
        table = self.store[f"{s}_full"] if table is None else table
        base = _take(table, base_rows).float()
        return base * (base_rows >= 0).view(-1, 1, 1)

    def _decode_rows(self, s: str, rows: slice) -> torch.Tensor:
        """fp32 deltas `[n, P, D]` of the delta pool rows `rows` of stream `s`."""
        o, st = self.options, self.store
        zeros = st.get(f"{s}_dzero")
        return decode_delta(
            st[f"{s}_dcodes"][rows], st[f"{s}_dscale"][rows], o.delta_bits, o.scale_of(s), o.page_size,
            st[f"{s}_tail"].shape[-1], None if zeros is None else zeros[rows],
        )

    def _pages(self, s: str) -> torch.Tensor:
        """The compressed pages of stream `s`, rebuilt: fp32 `[batch, heads, pages * P, D]` (keys rotated back)."""
        o, st = self.options, self.store
        full = st[f"{s}_full"]
        b, h, _, d = st[f"{s}_tail"].shape
        table = full.float()
        if st[f"{s}_dcodes"].shape[0]:
            deltas = self._decode_rows(s, slice(None))
            table = torch.cat([table, self._bases(s, st[f"{s}_dbase"].long(), table) + deltas])
        mode, slot = st[f"{s}_mode"], st[f"{s}_slot"].long()
        idx = torch.where(mode == DELTA, slot + full.shape[0], slot)
        pages = table[idx].reshape(b, h, self.n_pages * o.page_size, d)
        if s == "k" and self.rotation is not None:
            pages = self.rotation.rotate(pages, 0)
        return pages

    def decompress_page(self, s: str, row: int, head: int, page: int) -> torch.Tensor:
        """One compressed page of stream `s` ("k" or "v"), rebuilt alone: fp32 `[P, D]` (keys rotated back)."""
        o, st = self.options, self.store
        if not 0 <= page < self.n_pages:
            raise ValueError(f"page {page} is not compressed; this layer holds compressed pages 0..{self.n_pages - 1}")
        slot = int(st[f"{s}_slot"][row, head, page])
        if int(st[f"{s}_mode"][row, head, page]) == DELTA:
            delta = self._decode_rows(s, slice(slot, slot + 1))[0]
            x = self._bases(s, st[f"{s}_dbase"][slot : slot + 1].long())[0] + delta
        else:
            x = st[f"{s}_full"][slot].float()
        if s == "k" and self.rotation is not None:
            x = self.rotation.rotate(x, page * o.page_size)
        return x

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        out = []
        for s in STREAMS:
            tail = self.store[f"{s}_tail"].to(self.dtype)
            out.append(torch.cat([self._pages(s).to(self.dtype), tail], dim=2) if self.n_pages else tail)
        if self.n_pages:
            self.timing["decompress_s"] += time.perf_counter() - t0
            self.timing["decompress_blocks"] += self.n_pages * self.batch_rows * self.num_heads
        return out[0], out[1]

    # ---- batch / beam contract ------------------------------------------------------------------------------------
    _BATCH_MAJOR = ("k_tail", "v_tail", "k_slot", "v_slot", "k_mode", "v_mode", "imp_mass")

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        for name in self._BATCH_MAJOR:
            self.store[name] = fn(self.store[name])
        for s in STREAMS:
            self._compact(s)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))  # pools are shared, nothing is copied

    def _compact(self, s: str) -> None:
        """Drop pool rows no (row, head, page) references any more, and renumber slots."""
        st = self.store
        full, codes = st[f"{s}_full"], st[f"{s}_dcodes"]
        n_full, n_delta = full.shape[0], codes.shape[0]
        if n_full + n_delta == 0:
            return
        mode, slot = st[f"{s}_mode"], st[f"{s}_slot"].long()
        is_delta = mode == DELTA
        used_d = torch.zeros(n_delta, dtype=torch.bool, device=slot.device)
        used_d[slot[is_delta]] = True
        used_f = torch.zeros(n_full, dtype=torch.bool, device=slot.device)
        used_f[slot[~is_delta]] = True
        bases = st[f"{s}_dbase"][used_d].long()
        used_f[bases[bases >= 0]] = True
        if bool(used_f.all()) and bool(used_d.all()):
            return
        new_f = torch.cumsum(used_f, 0) - 1
        new_d = torch.cumsum(used_d, 0) - 1
        st[f"{s}_slot"] = torch.where(is_delta, _take(new_d, slot), _take(new_f, slot)).to(torch.int32)
        st[f"{s}_full"] = full[used_f]
        st[f"{s}_dbase"] = torch.where(bases >= 0, _take(new_f, bases), -1).to(torch.int32)
        st[f"{s}_dcodes"] = codes[used_d]
        st[f"{s}_dscale"] = st[f"{s}_dscale"][used_d]
        if f"{s}_dzero" in st:
            st[f"{s}_dzero"] = st[f"{s}_dzero"][used_d]

    def _crop_newest(self, n: int) -> None:
        """Compressed pages that reach into the cropped tokens are decompressed back into the tail first (they will
        be compressed again once old enough)."""
        p = self.options.page_size
        keep = self.tokens_held() - n
        keep_pages = min(self.n_pages, keep // p)
        st = self.store
        if keep_pages < self.n_pages:
            for s in STREAMS:
                back = self._pages(s)[:, :, keep_pages * p :].to(st[f"{s}_tail"].dtype)
                st[f"{s}_tail"] = torch.cat([back, st[f"{s}_tail"]], dim=2)
                st[f"{s}_slot"] = st[f"{s}_slot"][:, :, :keep_pages].clone()
                st[f"{s}_mode"] = st[f"{s}_mode"][:, :, :keep_pages].clone()
            self.n_pages = keep_pages
            for s in STREAMS:
                self._compact(s)
        tail_keep = keep - self.n_pages * p
        for s in STREAMS:
            st[f"{s}_tail"] = st[f"{s}_tail"][:, :, :tail_keep].clone()
        pages = -(-keep // p)
        st["imp_mass"] = st["imp_mass"][:, :, :pages].clone()
        st["imp_obs"] = st["imp_obs"][:pages].clone()

    # ---- reporting ------------------------------------------------------------------------------------------------
    def page_counts(self) -> dict[str, int]:
        """Pages per kind, counting each (row, head, page) of keys and of values once."""
        counts = {"base_pages": 0, "delta_pages": 0, "raw_pages": 0}
        if not self.is_initialized:
            return counts
        for s in STREAMS:
            mode = self.store[f"{s}_mode"]
            counts["base_pages"] += int((mode == BASE).sum())
            counts["delta_pages"] += int((mode == DELTA).sum())
            counts["raw_pages"] += int((mode == RAW).sum())
        return counts

    def bytes_by_kind(self) -> dict[str, int]:
        kinds = {"full": ("full",), "delta": ("dcodes", "dscale", "dzero", "dbase"), "tail": ("tail",)}
        out = {k: 0 for k in (*kinds, "meta")}
        for name, t in self.store.items():
            field = name.split("_", 1)[1] if name[:2] in ("k_", "v_") else name
            kind = next((k for k, fields in kinds.items() if field in fields), "meta")
            out[kind] += t.nbytes
        return out
