"""Paged storage with shared prefixes (`hf_kvcache.paged`): the pool's references and free list, sharing by content
and by batch operations, copy-on-write of diverging rows, and generate on SmolLM2 with and without sharing."""

import pytest
import torch
from transformers import LlamaConfig

import hf_kvcache
from hf_kvcache.paged import PageFormat, PagePool, PagedCache, quantize_pages
from hf_kvcache.paged import pool as pool_module

H, D, P = 2, 16, 8  # kv heads, head dim, page size of the random-KV tests


def cache(config=None, **options):
    return PagedCache(config=config, **{"page_size": P, "group_size": 8, "tail_dtype": None, **options})


def records(pool, n, seed):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, H, P, D, generator=g), torch.randn(n, H, P, D, generator=g)
    return pool.encode(quantize_pages(k, v, pool.fmt))


def new_pool():
    fmt = PageFormat(kv_heads=H, page_size=P, head_dim=D, value_dim=D, bits=4, group_size=8)
    return PagePool(fmt, torch.device("cpu"))


def held(c):
    return c.memory_stats()["bytes"]


def read(c, layer=0):
    return c.layers[layer].materialize()


def filled_cache():
    """A cache holding 2 rows of 3 full pages + 2 tail tokens of random keys/values (seed 0)."""
    torch.manual_seed(0)
    c = cache()
    c.update(torch.randn(2, H, 3 * P + 2, D), torch.randn(2, H, 3 * P + 2, D), 0)
    return c


# ---- the pool --------------------------------------------------------------------------------------------------------
def test_pool_refcounts_free_list_and_slot_reuse():
    pool = new_pool()
    ids = pool.add(records(pool, 3, 0), share=False)
    assert ids.tolist() == [0, 1, 2] and pool.refcount.tolist() == [1, 1, 1]
    pool.retain(torch.tensor([1, 1]))
    assert pool.refcount.tolist() == [1, 3, 1]
    pool.release(torch.tensor([1, 1, 2]))
    assert pool.refcount.tolist() == [1, 1, 0] and pool.free_pages() == 1 and pool.pages_in_use() == 2
    again = pool.add(records(pool, 1, 1), share=False)
    assert again.tolist() == [2] and pool.capacity == 3  # the freed slot is reused, the pool does not grow
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(torch.tensor([0, 0]))


def test_pool_shares_equal_records_only():
    pool = new_pool()
    a, b = records(pool, 1, 0), records(pool, 1, 1)
    ids = pool.add(torch.cat([a, a, b, a]), share=True)
    assert ids.tolist() == [0, 0, 1, 0] and pool.refcount.tolist() == [3, 1]
    assert pool.add(a, share=True).tolist() == [0] and pool.refcount[0] == 4  # against pages already held
    assert pool.add(a, share=False).tolist() == [2]  # unshared: a copy
    # a freed page leaves the digest index: an equal record later gets a fresh page, never a freed slot's old id
    pool.release(torch.tensor([1]))
    assert pool.add(b, share=True).tolist() == [1] and pool.refcount[1] == 1


def test_no_false_sharing_when_digests_collide(monkeypatch):
    class Constant:
        def __init__(self, *args, **kwargs):
            pass

        def digest(self):
            return b"x" * 16

    monkeypatch.setattr(pool_module.hashlib, "blake2b", Constant)
    pool = new_pool()
    a, b = records(pool, 1, 0), records(pool, 1, 1)
    assert pool.add(torch.cat([a, b, a]), share=True).tolist() == [0, 1, 0]
    assert pool.add(b, share=True).tolist() == [2]  # same digest as page 0, other bytes: not shared


def test_records_decode_to_the_pages_encoded():
    pool = new_pool()
    k, v = torch.randn(3, H, P, D), torch.randn(3, H, P, D)
    pages = quantize_pages(k, v, pool.fmt)
    back = pool.decode(pool.encode(pages))
    for a, b in ((pages.keys, back.keys), (pages.values, back.values)):
        for x, y in zip((a.codes, a.scale, a.zero), (b.codes, b.scale, b.zero)):
            assert torch.equal(x, y)
    ids = pool.add(pool.encode(pages), share=False)
    keys, values = pool.read(ids, torch.float32)
    assert (keys - k).abs().max() < 0.5 and (values - v).abs().max() < 0.5  # 4-bit codes of N(0, 1)


