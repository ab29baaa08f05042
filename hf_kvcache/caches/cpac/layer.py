"""`CPACLayer`: one model layer of a `CPACCache` (see the package docstring); `_Budget`: the memory pressure its
layers share."""

from __future__ import annotations

import copy
import logging
import math
import time

import torch

from ...policy.attention import window_attention, window_logits
from ...rope import KeyRotation
from ..base import CompressedLayer, Placeholder
from .delta import DeltaCodec
from .features import combine_features, importance_weight, page_features, threshold_for_pressure
from .options import STREAMS, CPACOptions
from .pool import BASE, DELTA, RAW, PagePool, take_rows

logger = logging.getLogger(__package__)


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
    """One model layer of a `CPACCache`: a `PagePool` per stream (`pools["k"]`, `pools["v"]`) and the attention mass
    its pages received (`imp_mass`, `imp_obs`); see the package docstring. It keeps nothing in the base class's
    `store`: the storage hooks (`state_tensors`, `held_tensors`, `batch_size`, `tokens_held`, `_map_store`, crop,
    reset) are its own."""

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
        self.pools: dict[str, PagePool] = {}  # "k", "v"; empty until the first update
        self.imp_mass: torch.Tensor | None = None  # [batch, heads, pages] fp32: attention received per page
        self.imp_obs: torch.Tensor | None = None  # [pages] fp32: queries that saw each page
        self.n_pages = 0  # compressed pages (the same for every row and head)
        self._pending = False  # pages may be ready, waiting for the attention mass of the last update
        self._mass_mode: bool | None = None  # does observe_attention follow each update?
        self._mass_seen = False
        self._last_query_len = 0
        # the attention each of the last (at most `crop_window`) queries of the last forward gave each page, for crop
        self.query_mass: torch.Tensor | None = None  # [batch, heads, w, pages] fp32
        self.query_mass_positions: torch.Tensor | None = None  # [w] int64
        self._forward: dict | None = None  # this forward's keys and last queries, until its mass arrives
        # why a crop left an importance it could not correct (the next update raises it); None when it is right
        self.stale_after_crop: str | None = None

    @property
    def query_window(self) -> int:
        """Queries the `"hf_kvcache"` attention reports (`observe_queries`): the last `crop_window`, while attention
        mass arrives (their attention per page is kept for crop)."""
        return 0 if self._mass_mode is False else self.options.crop_window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """`CompressedLayer.update`, keeping (until this forward's mass arrives) the keys the attention sees, from
        which `observe_attention` splits the mass of a forward of several queries per query."""
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self._pending and self.query_window:
            self._forward = {"keys": None if isinstance(keys, Placeholder) else keys.detach(),
                             "new_keys": key_states.detach()}
        return keys, values

    def reset(self) -> None:
        super().reset()
        self._reset_state()

    def __copy__(self) -> CPACLayer:
        """A shallow copy (tensors shared) whose storage can be cropped or remapped without touching this layer's,
        as a copy given its own `store` dict could (the prefix store crops such copies before encoding them)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.pools = {s: copy.copy(pool) for s, pool in self.pools.items()}
        return new

    # ---- set-up -------------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self.rotation is not None and 2 * self.rotation.inv_freq.numel() != self.head_dim:
            raise ValueError(
                f"key_space='derotated': the config's RoPE covers {2 * self.rotation.inv_freq.numel()} dims but "
                f"keys have head_dim={self.head_dim}"
            )
        o, dev = self.options, key_states.device
        b, h = key_states.shape[0], key_states.shape[1]
        for s, d in (("k", self.head_dim), ("v", self.value_dim)):
            codec = DeltaCodec(o.delta_bits, o.scale_of(s), not o.delta_asymmetric, o.page_size, d)
            self.pools[s] = PagePool.empty(codec, b, h, o.torch_full_dtype, dev)
        self.imp_mass = torch.zeros(b, h, 0, dtype=torch.float32, device=dev)
        self.imp_obs = torch.zeros(0, dtype=torch.float32, device=dev)

    # ---- storage hooks of CompressedLayer -----------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the layer keeps, by name: `k_<field>` / `v_<field>` of the pools, `imp_mass`, `imp_obs`,
        `query_mass`, `query_mass_positions`."""
        if not self.pools:
            return {}
        out = {f"{s}_{name}": t for s, pool in self.pools.items() for name, t in pool.tensors().items()}
        out["imp_mass"], out["imp_obs"] = self.imp_mass, self.imp_obs
        if self.query_mass is not None:
            out["query_mass"], out["query_mass_positions"] = self.query_mass, self.query_mass_positions
        return out

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.state_tensors().values())

    def batch_size(self) -> int:
        return self.pools["k"].tail.shape[0] if self.pools else 0

    def _map_store(self, fn) -> None:
        """Beam reorder / batch selection / repetition: rows remap their slots, pools are shared (nothing copied)."""
        if not self.pools:
            return
        for pool in self.pools.values():
            pool.map(fn)
        self.imp_mass = fn(self.imp_mass)
        if self.query_mass is not None:
            self.query_mass = fn(self.query_mass)

    def tail_tokens(self) -> int:
        return self.pools["k"].tail.shape[2] if self.pools else 0

    def tokens_held(self) -> int:
        return self.n_pages * self.options.page_size + self.tail_tokens() if self.pools else 0

    # ---- update / attention mass --------------------------------------------------------------------------------
    def _begin_update(self) -> None:
        self._forward = None
        if self.stale_after_crop:
            raise ValueError(self.stale_after_crop)
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

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        fd = self.options.torch_full_dtype
        for s, x in (("k", key_states), ("v", value_states)):
            self.pools[s].tail = torch.cat([self.pools[s].tail, x.to(fd)], dim=2)
        pages_now = -(-self.tokens_held() // self.options.page_size)
        grow = pages_now - self.imp_obs.shape[0]
        if grow > 0:
            mass = self.imp_mass
            self.imp_mass = torch.cat([mass, mass.new_zeros(*mass.shape[:2], grow)], dim=2)
            self.imp_obs = torch.cat([self.imp_obs, mass.new_zeros(grow)])
            if self.query_mass is not None:
                self.query_mass = torch.nn.functional.pad(self.query_mass, (0, grow))
        self._last_query_len = key_states.shape[2]
        if self._mass_mode is False:
            self.compress_ready()
        else:  # wait for observe_attention (or, if it never comes, for the next update)
            self._pending = True

    def observe_queries(self, queries: torch.Tensor, scaling: float) -> None:
        """The last `query_window` queries `[batch, heads, w, head_dim]` of this forward, held until its mass
        arrives (`observe_attention` splits the mass per query with them)."""
        if self._pending and self.query_window and self._forward is not None:
            self._forward.update(queries=queries.detach(), scaling=float(scaling))

    def observe_attention(self, mass: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        n = self.tokens_held()
        expected = (self.batch_size(), self.num_heads, n)
        if tuple(mass.shape) != expected:
            raise ValueError(
                f"observe_attention expects mass [batch, kv_heads, tokens] = {list(expected)} (held tokens, then "
                f"the new ones), got {list(mass.shape)}"
            )
        p = self.options.page_size
        pages = self.imp_obs.shape[0]
        q = min(self._last_query_len, n)
        obs = torch.full((pages * p,), float(q), device=mass.device)
        obs[n - q : n] = torch.arange(q, 0, -1, dtype=torch.float32, device=mass.device)  # causal: i-th new token
        obs[n:] = 0
        padded = torch.nn.functional.pad(mass.float(), (0, pages * p - n))
        self.imp_mass = self.imp_mass + padded.reshape(*padded.shape[:2], pages, p).sum(-1)
        self.imp_obs = self.imp_obs + obs.reshape(pages, p).sum(-1)
        self._keep_query_mass(mass, q)
        self._mass_mode = True
        self._mass_seen = True
        if self._pending:
            self._pending = False
            self.compress_ready()

    def _keep_query_mass(self, mass: torch.Tensor, q: int) -> None:
        """Keep in `query_mass` the attention each of the last (at most `crop_window`) queries of this forward gave
        each page: the reported `mass [batch, heads, held]` itself for a forward of one query, else recomputed per
        query from the keys the attention saw and the queries it reported."""
        forward, self._forward = self._forward, None
        self.query_mass = self.query_mass_positions = None
        window = self.options.crop_window
        if not window or self._mass_mode is False:
            return
        b, h, n = mass.shape
        p, pages = self.options.page_size, self.imp_obs.shape[0]
        dev = mass.device
        if q == 1:
            per_query = mass.float()[:, :, None]
        elif forward is None or "queries" not in forward:
            return  # no queries reported (a layer driven by hand): a crop of these positions raises
        else:
            queries = forward["queries"][:, :, -window:]
            keys = forward["keys"]
            if keys is None:  # the fused attention read the storage: rebuild what it saw
                keys = torch.cat([self.materialize()[0][:, :, : n - q], forward["new_keys"]], 2)
            keys = keys[:, :, :n].to(queries.dtype)
            w = queries.shape[2]
            q_pos = torch.arange(n - w, n, device=dev)
            k_pos = torch.arange(n, device=dev).expand(b, h, n)
            k_valid, q_valid = self._unpadded(k_pos), self._unpadded(q_pos[None].expand(b, w))
            per_query = window_attention(window_logits(queries, q_pos, q_valid, keys, k_pos, k_valid,
                                                       forward["scaling"], in_dtype=True))
        per_query = torch.nn.functional.pad(per_query, (0, pages * p - n)).reshape(b, h, -1, pages, p).sum(-1)
        self.query_mass = per_query.contiguous()
        self.query_mass_positions = torch.arange(n - per_query.shape[2], n, device=dev)

    def _unpadded(self, positions: torch.Tensor) -> torch.Tensor:
        """`positions [batch, ...]` -> bool, False at the left padding of each row (`set_padding`)."""
        pad = self.row_padding(positions.shape[0])
        if pad is None:
            return torch.ones_like(positions, dtype=torch.bool)
        return positions >= pad.to(positions.device).view(-1, *[1] * (positions.dim() - 1))

    def importance(self) -> torch.Tensor:
        """`[batch, heads, pages]` in [0, 1]: mean attention per query, over the largest of the row and head;
        all zeros while no attention mass was ever observed (uniform fallback)."""
        if not self._mass_seen:
            return torch.zeros_like(self.imp_mass)
        per_query = self.imp_mass / self.imp_obs.clamp_min(1.0)
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
        n = self.batch_size() * self.num_heads
        start = self.n_pages * p
        # pages to compress, in the space they are stored in (keys de-rotated when key_space="derotated")
        new_pages = {}
        for s in STREAMS:
            x = self.pools[s].tail[:, :, : ready * p]
            x = self.rotation.derotate(x, start) if (s == "k" and self.rotation is not None) else x.float()
            new_pages[s] = x.reshape(n, ready, p, x.shape[-1])
        imp = self.importance().reshape(n, -1)
        protect = o.protect_importance if self._mass_seen else None
        for streams, feature_streams in o.groups:
            self._compress_group(streams, feature_streams, new_pages, imp, protect, ready)
        for pool in self.pools.values():
            pool.tail = pool.tail[:, :, ready * p :].clone()
        self.n_pages += ready
        self.timing["compress_s"] += time.perf_counter() - t0
        self.timing["compress_blocks"] += ready * n
        return ready

    def _compress_group(self, streams, feature_streams, new_pages, imp, protect, ready) -> None:
        """Decide and store `ready` pages of `streams` one after the other (a page may use a base made just before),
        for every row and head at once; `feature_streams` give the features that decide."""
        o, pools = self.options, self.pools
        n = self.batch_size() * self.num_heads
        first = self.n_pages
        # features of the base candidates: every page already compressed (only bases are eligible)
        pool_feats = {s: page_features(pools[s].full, o.n_dct, o.features) for s in feature_streams}
        mode = pools[streams[0]].mode.reshape(n, first)
        cand = (
            combine_features(
                *[take_rows(pool_feats[s], pools[s].slot.reshape(n, first).long()) for s in feature_streams]
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
                    slot_all = pools[s].slot.reshape(n, -1)
                    base_rows = slot_all[rows[to_delta], best_q[to_delta]].long()
                pools[s].add_page(new_pages[s][:, j], s_delta, base_rows, s_mode)
                if s in pool_feats:
                    pool_feats[s] = torch.cat([pool_feats[s], feats[s][~s_delta]])
            if new_feat is not None:
                cand = torch.cat([cand, new_feat.unsqueeze(1)], dim=1)
            is_base = torch.cat([is_base, (new_mode == BASE).unsqueeze(1)], dim=1)
            mode = torch.cat([mode, new_mode.unsqueeze(1)], dim=1)

    # ---- decompression ------------------------------------------------------------------------------------------
    def _pages(self, s: str) -> torch.Tensor:
        """The compressed pages of stream `s`, rebuilt: fp32 `[batch, heads, pages * P, D]` (keys rotated back)."""
        pages = self.pools[s].pages()
        if s == "k" and self.rotation is not None:
            pages = self.rotation.rotate(pages, 0)
        return pages

    def decompress_page(self, s: str, row: int, head: int, page: int) -> torch.Tensor:
        """One compressed page of stream `s` ("k" or "v"), rebuilt alone: fp32 `[P, D]` (keys rotated back)."""
        if not 0 <= page < self.n_pages:
            raise ValueError(f"page {page} is not compressed; this layer holds compressed pages 0..{self.n_pages - 1}")
        x = self.pools[s].page(row, head, page)
        if s == "k" and self.rotation is not None:
            x = self.rotation.rotate(x, page * self.options.page_size)
        return x

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        out = []
        for s in STREAMS:
            tail = self.pools[s].tail.to(self.dtype)
            out.append(torch.cat([self._pages(s).to(self.dtype), tail], dim=2) if self.n_pages else tail)
        if self.n_pages:
            self.timing["decompress_s"] += time.perf_counter() - t0
            self.timing["decompress_blocks"] += self.n_pages * self.batch_size() * self.num_heads
        return out[0], out[1]

    def _crop_newest(self, n: int) -> None:
        """Compressed pages that reach into the cropped tokens are decompressed back into the tail first (they will
        be compressed again once old enough); the attention the cropped queries gave leaves the importance
        (`_undo_importance`)."""
        p = self.options.page_size
        keep = self.tokens_held() - n
        if self._mass_mode:
            self._undo_importance(keep)
        keep_pages = min(self.n_pages, keep // p)
        if keep_pages < self.n_pages:
            for s, pool in self.pools.items():
                back = self._pages(s)[:, :, keep_pages * p :].to(pool.tail.dtype)
                pool.tail = torch.cat([back, pool.tail], dim=2)
                pool.truncate(keep_pages)
                pool.compact()
            self.n_pages = keep_pages
        tail_keep = keep - self.n_pages * p
        for pool in self.pools.values():
            pool.tail = pool.tail[:, :, :tail_keep].clone()
        pages = -(-keep // p)
        self.imp_mass = self.imp_mass[:, :, :pages].clone()
        self.imp_obs = self.imp_obs[:pages].clone()
        if self.query_mass is not None:  # the kept queries of the last forward stay
            pos = self.query_mass_positions
            self.query_mass = self.query_mass[:, :, pos < keep, :pages].clone()
            self.query_mass_positions = pos[pos < keep].clone()

    def _undo_importance(self, keep: int) -> None:
        """Take out of `imp_mass` / `imp_obs` what the queries of positions `keep ..` added: their attention per
        page (`query_mass`) and their observations (one of every token up to its position per query; a page cut by
        the crop keeps its sums)."""
        held, n, p = self.tokens_held(), self.tokens_held() - keep, self.options.page_size
        pos = self.query_mass_positions
        if pos is None or int(((pos >= keep) & (pos < held)).sum()) != n:
            # a copy cropped to be encoded (the prefix store) goes on; this layer may not
            self.stale_after_crop = (
                f"CPACCache cannot crop {n} token(s): the page importance holds the attention their queries gave, and "
                f"this layer keeps that attention per query only for the last {self.options.crop_window} queries "
                "(crop_window) of the last forward, when the 'hf_kvcache' attention reported them; crop right after "
                "the forward that brought the tokens (as assisted decoding does), or build the cache with "
                f"crop_window >= {n}"
            )
            return
        pages = self.imp_obs.shape[0]
        self.imp_mass = self.imp_mass - self.query_mass[:, :, pos >= keep].sum(2)[..., :pages]
        t = torch.arange(pages * p, device=pos.device)
        seen = torch.where(t < keep, n, (held - t).clamp(min=0)).float()  # a cropped token was seen by cropped queries
        self.imp_obs = self.imp_obs - seen.reshape(pages, p).sum(-1)

    # ---- reporting ------------------------------------------------------------------------------------------------
    def page_counts(self) -> dict[str, int]:
        """Pages per kind, counting each (row, head, page) of keys and of values once."""
        counts = {"base_pages": 0, "delta_pages": 0, "raw_pages": 0}
        for pool in self.pools.values():
            counts["base_pages"] += int((pool.mode == BASE).sum())
            counts["delta_pages"] += int((pool.mode == DELTA).sum())
            counts["raw_pages"] += int((pool.mode == RAW).sum())
        return counts

    def bytes_by_kind(self) -> dict[str, int]:
        kinds = {"full": ("full",), "delta": ("dcodes", "dscale", "dzero", "dbase"), "tail": ("tail",)}
        out = {k: 0 for k in (*kinds, "meta")}
        for pool in self.pools.values():
            for name, t in pool.tensors().items():
                out[next((k for k, fields in kinds.items() if name in fields), "meta")] += t.nbytes
        if self.pools:
            out["meta"] += self.imp_mass.nbytes + self.imp_obs.nbytes
            out["meta"] += sum(t.nbytes for t in (self.query_mass, self.query_mass_positions) if t is not None)
        return out
