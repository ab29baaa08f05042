"""H2OCache: eviction policies, per-head selection, positions and masks after eviction, padding, beams, crop."""

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

import hf_kvcache  # noqa: F401  (registers the cache names)
from attention_driver import drive
from hf_kvcache import H2OCache
from hf_kvcache.caches.h2o import EvictOptions, H2OOptions
from hf_kvcache.policy import POLICIES, AdaKV, H2OPolicy, HybridPolicy, SlotView, SnapKVPolicy
from models import eviction_config as tiny_config
from models import eviction_llama
from policy_contract import check_crop_before_eviction

B, H, D, LAYERS = 2, 2, 16, 2


def step(cache, n, mass=None, visible=None, seed=0):
    """`n` random tokens through every layer (`attention_driver.drive`); returns their keys and values."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
    drive(cache, k, v, mass=mass, visible=visible, layers=LAYERS)
    return k, v


def kept_positions(cache, layer=0):
    return cache.layers[layer].held_positions()


# ---- options ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,match",
    [
        (dict(policy="lru"), "policy='lru' is not valid"),
        (dict(budget=0), "at least 2 tokens"),
        (dict(budget=1), r"budget=1 keeps a single token; for all tokens use budget=1.0"),
        (dict(budget=1.5), r"ratio of the tokens seen, in \(0, 1\]"),
        (dict(budget="10"), "budget must be an int"),
        (dict(recent_ratio=0.5, heavy_ratio=0.5), "give at most one of"),
        (dict(policy="recent", recent_length=8), "recent_length applies to the .* policies, not 'recent'"),
        (dict(policy="strided", heavy_ratio=0.5), "heavy_ratio applies to the h2o / tova / .* policies, not 'strided'"),
        (dict(policy="h2o", sink_length=4), "sink_length applies to the sinks / hybrid / expected / reconstruct policies"),
        (dict(recent_ratio=2.0), r"recent_ratio must be a number in \[0, 1\]"),
        (dict(bogus=1), r"unknown option\(s\) \['bogus'\]"),
        (dict(evict_every=0), "evict_every must be"),
        (dict(evict_every=4, head_budgets=True, policy="tova"), "evict_every applies to uniform budgets"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        H2OCache(config=tiny_config(), **options)


def test_budget_int_or_ratio_and_split():
    assert H2OOptions(budget=10).budget_for(1000) == 10
    assert H2OOptions(budget=0.2).budget_for(2048) == 410 and H2OOptions(budget=0.2).budget_for(3) == 1
    assert H2OOptions(budget=0.25).budget_for(100) == 25
    assert H2OOptions(recent_length=3).policy.split(10) == (0, 3) == H2OPolicy(recent_length=3).split(10)
    assert H2OOptions(heavy_ratio=0.3).policy.split(10) == (0, 7)
    assert H2OOptions(policy="hybrid", sink_length=2).policy.split(10) == (2, 4)
    assert H2OOptions(policy="sinks").policy.split(10) == (4, 6)
    opts = H2OOptions(policy="snapkv", window=8, head_budgets=True, quant_bits=4)
    assert EvictOptions.from_json(opts.to_json()) == opts and opts.policy == AdaKV(SnapKVPolicy(window=8))


# ---- eviction -----------------------------------------------------------------------------------------------------
def test_evicts_to_budget_and_counts_tokens_seen():
    cache = H2OCache(config=tiny_config(), budget=10)
    step(cache, 7)
    assert cache.tokens_held() == 7 and cache.get_seq_length() == 7
    step(cache, 6, seed=1)
    assert cache.tokens_held() == 10 and cache.get_seq_length() == 13
    assert cache.get_mask_sizes(3, 0) == (13, 3)  # held + query, and the held slots sit right before the queries
    per_slot = 2 * D * 4 + 4 + 4 + 1  # fp32 keys + values, score, position, valid flag
    assert cache.memory_stats()["bytes"] == LAYERS * B * H * 10 * per_slot


def test_each_kv_head_keeps_its_own_heavy_hitters():
    cache = H2OCache(config=tiny_config(), budget=4, recent_length=1)

    def mass(n):
        m = torch.zeros(B, H, n)
        m[:, 0, [1, 3, 5]] = 5.0  # head 0 attends to tokens 1, 3, 5
        m[:, 1, [0, 2, 6]] = 5.0  # head 1 to tokens 0, 2, 6
        return m

    k, v = step(cache, 10, mass=mass)
    pos = kept_positions(cache)
    assert pos[0, 0].tolist() == [1, 3, 5, 9] and pos[0, 1].tolist() == [0, 2, 6, 9]
    layer = cache.layers[1]
    for h in range(H):  # the stored keys/values are the tokens at those positions, for that head
        idx = pos[1, h]
        keys, values = layer.held_keys_values()
        assert torch.equal(keys[1, h], k[1, h, idx])
        assert torch.equal(values[1, h], v[1, h, idx])


def test_update_hands_over_plain_storage_without_a_copy():
    """Unquantized slots are returned as stored (held, then new); with gradients wanted, a copy that reaches the new
    tokens."""
    cache = H2OCache(config=tiny_config(), budget=10)
    step(cache, 12)
    layer = cache.layers[0]
    held_k, held_v = layer.held_keys_values()
    k, v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    keys, values = cache.update(k, v, 0)
    assert keys is layer.slots.keys and values is layer.slots.values
    assert torch.equal(keys, torch.cat([held_k, k], 2)) and torch.equal(values, torch.cat([held_v, v], 2))
    layer.observe_attention(torch.zeros(B, H, keys.shape[2]))
    kg = torch.randn(B, H, 1, D, requires_grad=True)
    keys, _ = cache.update(kg, v, 1)
    assert keys is not cache.layers[1].slots.keys
    keys[:, :, -1].sum().backward()
    assert torch.equal(kg.grad, torch.ones_like(kg))
    quantized = H2OCache(config=tiny_config(), budget=10, quant_bits=8, key_quant="token")
    step(quantized, 12)
    held_k, _ = quantized.layers[0].held_keys_values()
    keys, _ = quantized.update(k, v, 0)  # codes: the held keys decoded into a copy, the new ones as given
    assert torch.equal(keys, torch.cat([held_k, k], 2))



@pytest.mark.parametrize("key_quant", ["token", "prerope"])
def test_quantized_keys_are_decoded_once_per_step(key_quant):
    """The eviction of a step reads the held keys its attention decoded, with only the new tokens decoded on top:
    the same keys as a decoding of every slot; held (and counted) only until the step has evicted."""
    cache = H2OCache(config=tiny_config(), budget=10, quant_bits=4, key_quant=key_quant, policy="knorm")
    step(cache, 12)
    layer = cache.layers[0]
    k, v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    cache.update(k, v, 0)
    memo = layer._decoded_keys
    assert memo.codes is layer.slots.keys and memo.tail is not None  # the held part decoded, the new token not yet
    keys = layer.held_keys()
    assert memo.tail is None and layer.held_keys() is keys and any(t is keys for t in layer.held_tensors())
    layer._decoded_keys = None
    assert torch.equal(layer.held_keys(), keys)  # every slot decoded afresh: bit for bit the same
    layer.observe_visible_keys(None)
    layer.observe_attention(torch.zeros(B, H, keys.shape[2]))
    assert layer._decoded_keys is None and not any(t is keys for t in layer.held_tensors())


def test_evict_every_waits_for_that_many_tokens_over_the_budget():
    """Single-token steps: the layer grows to budget + n - 1, then drops back to the budget; memory counts it."""
    every = H2OCache(config=tiny_config(), budget=10, evict_every=4)
    each = H2OCache(config=tiny_config(), budget=10)
    step(every, 10), step(each, 10)
    held = []
    for i in range(9):
        step(every, 1, seed=i + 1), step(each, 1, seed=i + 1)
        held.append(every.tokens_held())
        assert each.tokens_held() == 10
    assert held == [11, 12, 13, 10, 11, 12, 13, 10, 11]
    per_slot = 2 * D * 4 + 4 + 4 + 1  # fp32 keys + values, score, position, valid flag
    assert every.memory_stats()["bytes"] == LAYERS * B * H * 11 * per_slot
    assert every.get_seq_length() == each.get_seq_length() == 19
    every.evict_to(8)  # an explicit eviction does not wait
    assert every.tokens_held() == 8


def test_scores_accumulate_across_steps():
    cache = H2OCache(config=tiny_config(), budget=3, recent_length=0)
    step(cache, 3, mass=lambda n: torch.tensor([1.0, 0.0, 0.5]).expand(B, H, n).clone())
    step(cache, 1, mass=lambda n: torch.tensor([0.0, 0.6, 0.0, 0.2]).expand(B, H, n).clone())
    # totals: pos0 1.0, pos1 0.6, pos2 0.5, pos3 0.2 -> keep 0, 1, 2
    assert kept_positions(cache)[0, 0].tolist() == [0, 1, 2]
    assert torch.allclose(cache.layers[0].held_scores()[0, 0], torch.tensor([1.0, 0.6, 0.5]))


@pytest.mark.parametrize(
    "policy,options,expected",
    [
        ("recent", {}, [12, 13, 14, 15, 16, 17, 18, 19]),
        ("sinks", {"sink_length": 2}, [0, 1, 14, 15, 16, 17, 18, 19]),
        ("strided", {"recent_length": 4}, [0, 4, 8, 12, 16, 17, 18, 19]),
        ("h2o", {"recent_length": 4}, [3, 7, 10, 11, 16, 17, 18, 19]),
        ("hybrid", {"sink_length": 1, "recent_length": 4}, [0, 7, 10, 11, 16, 17, 18, 19]),
    ],
)
def test_policies(policy, options, expected):
    cache = H2OCache(config=tiny_config(), budget=8, policy=policy, **options)
    scores = torch.zeros(20)
    scores[[3, 7, 10, 11]] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    step(cache, 20, mass=lambda n: scores.expand(B, H, n).clone())
    assert kept_positions(cache)[1, 1].tolist() == expected


def test_all_policies_registered_and_overridable():
    assert set(POLICIES) == {"h2o", "tova", "snapkv", "expected", "knorm", "recent", "sinks", "strided", "hybrid",
                             "reconstruct"}

    class Odd(POLICIES["recent"]):
        def priority(self, view: SlotView, budget: int):
            return (view.positions % 2).float()

    view = SlotView(torch.zeros(1, 1, 6), torch.arange(6)[None, None], torch.ones(1, 1, 6, dtype=torch.bool))
    assert Odd().select(view, 3).tolist() == [[[1, 3, 5]]]


def test_padding_is_evicted_first_and_never_a_sink():
    cache = H2OCache(config=tiny_config(), budget=5, policy="hybrid", sink_length=2, recent_length=2)
    visible = torch.ones(B, 8, dtype=torch.bool)
    visible[1, :3] = False  # row 1 is left-padded by 3
    scores = torch.zeros(8)
    scores[[0, 1, 2]] = 9.0  # even if padding got mass, it would not count
    step(cache, 8, mass=lambda n: scores.expand(B, H, n).clone(), visible=visible)
    pos = kept_positions(cache)
    assert pos[0, 0].tolist() == [0, 1, 2, 6, 7]
    assert pos[1, 0].tolist()[:2] == [3, 4] and pos[1, 0].tolist()[-2:] == [6, 7]  # sinks are the first real tokens
    assert cache.layers[0].held_valid().all()
    # a budget larger than the real tokens keeps all of them, padding first, still flagged
    cache = H2OCache(config=tiny_config(), budget=6, policy="recent")
    step(cache, 8, visible=visible)
    assert kept_positions(cache)[1, 0].tolist()[1:] == [3, 4, 5, 6, 7]
    assert cache.layers[0].held_valid()[1, 0].tolist() == [False] + [True] * 5


def test_mask_after_eviction_is_causal_over_held_and_new():
    """transformers' own mask builder, with the sizes the cache reports, after eviction (and with left padding)."""
    config = tiny_config()
    config._attn_implementation = "hf_kvcache"
    cache = H2OCache(config=config, budget=6, policy="recent")
    visible = torch.ones(B, 8, dtype=torch.bool)
    visible[1, :5] = False  # row 1: 5 padding + 3 real tokens -> keeps 3 padding slots in front
    step(cache, 8, visible=visible)
    q = 3
    padding_2d = torch.cat([visible, torch.ones(B, q, dtype=torch.bool)], 1).long()
    mask = create_causal_mask(config, torch.zeros(B, q, 64), padding_2d, cache, position_ids=torch.arange(8, 11)[None])
    held = cache.tokens_held()
    assert mask.shape == (B, 1, q, held + q)
    new = torch.ones(q, q, dtype=torch.bool).tril()
    assert mask[0, 0, :, :held].all() and torch.equal(mask[0, 0, :, held:], new)
    assert torch.equal(mask[1, 0, :, :held], torch.tensor([[False] * 3 + [True] * 3] * q))
    assert torch.equal(mask[1, 0, :, held:], new)
    valid = cache.layers[0].held_valid()[1]
    assert torch.equal(mask[1, 0, 0, :held], valid[0]) and torch.equal(valid[0], valid[1])


