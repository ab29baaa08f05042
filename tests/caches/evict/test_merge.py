"""Merging evicted tokens into kept ones (`policy.wrappers.Merge`, `hf_kvcache.caches.evict.merge`)."""

import math

import pytest
import torch
from transformers import DynamicCache

import hf_kvcache  # noqa: F401  (registers the cache names and the attention)
from hf_kvcache import H2OCache
from hf_kvcache.caches.h2o import H2OOptions
from hf_kvcache.caches.evict.merge import fold_evicted
from models import eviction_llama


def _attend(q, k, v, log_weight, held):
    """Softmax attention `[b, h, n, d]` of queries `q` over the `held` slots, each slot's logit raised by its log
    weight."""
    logits = q @ k.transpose(-1, -2) + log_weight[:, :, None, :]
    return torch.softmax(logits.masked_fill(~held[:, :, None, :], -math.inf), -1) @ v


def _case(seed=0, b=2, h=2, slots=7, d=8, queries=5):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, h, slots, d, generator=g), torch.randn(b, h, slots, d, generator=g)
    q = torch.randn(b, h, queries, d, generator=g)
    return k, v, q


def _fold(logits, k, keep, v, log_weight, similarity):
    """`fold_evicted` with the slots at positions 0.. and the queries after all of them (each sees every slot)."""
    b, h, q, slots = logits.shape
    positions = torch.arange(slots).expand(b, h, slots)
    return fold_evicted(logits, torch.arange(slots, slots + q), positions, k, keep, ~keep, v, log_weight, similarity)


def test_mass_mode_is_exact_for_a_duplicate_key():
    """A token whose key equals a kept one is folded into it without changing any later attention output."""
    k, v, q = _case()
    k[:, :, 4] = k[:, :, 1]  # slot 4 duplicates slot 1's key
    keep = torch.ones(k.shape[:3], dtype=torch.bool)
    keep[:, :, 4] = False
    log_weight = torch.zeros(k.shape[:3])
    values, grown = _fold(q @ k.transpose(-1, -2), k, keep, v, log_weight, similarity=0.5)
    later = torch.randn(2, 2, 3, 8, generator=torch.Generator().manual_seed(9))
    before = _attend(later, k, v, torch.zeros_like(log_weight), torch.ones_like(keep))
    after = _attend(later, k, values, grown, keep)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    torch.testing.assert_close(grown[:, :, 1], torch.full((2, 2), math.log(2.0)))
    assert torch.equal(grown[:, :, [0, 2, 3, 5, 6]], torch.zeros(2, 2, 5))


def test_value_mode_averages_by_attention_and_leaves_logits():
    k, v, q = _case(1)
    k[:, :, 4] = 2.0 * k[:, :, 1]  # same direction (cosine 1), other norm
    keep = torch.ones(k.shape[:3], dtype=torch.bool)
    keep[:, :, 4] = False
    logits = q @ k.transpose(-1, -2)
    values, weight = _fold(logits, k, keep, v, None, similarity=0.9)
    assert weight is None
    mass = torch.softmax(logits, -1).sum(2)
    a_j, a_e = mass[:, :, 1, None], mass[:, :, 4, None]
    torch.testing.assert_close(values[:, :, 1], (a_j * v[:, :, 1] + a_e * v[:, :, 4]) / (a_j + a_e))
    assert torch.equal(values[:, :, [0, 2, 3, 5, 6]], v[:, :, [0, 2, 3, 5, 6]])


def test_dissimilar_or_barely_seen_tokens_are_dropped_unchanged():
    k, v, q = _case(2)
    keep = torch.ones(k.shape[:3], dtype=torch.bool)
    keep[:, :, 3] = False
    logits = q @ k.transpose(-1, -2)
    # no kept key reaches a cosine of 1: nothing is folded
    values, weight = _fold(logits, k, keep, v, torch.zeros(k.shape[:3]), similarity=1.0 + 1e-6)
    assert torch.equal(values, v) and torch.equal(weight, torch.zeros(k.shape[:3]))
    # the evicted token seen by a single query (one of the newest): dropped even with a duplicate kept
    k[:, :, 3] = k[:, :, 0]
    logits = (q @ k.transpose(-1, -2))
    logits[:, :, 1:, 3] = -math.inf
    values, _ = _fold(logits, k, keep, v, None, similarity=0.5)
    assert torch.equal(values, v)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(policy="knorm", merge="value"), "merge folds evicted tokens .* tova / snapkv / expected"),
        (dict(policy="tova", merge_similarity=0.5), "merge_similarity applies when merge is set"),
        (dict(policy="tova", merge="yes"), r"merge='yes' is not valid; choose one of \['value', 'mass'\]"),
        (dict(policy="tova", merge="value", merge_similarity=2.0), r"merge_similarity must be a number in"),
    ],
)
def test_bad_merge_options(options, match):
    with pytest.raises(ValueError, match=match):
        H2OOptions(**options).validate()


@pytest.fixture(scope="module")
def tiny_model():
    return eviction_llama()


