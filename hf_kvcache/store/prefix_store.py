"""`PrefixStore`: encoded KV of token prefixes, found by longest-prefix match, kept under a byte budget.

    store = PrefixStore(config=model.config, backend=DiskBackend("/tmp/kv"), budget_bytes=2**30)
    cache, hit = store.match(input_ids, config=model.config)      # hit.tokens of the prompt come from the store
    out = model.generate(input_ids, past_key_values=cache)         # prefills only input_ids[:, hit.tokens:]
    store.insert(input_ids, cache)                                 # encoded in a background thread
    out = store.generate(model, input_ids, max_new_tokens=20)      # the same in one call

Entries are chunk-aligned: inserting `n` tokens stores the first `n // chunk * chunk`. A query matches the longest
run of tokens it shares with any stored prefix (radix tree), rounded down to the chunk and kept below the query's
length (generate needs at least one token to prefill); the shortest entry containing that run is decoded and
cropped to it.

Budget and rematerialization (ADR-004): `budget_bytes` bounds the bytes held (blobs, plus 4 bytes per token of the
id-only entries). An entry either keeps its encoded KV or only its token ids (a hit then recomputes: the caller
prefills, and `generate` re-inserts the KV). The `CostModel` prices a hit both ways: decoding costs
`blob bytes / decode bytes-per-second`, recomputing costs `tokens / prefill tokens-per-second`, both measured on
this machine (`CostModel.measure(model)`, then refined from every decode and prefill the store sees). An entry whose
KV would not decode faster than recomputing it is kept as ids from the start. Over budget, the least recently used
KV entries are demoted to ids (first any whose KV no longer pays off under the current rates, then in LRU order);
when only ids are left, the least recently used entries are evicted.
`stats()` reports hits, misses, recomputes, demotions, evictions and bytes.
"""

from __future__ import annotations

import copy
import hashlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from .. import codec
from .backends import Backend, MemoryBackend
from .radix import RadixTree
from ..transformers_compat import cache_kwargs

ID_BYTES = 4  # bytes accounted per token of an id-only entry