def test_missing_attention_mass_raises():
    cache = H2OCache(config=tiny_config(), budget=4)
    k = torch.randn(B, H, 3, D)
    cache.update(k, k, 0)
    with pytest.raises(RuntimeError, match="attn_implementation='hf_kvcache'"):
        cache.update(k, k, 0)


# ---- a tiny random Llama --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    return eviction_llama()


def test_eager_model_gets_a_clear_error(tiny_model):
    """Eager attention is each model's own function, outside the registry the plain-loop service wraps."""
    model = tiny_model
    model.set_attn_implementation("eager")
    try:
        cache = H2OCache(config=model.config, budget=4)
        ids = torch.randint(0, 97, (1, 6))
        with torch.inference_mode():
            model(ids, past_key_values=cache)
            with pytest.raises(RuntimeError, match="only the 'hf_kvcache' attention reports"):
                model(ids[:, :1], past_key_values=cache)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("policy,mass", [(H2OPolicy(), True), (SnapKVPolicy(window=8), False),
                                         (AdaKV(SnapKVPolicy(window=8)), False), ("reconstruct", False)],
                         ids=["h2o", "snapkv", "snapkv-head-budgets", "reconstruct"])
def test_only_mass_policies_ask_the_attention_for_the_mass(tiny_model, monkeypatch, policy, mass):
    """A policy that does not rank by the attention mass gets the padding flags without it: its forwards stay on
    torch SDPA (the blockwise kernel, which sums the mass, never runs), padding is still marked, and before anything
    is evicted the logits are a DynamicCache's."""
    from hf_kvcache.attention import BlockwiseTorchKernel

    calls = []
    blockwise = BlockwiseTorchKernel.__call__
    monkeypatch.setattr(BlockwiseTorchKernel, "__call__", lambda self, call: calls.append(1) or blockwise(self, call))
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    cache = H2OCache(config=tiny_model.config, budget=1.0, policy=policy)
    with torch.inference_mode():
        out = tiny_model(ids, attention_mask=mask, past_key_values=cache).logits
        ref = tiny_model(ids, attention_mask=mask, past_key_values=DynamicCache(config=tiny_model.config)).logits
    assert cache.layers[0].wants_attention_mass is mass and bool(calls) is mass
    assert torch.equal(cache.layers[0].held_valid()[:, 0], mask.bool())  # the padding flags arrived either way
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)