@pytest.mark.parametrize("padded", [False, True])
def test_weighted_slot_attends_as_that_many_copies(tiny_model, padded):
    """Through a real model (masks, RoPE positions, left padding): a held slot with `log_weight = log 2` gives the
    next chunk the logits a DynamicCache gives when it holds that slot twice."""
    model = tiny_model
    model.set_attn_implementation("hf_kvcache")
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 30, dtype=torch.long)
    if padded:
        am[1, :5] = 0
    positions = (am.cumsum(-1) - 1).clamp(min=0)
    cache = H2OCache(config=model.config, budget=10, policy="tova", merge="mass")
    with torch.inference_mode():
        model(ids[:, :24], attention_mask=am[:, :24], past_key_values=cache, position_ids=positions[:, :24])
        dense = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.layers):
            layer.slots.log_weight.zero_()
            layer.slots.log_weight[:, :, 6] = math.log(2.0)  # slot 6 (a real token in both rows) stands for 2
            k, v = layer.held_keys_values()
            dense.update(torch.cat([k, k[:, :, 6:7]], 2), torch.cat([v, v[:, :, 6:7]], 2), i)
        valid = cache.layers[0].held_valid()[:, 0].long()
        out = model(ids[:, 24:], attention_mask=am, past_key_values=cache, position_ids=positions[:, 24:]).logits
        ref_mask = torch.cat([valid, valid[:, 6:7], am[:, 24:]], 1)
        ref = model(ids[:, 24:], attention_mask=ref_mask, past_key_values=dense, position_ids=positions[:, 24:]).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["value", "mass"])
@pytest.mark.parametrize("head_budgets", [False, True])
def test_merge_streams_batches_and_counts_its_weights(tiny_model, mode, head_budgets):
    """Batch 2 with left padding through generate-style chunks and decoding steps: the budget holds, the values of
    kept slots change (something was folded), `memory_stats` counts the log weights ('mass' only)."""
    model = tiny_model
    model.set_attn_implementation("hf_kvcache")
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    am = torch.ones(2, 40, dtype=torch.long)
    am[1, :6] = 0
    caches = {m: H2OCache(config=model.config, budget=12, policy="expected", merge=m, head_budgets=head_budgets)
              for m in (None, mode)}
    with torch.inference_mode():
        for cache in caches.values():
            for s in range(0, 40, 8):
                model(ids[:, s:s + 8], attention_mask=am[:, :s + 8], past_key_values=cache)
    plain, merged = caches[None], caches[mode]
    assert merged.tokens_held() <= 12 * (2 if head_budgets else 1) and merged.get_seq_length() == 40
    assert not torch.equal(merged.layers[0].held_keys_values()[1], plain.layers[0].held_keys_values()[1])
    weights = [layer.slots.log_weight for layer in merged.layers]
    if mode == "mass":
        assert all(w is not None and bool((w > 0).any()) for w in weights)
        extra = sum(w.nbytes for w in weights)
        assert merged.memory_stats()["bytes"] - plain.memory_stats()["bytes"] == extra
    else:
        assert all(w is None for w in weights)
        assert merged.memory_stats()["bytes"] == plain.memory_stats()["bytes"]


@pytest.mark.parametrize("twin,folded", [(1, True), (5, False)])
def test_target_must_be_seen_by_every_query_that_sees_the_evicted_token(twin, folded):
    """Queries at positions 3..7 see the slots up to their own position. Evicted slot 2 is seen by all five; a twin
    key at position 1 is seen by each of them (folded), one at position 5 only by the last three (not a target)."""
    k, v, q = _case(3)
    k[:, :, twin] = k[:, :, 2]
    keep = torch.ones(k.shape[:3], dtype=torch.bool)
    keep[:, :, 2] = False
    slots = k.shape[2]
    query_positions = torch.arange(3, 8)
    positions = torch.arange(slots).expand(*k.shape[:3])
    logits = (q @ k.transpose(-1, -2)).masked_fill(positions[:, :, None, :] > query_positions[:, None], -math.inf)
    values, _ = fold_evicted(logits, query_positions, positions, k, keep, ~keep, v, None, similarity=0.999)
    assert torch.equal(values[:, :, twin], v[:, :, twin]) != folded
    others = [i for i in range(slots) if i != twin]
    assert torch.equal(values[:, :, others], v[:, :, others])


def test_merge_with_quantized_storage_requantizes_only_the_folded_slots(tiny_model):
    """`quant_bits=4`: the slots a fold changed hold the 4-bit codes of their merged values; every other kept slot keeps
    the codes it had (compared with the same eviction run without merge, whose slots are the same before the first
    fold changes a priority: one eviction here)."""
    model = tiny_model
    model.set_attn_implementation("hf_kvcache")
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(5))
    caches = {None: H2OCache(config=model.config, budget=16, policy="tova", quant_bits=4),
              "value": H2OCache(config=model.config, budget=16, policy="tova", quant_bits=4, merge="value",
                                merge_similarity=0.0)}
    with torch.inference_mode():
        for cache in caches.values():
            model(ids, past_key_values=cache)
    plain, merged = (caches[m].layers[0].slots for m in (None, "value"))
    assert torch.equal(plain.positions, merged.positions)
    same = (plain.values.codes == merged.values.codes).all(-1) & (plain.values.scale == merged.values.scale).all(-1)
    assert 0 < int((~same).sum()) < same.numel()  # some slots were folded into, not all
    assert torch.equal(plain.keys.codes, merged.keys.codes)