@dataclass
class CostModel:
    """Seconds a hit costs: decoding `bytes` at `decode_bytes_per_s` vs prefilling `tokens` at `prefill_tokens_per_s`.

    Start values are rough CPU figures; `measure(model)` times both on this machine, and `observe_*` folds in every
    decode / prefill the store sees (exponential moving average, weight `alpha`)."""

    decode_bytes_per_s: float = 50e6
    prefill_tokens_per_s: float = 200.0
    alpha: float = 0.3

    def decode_s(self, nbytes: int) -> float:
        return nbytes / self.decode_bytes_per_s

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def seconds_saved(self, tokens: int, nbytes: int) -> float:
        """Seconds a hit on this entry saves by decoding instead of recomputing (negative: recompute is faster)."""
        return self.prefill_s(tokens) - self.decode_s(nbytes)

    def observe_decode(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self.decode_bytes_per_s += self.alpha * (nbytes / seconds - self.decode_bytes_per_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            self.prefill_tokens_per_s += self.alpha * (tokens / seconds - self.prefill_tokens_per_s)

    @classmethod
    @torch.inference_mode()
    def measure(cls, model: Any, tokens: int = 256, **encode_options: Any) -> "CostModel":
        """Time a prefill of `tokens` random tokens and the decode of its encoded cache on this machine."""
        ids = torch.randint(0, model.config.get_text_config(decoder=True).vocab_size, (1, tokens),
                            generator=torch.Generator().manual_seed(0)).to(model.device)
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        model(ids, **cache_kwargs(cache), use_cache=True)
        prefill = time.perf_counter() - t0
        blob = codec.encode(cache, config=model.config, **encode_options)
        t0 = time.perf_counter()
        codec.decode(blob, config=model.config, device=model.device)
        decode = time.perf_counter() - t0
        return cls(decode_bytes_per_s=len(blob) / decode, prefill_tokens_per_s=tokens / prefill)


@dataclass
class Hit:
    """Outcome of `match`: `tokens` of the query served by the store (0 on a miss) and how: "kv" (decoded),
    "recompute" (the entry kept only ids: the caller prefills everything), or "miss"."""

    tokens: int
    kind: str
    key: str | None = None
    decode_s: float = 0.0

    def __bool__(self) -> bool:
        return self.kind == "kv" and self.tokens > 0


@dataclass
class _Entry:
    key: str
    tokens: int
    nbytes: int = 0  # blob bytes in the backend (0 while pending or for id-only entries)
    has_kv: bool = False
    pending: bool = True
    last_used: int = 0
    hits: int = 0


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    recomputes: int = 0
    inserts: int = 0
    demotions: int = 0
    evictions: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    extra: dict = field(default_factory=dict)


class PrefixStore:
    """Longest-prefix store of encoded KV caches (see the module docstring).

    config: the model's config (fingerprints the blobs; `match`/`insert` may pass their own);
    backend: `MemoryBackend()` (default), `DiskBackend(dir)` or `RedisBackend(...)`;
    budget_bytes: bound on bytes held (None: unbounded); chunk: entry alignment in tokens;
    mode / encode_options: what `codec.encode` gets (default: lossy CacheGen with its defaults);
    cost_model: a `CostModel` (default: start values refined online); background: encode in a worker thread.
    """

    def __init__(self, config: Any = None, backend: Backend | None = None, budget_bytes: int | None = None,
                 chunk: int = 256, mode: str = "lossy", encode_options: dict | None = None,
                 cost_model: CostModel | None = None, background: bool = True) -> None:
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"budget_bytes must be a non-negative integer or None, got {budget_bytes!r}")
        if mode not in codec.MODES:
            raise ValueError(f"mode={mode!r} is not valid; choose one of {list(codec.MODES)}")
        self.config = config
        self.backend = backend if backend is not None else MemoryBackend()
        self.budget_bytes = budget_bytes
        self.chunk = chunk
        self.mode = mode
        self.encode_options = dict(encode_options or {})
        self.cost = cost_model if cost_model is not None else CostModel()
        self.tree = RadixTree()
        self.entries: dict[str, _Entry] = {}
        self._stats = StoreStats()
        self._clock = 0
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-encode") if background else None
        self._futures: list[Future] = []

    # ---- helpers --------------------------------------------------------------------------------------------------
    @staticmethod
    def _ids(input_ids: Any) -> list[int]:
        t = torch.as_tensor(input_ids)
        if t.dim() == 2:
            if t.shape[0] != 1:
                raise ValueError(f"the prefix store serves one sequence at a time; got a batch of {t.shape[0]}")
            t = t[0]
        if t.dim() != 1:
            raise ValueError(f"input_ids must be [tokens] or [1, tokens], got shape {tuple(t.shape)}")
        return [int(x) for x in t.tolist()]

    @staticmethod
    def key_for(tokens: list[int]) -> str:
        digest = hashlib.sha256(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]
        return f"p{len(tokens)}-{digest}"

    def _config(self, config: Any) -> Any:
        config = config if config is not None else self.config
        if config is None:
            raise ValueError("pass config=model.config (to PrefixStore or to this call)")
        return config

    def _touch(self, entry: _Entry) -> None:
        self._clock += 1
        entry.last_used = self._clock

    def bytes_held(self) -> int:
        with self._lock:
            return sum(e.nbytes if e.has_kv else e.tokens * ID_BYTES for e in self.entries.values())

    # ---- lookup ---------------------------------------------------------------------------------------------------
    def match(self, input_ids: Any, config: Any = None, device: str | torch.device = "cpu") -> tuple[Cache, Hit]:
        """(cache, hit): a cache holding the first `hit.tokens` tokens of `input_ids` (an empty `DynamicCache` on a
        miss or a recompute), ready for `model.generate(input_ids, past_key_values=cache)`."""
        config = self._config(config)
        ids = self._ids(input_ids)
        with self._lock:
            depth, found = self.tree.longest_match(ids)
            usable = min(depth, len(ids) - 1) // self.chunk * self.chunk
            found = [(k, n) for k, n in found if not self.entries[k].pending]
            if usable == 0 or not found:
                self._stats.misses += 1
                return DynamicCache(config=config), Hit(0, "miss")
            kv = [(k, n) for k, n in found if self.entries[k].has_kv]
            key = (kv or found)[0][0]
            entry = self.entries[key]
            self._touch(entry)
            entry.hits += 1
            if not entry.has_kv:
                self._stats.recomputes += 1
                return DynamicCache(config=config), Hit(usable, "recompute", key)
        blob = self.backend.get(key)
        if blob is None:  # vanished from a shared backend (e.g. evicted by another process)
            with self._lock:
                self._drop(key)
                self._stats.misses += 1
            return DynamicCache(config=config), Hit(0, "miss")
        t0 = time.perf_counter()
        cache = codec.decode(blob, config=config, device=device)
        if cache.get_seq_length() > usable:
            cache.crop(usable - cache.get_seq_length())
        seconds = time.perf_counter() - t0
        with self._lock:
            self.cost.observe_decode(len(blob), seconds)
            self._stats.hits += 1
            self._stats.decode_s += seconds
        return cache, Hit(usable, "kv", key, seconds)

    # ---- insertion ------------------------------------------------------------------------------------------------
    def insert(self, input_ids: Any, cache: Cache, config: Any = None) -> Future | None:
        """Store the chunk-aligned prefix of `input_ids` that `cache` holds. The cache is snapshotted here (layer
        objects copied, tensors shared: caches append by concatenation, never in place) and encoded in the
        background; returns the Future (None when nothing is stored). `flush()` waits for every pending insert."""
        config = self._config(config)
        ids = self._ids(input_ids)
        n = min(len(ids), cache.get_seq_length()) // self.chunk * self.chunk
        if n == 0:
            return None
        prefix = ids[:n]
        key = self.key_for(prefix)
        with self._lock:
            old = self.entries.get(key)
            if old is not None and (old.has_kv or old.pending):
                self._touch(old)
                return None
            entry = _Entry(key, n)
            self._touch(entry)
            self.entries[key] = entry
            replaced = self.tree.insert(prefix, key)
            if replaced is not None and replaced != key:
                self._drop(replaced)
            if self.cost.seconds_saved(n, self._estimate_bytes(cache, n)) <= 0:
                entry.pending = False  # recomputing is cheaper than decoding: keep the ids only
                self._stats.inserts += 1
                self._enforce_budget()
                return None
        snapshot = self._snapshot(cache)
        job = (key, snapshot, cache.get_seq_length() - n, config)
        if self._pool is None:
            self._encode(*job)
            return None
        fut = self._pool.submit(self._encode, *job)
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [fut]
        return fut

    def _estimate_bytes(self, cache: Cache, tokens: int) -> int:
        """Blob size guess for the cost model before encoding: 1/4 of the fp16 bytes for lossy (about what the
        defaults reach), the bytes the cache holds for lossless."""
        from ..caches.base import memory_stats

        stats = memory_stats(cache)
        per_token = (stats["fp16_bytes"] / 4 if self.mode == "lossy" else stats["bytes"]) / max(stats["tokens"], 1)
        return int(per_token * tokens)

    @staticmethod
    def _snapshot(cache: Cache) -> Cache:
        snap = copy.copy(cache)
        layers = []
        for layer in cache.layers:  # a layer's crop assigns new storage objects: a shallow copy leaves the original
            layers.append(copy.copy(layer))
        snap.layers = layers
        return snap

    def _encode(self, key: str, snapshot: Cache, extra_tokens: int, config: Any) -> None:
        try:
            if extra_tokens > 0:
                for layer in snapshot.layers:
                    layer.crop(-extra_tokens)
            t0 = time.perf_counter()
            blob = codec.encode(snapshot, config=config, mode=self.mode, **self.encode_options)
            seconds = time.perf_counter() - t0
            with self._lock:
                entry = self.entries.get(key)
                if entry is None:  # dropped while encoding
                    return
                self.backend.put(key, blob)
                entry.nbytes, entry.has_kv, entry.pending = len(blob), True, False
                self._stats.inserts += 1
                self._stats.encode_s += seconds
                if self.cost.seconds_saved(entry.tokens, entry.nbytes) <= 0:
                    self._demote(entry)
                self._enforce_budget()
        except Exception as exc:
            with self._lock:
                self._stats.extra.setdefault("encode_errors", []).append(f"{type(exc).__name__}: {exc}")
                if key in self.entries:
                    self._drop(key)
            raise

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every pending insert is encoded and stored (re-raises an encode error)."""
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            f.result(timeout=timeout)

    # ---- budget ---------------------------------------------------------------------------------------------------
    def _demote(self, entry: _Entry) -> None:
        self.backend.delete(entry.key)
        entry.has_kv, entry.nbytes = False, 0
        self._stats.demotions += 1

    def _drop(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        if key in self.tree:
            self.tree.remove(key)
        if entry.has_kv:
            self.backend.delete(key)

    def _enforce_budget(self) -> None:
        if self.budget_bytes is None:
            return
        while self.bytes_held() > self.budget_bytes:
            kv = [e for e in self.entries.values() if e.has_kv]
            if kv:
                victim = min(kv, key=lambda e: (self.cost.seconds_saved(e.tokens, e.nbytes) > 0, e.last_used))
                self._demote(victim)
                continue
            idle = [e for e in self.entries.values() if not e.pending]
            if not idle:
                return
            victim = min(idle, key=lambda e: e.last_used)
            self._drop(victim.key)
            self._stats.evictions += 1

    # ---- reporting / helpers --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and bytes: hits, misses, recomputes, inserts, demotions, evictions, entries, kv_entries,
        bytes (held), budget_bytes, encode_s / decode_s (total), and the cost model's current rates."""
        with self._lock:
            s = self._stats
            return {
                "hits": s.hits, "misses": s.misses, "recomputes": s.recomputes, "inserts": s.inserts,
                "demotions": s.demotions, "evictions": s.evictions,
                "entries": len(self.entries), "kv_entries": sum(e.has_kv for e in self.entries.values()),
                "pending": sum(e.pending for e in self.entries.values()),
                "bytes": self.bytes_held(), "budget_bytes": self.budget_bytes,
                "encode_s": round(s.encode_s, 4), "decode_s": round(s.decode_s, 4),
                "decode_MBps": round(self.cost.decode_bytes_per_s / 1e6, 2),
                "prefill_tokens_per_s": round(self.cost.prefill_tokens_per_s, 2),
                **s.extra,
            }

    def generate(self, model: Any, input_ids: Any, **generate_kwargs: Any) -> torch.Tensor:
        """`model.generate` through the store: match, generate (prefilling only the unseen suffix), insert the
        prompt's KV in the background. Recompute hits and misses time their prefill into the cost model."""
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        cache, hit = self.match(ids, config=model.config, device=model.device)
        ids = ids.to(model.device)
        start = hit.tokens if hit else 0
        if ids.shape[1] - 1 > start:  # prefill all but the last prompt token here, timed for the cost model
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(ids[:, start:-1], **cache_kwargs(cache), use_cache=True)
            with self._lock:
                self.cost.observe_prefill(ids.shape[1] - 1 - start, time.perf_counter() - t0)
        self.insert(ids, cache, config=model.config)  # snapshot now: generate appends to the cache afterwards
        return model.generate(ids, **cache_kwargs(cache), **generate_kwargs)

    def close(self) -> None:
        """Wait for pending inserts, stop the worker and close the backend."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.backend.close()

    def __enter__(self) -> "PrefixStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