# ---- crop before eviction ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "policy",
    [H2OPolicy(decay=0.8), HybridPolicy(sink_length=2), AdaKV(H2OPolicy()), SnapKVPolicy(window=8)],
    ids=["h2o-decay", "hybrid-sinks2", "head-budgets", "snapkv-w8"],
)
def test_crop_leaves_the_cache_that_never_saw_the_cropped_tokens(tiny_model, policy):
    """The contract's crop check (`policy_contract`) beyond each policy's defaults: with decay the mass of the kept
    queries of the cut forward is recomputed too; ragged heads are expanded and compacted again. The queries kept
    for crop go with the first eviction (window policies keep theirs)."""
    tiny_model.set_attn_implementation("hf_kvcache")
    check_crop_before_eviction(tiny_model, policy)
    cache = H2OCache(config=tiny_model.config, budget=4, policy=policy)
    with torch.inference_mode():
        tiny_model(torch.randint(0, 97, (B, 12), generator=torch.Generator().manual_seed(2)), past_key_values=cache)
    layer = cache.layers[0]
    assert layer.evicted() > 0 and (layer.ring is None) == (layer.window == 0)


def test_crop_keeps_queries_only_while_it_can_be_needed(tiny_model):
    """The queries kept for crop count in memory_stats, go with the first eviction, and are never kept when the
    budget never evicts (budget=1.0) or by policies that accumulate no mass."""
    model = tiny_model
    model.set_attn_implementation("hf_kvcache")
    ids = torch.randint(0, 97, (B, 12), generator=torch.Generator().manual_seed(3))
    caches = {name: H2OCache(config=model.config, **kw) for name, kw in
              (("h2o", dict(budget=16)), ("all", dict(budget=1.0)), ("recent", dict(budget=16, policy="recent")))}
    with torch.inference_mode():
        for cache in caches.values():
            model(ids, past_key_values=cache)
    layer = caches["h2o"].layers[0]
    assert layer.ring.queries.shape == (B, 4, 12, D) and layer.ring.queries.dtype == torch.float32  # the model's dtype
    ring = layer.ring.queries.nbytes + layer.ring.positions.nbytes + layer.ring.valid.nbytes
    assert layer.nbytes() == sum(t.nbytes for t in layer.slots.tensors()) + ring
    assert caches["all"].layers[0].ring is None and caches["recent"].layers[0].ring is None


