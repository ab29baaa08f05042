"""The contract every eviction policy keeps, as functions of a policy (and a tiny random Llama): run by
`test_policy_contract.py` for every registered policy, and by any test that adds a policy of its own.

A policy keeps it when, through `H2OCache` and the `"hf_kvcache"` attention:
- after a left-padded prefill and after every decode step, each layer holds exactly its budget, padding goes first,
  and the next step equals dense attention over exactly the kept (dequantized) keys and values;
- every head holds its own real tokens: distinct positions in order, the model's keys at those positions;
- `evict_to(..., protect_last=k)` keeps the k newest tokens in every row and head, and stays exact;
- beam reorder, repetition and selection move each row's storage (and queries) with the row;
- a crop before any eviction leaves the cache that never saw the cropped tokens, also once it evicts;
- it composes with every wrapper that applies to it (`SharedHeads`, `Pyramid`, `AdaKV`, `Merge`, `Pooled`);
- its options survive `to_dict` / JSON, and the flat `cache_config` form builds the same policy.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

import hf_kvcache  # noqa: F401  (registers the cache names and the attention)
from hf_kvcache import H2OCache
from hf_kvcache.caches.evict import EvictOptions
from hf_kvcache.policy import POLICIES, AdaKV, EvictionPolicy, Merge, Pooled, Pyramid, SharedHeads, policy_from_dict
from models import eviction_llama

B, H, G, D, LAYERS = 2, 2, 2, 16, 2


def tiny_model() -> LlamaForCausalLM:
    """A random tiny Llama (`models.eviction_config`: GQA, 2 KV heads of 2 query heads each) on the `"hf_kvcache"`
    attention."""
    return eviction_llama("hf_kvcache")


def _padded(seed: int, n: int = 30, pad: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids) `[B, n]`: row 1 left-padded by `pad`."""
    ids = torch.randint(0, 97, (B, n), generator=torch.Generator().manual_seed(seed))
    am = torch.ones(B, n, dtype=torch.long)
    am[1, :pad] = 0
    return ids, am, (am.cumsum(-1) - 1).clamp(min=0)


def _dense_of(model, cache) -> DynamicCache:
    """A DynamicCache holding exactly what every layer of `cache` holds (dequantized)."""
    dense = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        dense.update(*(t.clone() for t in layer.held_keys_values()), i)
    return dense


@torch.inference_mode()
def check_decode_equals_dense_over_kept(model, policy: EvictionPolicy, **cache_options) -> None:
    """Left-padded batch: after a prefill and after every decode step (each evicting one token), the next step
    through H2OCache equals a DynamicCache holding exactly the kept (dequantized) keys / values."""
    ids, am, positions = _padded(1)
    cache = H2OCache(config=model.config, budget=9, policy=policy, **cache_options)
    model(ids[:, :24], attention_mask=am[:, :24], past_key_values=cache, position_ids=positions[:, :24])
    for t in range(24, 30):
        assert cache.tokens_held() == 9 and cache.get_seq_length() == t
        dense = _dense_of(model, cache)
        valid = cache.layers[0].held_valid()[:, 0].long()
        step = slice(t, t + 1)
        out = model(ids[:, step], attention_mask=am[:, : t + 1], past_key_values=cache,
                    position_ids=positions[:, step]).logits
        ref = model(ids[:, step], attention_mask=torch.cat([valid, am[:, step]], 1), past_key_values=dense,
                    position_ids=positions[:, step]).logits
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert cache.layers[0].held_valid()[1].all()  # padding went first


@torch.inference_mode()
def check_heads_hold_their_own_real_tokens(model, policy: EvictionPolicy) -> None:
    """Every head holds distinct positions in increasing order, and (first layer, plain storage) the model's keys
    and values at those positions."""
    ids, am, positions = _padded(2)
    cache = H2OCache(config=model.config, budget=10, policy=policy)
    model(ids, attention_mask=am, past_key_values=cache, position_ids=positions)
    dense = DynamicCache(config=model.config)
    model(ids, attention_mask=am, past_key_values=dense, position_ids=positions)
    for layer in cache.layers:
        pos = layer.held_positions()
        assert pos.shape == (B, H, 10) and (pos[..., 1:] > pos[..., :-1]).all()
    pos = cache.layers[0].held_positions()
    keys, values = cache.layers[0].held_keys_values()
    index = pos[..., None].expand(-1, -1, -1, D)
    assert torch.equal(keys, dense.layers[0].keys.gather(2, index))
    assert torch.equal(values, dense.layers[0].values.gather(2, index))