# ---- sharing in a layer ----------------------------------------------------------------------------------------------
def test_identical_rows_share_pages_different_rows_do_not():
    torch.manual_seed(0)
    k, v = torch.randn(1, H, 4 * P + 3, D), torch.randn(1, H, 4 * P + 3, D)
    same = cache()
    same.update(k.repeat(4, 1, 1, 1), v.repeat(4, 1, 1, 1), 0)
    assert same.page_stats().references == 16 and same.page_stats().pages == 4
    apart = cache()
    apart.update(torch.randn(4, H, 4 * P + 3, D), torch.randn(4, H, 4 * P + 3, D), 0)
    assert apart.page_stats().pages == 16
    unshared = cache(share=False)
    unshared.update(k.repeat(4, 1, 1, 1), v.repeat(4, 1, 1, 1), 0)
    assert unshared.page_stats().pages == 16
    for x, y in zip(read(same), read(unshared)):  # sharing changes no value
        assert torch.equal(x, y)


def test_bytes_fall_with_sharing():
    """8 rows of one 32-page prompt: the shared cache holds one copy of the pages, plus 8 page tables and tails.
    Measured 0.170x of the unshared bytes (16 KiB of pages, 6 KiB of tails: 8 rows x 3 fp32 tokens, 1 KiB of
    page tables, 128 B of reference counts); the bound leaves 1.3x of that."""
    torch.manual_seed(0)
    k, v = torch.randn(1, H, 32 * P + 3, D), torch.randn(1, H, 32 * P + 3, D)
    shared, unshared = cache(), cache(share=False)
    for c in (shared, unshared):
        c.update(k.repeat(8, 1, 1, 1), v.repeat(8, 1, 1, 1), 0)
    ratio = held(shared) / held(unshared)
    assert ratio < 0.22, ratio


def test_diverging_row_leaves_the_other_rows_kv_unchanged():
    """Copy-on-write: two rows share their prompt pages, then get different tokens for more than a page; each row
    reads what a cache fed only its own tokens reads, bit for bit, and the prompt pages stay shared."""
    torch.manual_seed(0)
    k, v = torch.randn(1, H, 2 * P + 5, D), torch.randn(1, H, 2 * P + 5, D)
    new_k, new_v = torch.randn(2, H, P + 6, D), torch.randn(2, H, P + 6, D)
    both = cache()
    both.update(k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1), 0)
    for i in range(P + 6):  # decode one token at a time, as generate does
        both.update(new_k[:, :, i : i + 1], new_v[:, :, i : i + 1], 0)
    for row in range(2):
        alone = cache()
        alone.update(k, v, 0)
        alone.update(new_k[row : row + 1], new_v[row : row + 1], 0)
        for x, y in zip(read(both), read(alone)):
            assert torch.equal(x[row : row + 1], y)
    assert both.page_stats().pages == 2 + 2 * 2  # 2 shared prompt pages, 2 own pages per row


def test_reorder_with_repeated_rows_shares_and_frees():
    c = filled_cache()
    before_k, before_v = read(c)
    c.reorder_cache(torch.tensor([1, 1]))  # beam search keeping only the second beam, twice
    after_k, after_v = read(c)
    assert torch.equal(after_k, before_k[[1, 1]]) and torch.equal(after_v, before_v[[1, 1]])
    s = c.page_stats()
    assert s.references == 6 and s.pages == 3 and s.free == 3
    assert c.layers[0].pool.refcount[c.layers[0].table.long()[0]].tolist() == [2, 2, 2]
    # the rows now diverge; the freed slots are reused before the pool grows
    step_k, step_v = torch.randn(2, H, P, D), torch.randn(2, H, P, D)
    c.update(step_k, step_v, 0)
    assert c.layers[0].pool.capacity == 6 and c.page_stats().pages == 5
    got_k, _ = read(c)
    assert torch.equal(got_k[0, :, : 3 * P], before_k[1, :, : 3 * P]) and not torch.equal(got_k[0], got_k[1])


def test_compact_gives_freed_pages_back():
    torch.manual_seed(0)
    c = cache()
    c.update(torch.randn(3, H, 4 * P + 1, D), torch.randn(3, H, 4 * P + 1, D), 0)
    c.batch_select_indices(torch.tensor([2, 0]))  # row 1's 4 pages are freed, their slots stay allocated
    want, before = read(c), held(c)
    c.compact()
    layer = c.layers[0]
    assert layer.pool.capacity == 8 and c.page_stats().free == 0
    assert before - held(c) == 4 * (layer.pool.record_bytes + 4)  # records and their int32 reference counts
    assert all(torch.equal(x, y) for x, y in zip(read(c), want))
    c.update(torch.randn(2, H, P, D), torch.randn(2, H, P, D), 0)  # the renumbered pool goes on working
    assert c.page_stats().pages == 10 and layer.pool.capacity == 10