def test_crop_it_cannot_undo_stops_the_next_forward(tiny_model):
    """A crop whose queries' mass the layer cannot take out of the scores still crops the storage (the prefix store
    encodes such a cropped copy), and the next forward raises a ValueError naming the fix instead of evicting by
    those scores."""
    model = tiny_model
    model.set_attn_implementation("hf_kvcache")
    ids = torch.randint(0, 97, (B, 12), generator=torch.Generator().manual_seed(4))

    def cropped(n, first=6, **options):
        cache = H2OCache(config=model.config, budget=16, **options)
        model(ids[:, :first], past_key_values=cache)
        if first < 12:
            model(ids[:, first:12], past_key_values=cache)
        cache.crop(-n)
        return cache

    with torch.inference_mode():
        cache = cropped(5, crop_window=4)
        assert cache.get_seq_length() == cache.tokens_held() == 7
        with pytest.raises(ValueError, match=r"positions 7 \.\. 11.*build the cache with crop_window >= 5"):
            model(ids[:, 7:8], past_key_values=cache)
        model(ids[:, 8:9], past_key_values=cropped(4, crop_window=4))  # within the window: goes on
        # with decay a crop inside a forward needs that whole forward's queries (their mass is recomputed too)
        with pytest.raises(ValueError, match=r"positions 0 \.\. 11.*crop_window >= 12"):
            model(ids[:, 10:11], past_key_values=cropped(2, first=12, decay=0.9, crop_window=4))
        with pytest.raises(ValueError, match="quant_bits=8 and policy='h2o'.*Use quant_bits=None"):
            model(ids[:, 10:11], past_key_values=cropped(2, quant_bits=8))
        cache.reset()
        model(ids[:, :4], past_key_values=cache)  # a reset cache is a fresh one
    with pytest.raises(ValueError, match="crop_window applies to the h2o / hybrid policies, not 'tova'"):
        H2OCache(config=model.config, policy="tova", crop_window=8)
    with pytest.raises(ValueError, match="crop_window must be a non-negative integer"):
        H2OCache(config=model.config, crop_window=-1)