@torch.inference_mode()
def check_evict_to_protects_the_newest(model, policy: EvictionPolicy) -> None:
    """`evict_to(12, protect_last=5)` after a prefill that evicted nothing: 12 tokens per head, the 5 newest among
    them in every row and head, and the next forward equals dense attention over the kept tokens."""
    ids = torch.randint(0, 97, (B, 31), generator=torch.Generator().manual_seed(3))
    cache = H2OCache(config=model.config, budget=1.0, policy=policy)
    model(ids[:, :30], past_key_values=cache)
    assert cache.tokens_held() == 30
    cache.evict_to(12, protect_last=5)
    for layer in cache.layers:
        pos = layer.held_positions()
        assert (layer.held_valid().sum(-1) == 12).all()
        assert all((pos == p).any(-1).all() for p in range(25, 30))
    dense = _dense_of(model, cache)
    pos_ids = torch.full((B, 1), 30)
    out = model(ids[:, 30:], past_key_values=cache, position_ids=pos_ids).logits
    ref = model(ids[:, 30:], attention_mask=torch.ones(B, 13, dtype=torch.long), past_key_values=dense,
                position_ids=pos_ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@torch.inference_mode()
def check_batch_operations_move_rows(model, policy: EvictionPolicy) -> None:
    """Rows swapped (`reorder_cache`), or repeated then selected, give the swapped rows' next logits."""
    ids = torch.randint(0, 97, (B, 26), generator=torch.Generator().manual_seed(4))
    cache = H2OCache(config=model.config, budget=12, policy=policy)
    model(ids[:, :25], past_key_values=cache)
    want = model(ids[:, 25:], past_key_values=copy.deepcopy(cache)).logits
    swapped = copy.deepcopy(cache)
    swapped.reorder_cache(torch.tensor([1, 0]))
    torch.testing.assert_close(model(ids[:, 25:].flip(0), past_key_values=swapped).logits, want.flip(0),
                               atol=1e-5, rtol=0)
    again = copy.deepcopy(cache)
    again.batch_repeat_interleave(2)
    again.batch_select_indices(torch.tensor([3, 0]))
    torch.testing.assert_close(model(ids[:, 25:].flip(0), past_key_values=again).logits, want.flip(0),
                               atol=1e-5, rtol=0)


@torch.inference_mode()
def check_crop_before_eviction(model, policy: EvictionPolicy) -> None:
    """A forward of 5 tokens cropped by 3 before anything was evicted leaves the cache a forward of the 2 kept
    tokens leaves: the same scores, then the same evictions and logits once the budget is reached."""
    ids = torch.randint(0, 97, (B, 30), generator=torch.Generator().manual_seed(5))
    cache = H2OCache(config=model.config, budget=16, policy=policy)
    model(ids[:, :10], past_key_values=cache)
    never = copy.deepcopy(cache)
    model(ids[:, 10:15], past_key_values=cache)
    cache.crop(-3)
    model(ids[:, 10:12], past_key_values=never)
    assert cache.get_seq_length() == never.get_seq_length() == 12
    if never.layers[0].held_scores() is not None:
        for a, b in zip(cache.layers, never.layers):
            torch.testing.assert_close(a.held_scores(), b.held_scores(), atol=1e-5, rtol=0)
    for start, end in ((12, 13), (13, 20), (20, 21)):  # the budget is reached at 17 tokens
        got = model(ids[:, start:end], past_key_values=cache).logits
        want = model(ids[:, start:end], past_key_values=never).logits
        for a, b in zip(cache.layers, never.layers):
            assert torch.equal(a.held_positions(), b.held_positions())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert cache.layers[0].evicted() > 0


@torch.inference_mode()
def check_wrappers_compose(model, policy: EvictionPolicy) -> None:
    """`SharedHeads`: one token set per layer; `Pyramid(0.5)`: 12 and 4 tokens in the two layers for a budget of 8;
    `AdaKV` (policies ranking by attention): the layer's budget shared by its heads, stored compactly; `Merge`
    (policies reading a query window): evicted tokens folded into kept slots (log weights grow); `Pooled`: the
    budget kept, alone and (policies ranking by attention) inside `AdaKV`."""
    ids = torch.randint(0, 97, (B, 40), generator=torch.Generator().manual_seed(6))

    def run(wrapped: EvictionPolicy, budget: int = 8) -> H2OCache:
        cache = H2OCache(config=model.config, budget=budget, policy=wrapped)
        model(ids[:, :30], past_key_values=cache)
        out = model(ids[:, 30:], past_key_values=cache).logits
        assert torch.isfinite(out).all()
        return cache

    for layer in run(SharedHeads(policy)).layers:
        pos = layer.held_positions()
        assert pos.shape[-1] == 8 and (pos == pos[:, :1]).all()
    assert [layer.tokens_held() for layer in run(Pyramid(policy, 0.5)).layers] == [12, 4]
    assert [layer.tokens_held() for layer in run(Pooled(policy, 3)).layers] == [8, 8]
    if policy.ranks_by_attention and not policy.by_output_error:
        for cache in (run(AdaKV(policy)), run(AdaKV(Pooled(policy, 5, "avg")))):
            assert all(layer.counts.sum(-1).tolist() == [8 * H] * B for layer in cache.layers)
    if policy.query_window() > 0:
        cache = run(Merge(policy, "mass", similarity=-1.0), budget=24)  # any kept key may take an evicted one
        assert all(bool((layer.slots.log_weight > 0).any()) for layer in cache.layers)


def check_options_round_trip(policy: EvictionPolicy) -> None:
    """`to_dict` / JSON / the flat `cache_config` form rebuild the policy; options it does not declare are refused
    with a ValueError."""
    spec = policy.to_dict()
    assert policy_from_dict(json.loads(json.dumps(spec))) == policy
    opts = EvictOptions(budget=8, policy=policy)
    assert EvictOptions.from_json(opts.to_json()) == opts
    flat = {"budget": 8, "policy": policy.name, **{k: v for k, v in spec.items() if k != "name"}}
    assert EvictOptions.from_dict(flat).policy == policy
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['no_such_option'\]"):
        EvictOptions.from_dict({"policy": policy.name, "no_such_option": 1})
    foreign = sorted({o for p in POLICIES.values() for o in p.option_names()} - set(type(policy).option_names()))
    if foreign:
        with pytest.raises(ValueError, match=f"{foreign[0]} applies to the .*, not '{policy.name}'"):
            EvictOptions.from_dict({"policy": policy.name, foreign[0]: 1})


MODEL_CHECKS = [check_decode_equals_dense_over_kept, check_heads_hold_their_own_real_tokens,
                check_evict_to_protects_the_newest, check_batch_operations_move_rows, check_crop_before_eviction,
                check_wrappers_compose]