def test_left_padding_never_enters_the_key_groups_of_real_tokens():
    """Row 1 has 5 padding positions, so its first page holds 5 padding and 3 real tokens in one key group; whatever
    the padding holds, the real tokens read back the same."""
    torch.manual_seed(0)
    k, v = torch.randn(2, H, 2 * P, D), torch.randn(2, H, 2 * P, D)
    mask = torch.ones(2, 2 * P, dtype=torch.long)
    mask[1, :5] = 0
    reads = []
    for pad in (100.0, -100.0):
        kp = k.clone()
        kp[1, :, :5] = pad
        c = cache(config=LlamaConfig(num_hidden_layers=1, hidden_size=4 * D, num_attention_heads=4,
                                     num_key_value_heads=H, head_dim=D, vocab_size=16))
        c.set_padding(mask)
        c.update(kp, v, 0)
        reads.append(read(c)[0][1, :, 5:])
    assert torch.equal(reads[0], reads[1])


def test_select_and_repeat_without_sharing_copy_pages():
    torch.manual_seed(0)
    for share, pages in ((True, 3), (False, 6)):
        c = cache(share=share)
        c.update(torch.randn(1, H, 3 * P, D), torch.randn(1, H, 3 * P, D), 0)
        want = read(c)
        c.batch_repeat_interleave(2)
        assert c.page_stats().pages == pages
        assert (c.layers[0].pool.refcount[c.layers[0].table.long()] == (2 if share else 1)).all()
        c.batch_select_indices(torch.tensor([1]))
        assert c.page_stats().pages == 3 and c.page_stats().free == pages - 3
        assert all(torch.equal(x, y) for x, y in zip(read(c), want))


def test_crop_into_full_pages_reopens_them():
    c = filled_cache()
    want_k, want_v = read(c)
    c.crop(-(P + 4))  # the 2 tail tokens and 10 of the paged ones: 2 pages reopened
    assert c.get_seq_length() == 2 * P - 2 and c.page_stats().pages == 1 * 2
    got_k, got_v = read(c)
    torch.testing.assert_close(got_k, want_k[:, :, : 2 * P - 2], atol=1e-3, rtol=0)  # fp32 tail of dequantized values
    torch.testing.assert_close(got_v, want_v[:, :, : 2 * P - 2], atol=1e-3, rtol=0)


# ---- options ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,match", [
    ({"page_size": 0}, "page_size must be a positive integer"),
    ({"bits": 9}, "bits must be an integer in 1..8"),
    ({"page_size": 64, "group_size": 24}, "group_size=24 must divide page_size=64"),
    ({"share": "yes"}, "share must be True or False"),
    ({"tail_dtype": "int8"}, "tail_dtype='int8' is not valid"),
    ({"pages": 4}, "unknown option"),
])
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        PagedCache(**options)


def test_group_size_must_divide_head_dim():
    c = PagedCache(page_size=16, group_size=16)
    with pytest.raises(ValueError, match="group_size=16 must divide the model's head_dim=24"):
        c.update(torch.randn(1, 1, 4, 24), torch.randn(1, 1, 4, 24), 0)
    assert not c.layers[0].is_initialized and c.get_seq_length() == 0


def test_registered_for_generate():
    assert "paged_quant" in hf_kvcache.cache_names()
    assert isinstance(hf_kvcache.build_cache("paged_quant", share=False), PagedCache)


# ---- generate on SmolLM2 ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@torch.no_grad()
def test_num_return_sequences_share_the_prompt_and_sample_what_unshared_samples(smol, moby_text):
    """4 samples of a 256-token prompt: with sharing the same sequences as without (the values read are the same),
    in fewer bytes: the prompt's pages are held once (measured 0.341x: 2.86 MB vs 8.39 MB, of which 1.84 MB of pages and
    1.01 MB of the four rows' fp16 tails of 11 tokens). One thread: identical rows then compute identical bits."""
    model, tok = smol
    ids = tok(moby_text[20000:23000], add_special_tokens=False, return_tensors="pt").input_ids[:, :256]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {}
        for share in (True, False):
            torch.manual_seed(7)
            out = model.generate(ids, do_sample=True, num_return_sequences=4, max_new_tokens=12, min_new_tokens=12,
                                 cache_implementation="paged_quant", cache_config={"share": share},
                                 return_dict_in_generate=True)
            runs[share] = (out.sequences, out.past_key_values.memory_stats())
    finally:
        torch.set_num_threads(threads)
    (seq_s, mem_s), (seq_u, mem_u) = runs[True], runs[False]
    assert torch.equal(seq_s, seq_u)
    assert len({tuple(s.tolist()) for s in seq_s[:, 256:]}) > 1  # the samples differ: rows really diverged
    layers = model.config.num_hidden_layers
    assert mem_s["page_refs"] == mem_u["page_refs"] == 4 * 4 * layers  # 256 + 11 tokens: 4 pages per row
    assert mem_s["pages"] == 4 * layers and mem_u["pages"] == 16 * layers
    assert mem_s["bytes"] < 0.45 * mem_u["bytes"], (mem_s, mem_u)