# ---- the real model -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_by_name_switches_attention(smol, pydoc_text):
    from hf_kvcache.eval import load_tokens

    model, tok = smol
    model.set_attn_implementation("sdpa")
    ids = load_tokens(tok, pydoc_text, 0, 60)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    try:
        out = model.generate(ids, cache_implementation="h2o", cache_config={"budget": 24}, return_dict_in_generate=True, **kw)
        assert model.config._attn_implementation == "sdpa"  # switched for generate, handed back afterwards
        cache = out.past_key_values
        assert isinstance(cache, H2OCache) and cache.tokens_held() == 24 and cache.get_seq_length() == 67
        # a budget that keeps everything generates exactly what the dynamic cache does
        full = model.generate(ids, cache_implementation="h2o", cache_config={"budget": 1.0}, **kw)
        model.set_attn_implementation("sdpa")
        assert torch.equal(full, model.generate(ids, **kw))
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("policy,head_budgets", [("snapkv", False), ("tova", False), ("h2o", False), ("knorm", False),
                                                 ("snapkv", True)])
def test_evict_to_drops_to_the_budget_keeps_the_newest_and_stays_exact(tiny_model, policy, head_budgets):
    """`evict_to` between forwards (budget=1.0: the cache never evicts by itself): every layer holds exactly the
    tokens asked for, the protected newest ones among them in every row and head, nothing is evicted after, and the
    next forward equals dense attention over the kept tokens."""
    model = tiny_model
    model.set_attn_implementation("hf_kvcache")
    ids = torch.randint(0, 97, (B, 31), generator=torch.Generator().manual_seed(2))
    cache = H2OCache(config=model.config, budget=1.0, policy=policy, head_budgets=head_budgets)
    with torch.inference_mode():
        model(ids[:, :30], past_key_values=cache)
        assert cache.tokens_held() == 30
        before = cache.memory_stats()["bytes"]
        cache.evict_to(12, protect_last=5)
        assert cache.memory_stats()["bytes"] < before
        for layer in cache.layers:
            pos = layer.held_positions()
            assert (layer.held_valid().sum(-1) == 12).all()
            for p in range(25, 30):  # the protected tokens, in every row and head
                assert (pos == p).any(-1).all()
        dense = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.layers):
            dense.update(*(t.clone() for t in layer.held_keys_values()), i)
        valid = cache.layers[0].held_valid()[:, 0].long()
        pos_ids = torch.full((B, 1), 30)
        out = model(ids[:, 30:], past_key_values=cache, position_ids=pos_ids).logits
        assert cache.tokens_held() == 13 and cache.get_seq_length() == 31  # the budget 1.0 evicts nothing more
        if not head_budgets:  # ragged heads hold different tokens: no single dense cache to compare with
            ref = model(ids[:, 30:], attention_mask=torch.cat([valid, torch.ones(B, 1, dtype=torch.long)], 1),
                        past_key_values=dense, position_ids=pos_ids).logits
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_evict_to_bad_input():
    cache = H2OCache(config=tiny_config(), budget=1.0, policy="tova")
    with pytest.raises(ValueError, match="an int >= 1"):
        cache.evict_to(0)
    with pytest.raises(ValueError, match=r"protect_last must be an int in \[0, tokens=4\]"):
        cache.evict_to(4, protect_last=5)


def test_protect_last_overrides_the_priority():
    """`select(..., protect_last=k)`: the k newest real tokens are kept even where their score is the lowest."""
    policy = POLICIES["knorm"]()
    # growing norms, the two newest the largest: knorm would drop them first
    keys = torch.ones(1, 1, 6, D) * torch.tensor([1.0, 1.1, 1.2, 1.3, 10.0, 11.0]).view(1, 1, 6, 1)
    view = SlotView(None, torch.arange(6).view(1, 1, 6), torch.ones(1, 1, 6, dtype=torch.bool), seen=6, keys=keys)
    assert policy.select(view, 3).tolist() == [[[0, 1, 2]]]
    assert policy.select(view, 3, protect_last=2).tolist() == [[[0, 4, 5]]]


@pytest.mark.parametrize("policy", ["tova", "snapkv", "knorm"])
def test_shared_heads_keep_one_token_set_per_layer(tiny_model, policy):
    """`shared_heads=True`: every KV head of a layer holds the same positions over forwards; the per-head default
    lets them differ (knorm on random weights: the heads' key norms differ)."""
    model = tiny_model
    model.set_attn_implementation("hf_kvcache")
    ids = torch.randint(0, 97, (B, 40), generator=torch.Generator().manual_seed(3))
    held = {}
    for shared in (False, True):
        cache = H2OCache(config=model.config, budget=10, policy=policy, shared_heads=shared)
        with torch.inference_mode():
            model(ids[:, :30], past_key_values=cache)
            model(ids[:, 30:], past_key_values=cache)
        same = []
        for layer in cache.layers:
            pos = layer.held_positions()
            assert pos.shape[-1] == 10
            same.append(bool((pos == pos[:, :1]).all()))
        held[shared] = all(same)
    assert held[True]
    if policy == "knorm":
        assert not held[False]
    with pytest.raises(ValueError, match="shared_heads .* and head_budgets"):
        H2OOptions(shared_heads=True, head_budgets=True, policy="tova").validate()
