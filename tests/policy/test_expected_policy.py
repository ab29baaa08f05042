"""The expected-attention eviction policy (`policy="expected"`): it ranks keys as designed (mean query, query
covariance, value norm, RoPE shift to the upcoming positions, sinks, padding), and runs through a model with a
left-padded batch, eviction that frees storage, and beam search."""

import pytest
import torch

import hf_kvcache  # noqa: F401  (registers the attention and the cache names)
from hf_kvcache import H2OCache
from hf_kvcache.policy import POLICIES, SlotView
from hf_kvcache.policy.expected import query_statistics
from hf_kvcache.rope import KeyRotation
from models import eviction_config as tiny_config
from models import eviction_llama

D = 16
E = torch.eye(D)


def policy(**kw):
    return POLICIES["expected"](**{"future": 0, "value_norm": False, "sink_length": 0, **kw})


def view(keys, queries, values=None, q_valid=None, valid=None, seen=None, rope=None):
    """A SlotView of one row and one KV head: `keys [n, D]`, `queries [G, W, D]` at the W positions before `seen`."""
    n, w = keys.shape[0], queries.shape[1]
    seen = n if seen is None else seen
    return SlotView(
        None, torch.arange(n)[None, None], torch.ones(1, 1, n, dtype=torch.bool) if valid is None else valid,
        seen=seen, keys=keys[None, None], values=(torch.ones_like(keys) if values is None else values)[None, None],
        queries=queries[None], query_positions=torch.arange(seen - w, seen),
        query_valid=torch.ones(1, w, dtype=torch.bool) if q_valid is None else q_valid, scaling=D**-0.5, rope=rope,
    )


def order(p, v):
    """Slot indices from the highest priority down."""
    return p.priority(v, budget=1)[0, 0].argsort(descending=True).tolist()


def test_a_key_along_the_mean_query_outranks_an_orthogonal_and_an_opposite_one():
    keys = torch.stack([3 * E[1], 3 * E[0], -3 * E[0]])
    queries = (5 * E[0] + 0.1 * torch.randn(2, 8, D, generator=torch.Generator().manual_seed(0)))
    assert order(policy(), view(keys, queries)) == [1, 0, 2]
    assert policy().select(view(keys, queries), 1).tolist() == [[[1]]]


def test_the_covariance_term_favours_keys_along_the_spread_of_the_queries():
    """Queries of mean 0 that swing along channel 2: a key along channel 2 draws more expected attention
    (exp of a normal logit grows with its variance) than an equally long key along channel 3."""
    queries = torch.stack([4 * E[2], -4 * E[2]] * 4)[None].expand(2, -1, -1)
    keys = torch.stack([3 * E[3], 3 * E[2]])
    p = policy().priority(view(keys, queries), 1)[0, 0]
    assert p[1] > p[0]
    # exp(k^T Sigma k / (2 d)) over exp(0), per query head, two heads summed over a softmax of two keys
    var = (4 * 3) ** 2 / D
    expect = 2 * torch.tensor([1.0, torch.e ** (var / 2)]) / (1 + torch.e ** (var / 2))
    torch.testing.assert_close(p, expect)


def test_value_norm_weights_equal_attention():
    keys = torch.stack([E[0], E[0], E[0]])
    values = torch.stack([2 * E[1], 3 * E[1], E[1]])
    queries = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1))
    v = view(keys, queries, values)
    p = policy(value_norm=False).priority(v, 1)[0, 0]
    torch.testing.assert_close(p, p[:1].expand(3))  # equal attention
    assert policy(value_norm=True).select(v, 1).tolist() == [[[1]]]
    assert policy(value_norm=True, sink_length=1).select(v, 2).tolist() == [[[0, 1]]]  # the sink stays protected
    torch.testing.assert_close(policy(value_norm=True).ranked(v, 1, 0)[0, 0], p * torch.tensor([2.0, 3.0, 1.0]))
    # the same weighting for the other attention policies: tova's newest-query attention times the value norm
    tova = POLICIES["tova"](value_norm=True)
    tv = SlotView(None, v.positions, v.valid, seen=3, values=v.values, window=torch.full((1, 1, 1, 3), 0.5))
    assert tova.select(tv, 1).tolist() == [[[1]]]


def test_sinks_are_kept_and_padding_neither_scores_nor_counts():
    keys = torch.stack([-3 * E[0], 3 * E[0], 3 * E[1], E[0], 3 * E[0]])
    queries = (5 * E[0]).expand(2, 4, D).clone()
    queries[:, 0] = 50 * E[1]  # a padding query looking elsewhere: left out of the statistics
    valid = torch.tensor([[[False, True, True, True, True]]])
    q_valid = torch.tensor([[False, True, True, True]])
    p = policy(sink_length=1)
    keep = p.select(view(keys, queries, valid=valid, q_valid=q_valid), 3)[0, 0].tolist()
    assert keep == [1, 3, 4]  # slot 1: the first real token (sink); slot 2 would win with the padding query
    p0 = policy().priority(view(keys, queries[:, 1:]), 1)
    p1 = policy().priority(view(keys, queries, q_valid=q_valid), 1)
    torch.testing.assert_close(p0, p1)


def test_queries_are_moved_by_rope_to_the_upcoming_positions():
    rope = KeyRotation(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    g = torch.Generator().manual_seed(2)
    plain = torch.randn(2, 3, D, generator=g)  # pre-RoPE queries
    pos = torch.tensor([7, 8, 9])
    q = torch.stack([rope.rotate(plain[:, i : i + 1], int(p))[:, 0] for i, p in enumerate(pos)], 1)
    valid = torch.ones(1, 3, dtype=torch.bool)
    # one upcoming position: every query sits at position `seen`
    mean, _ = query_statistics(q[None], pos, valid, seen=10, future=1, rope=rope)
    torch.testing.assert_close(mean[0, :, 0], rope.rotate(plain.mean(1, keepdim=True), 10)[:, 0], atol=1e-5, rtol=0)
    # several: the mean rotation over them
    mean, _ = query_statistics(q[None], pos, valid, seen=10, future=4, rope=rope)
    ref = torch.stack([rope.rotate(plain.mean(1, keepdim=True), t)[:, 0] for t in range(10, 14)]).mean(0)
    torch.testing.assert_close(mean[0, :, 0], ref, atol=1e-5, rtol=0)


def test_mass_share_blends_in_the_attention_received():
    """Slot 1 is expected (the queries point at it), slot 2 received the most attention so far: the blend of the two
    shares (each normalized over the evictable slots) decides; the sink's mass is left out of the normalization."""
    keys = torch.stack([E[3], 3 * E[0], 3 * E[1], E[2]])
    queries = (2 * E[0]).expand(2, 4, D).clone()
    v = view(keys, queries)
    v.scores = torch.tensor([[[100.0, 0.1, 3.0, 0.1]]])
    assert policy(sink_length=1).select(v, 2).tolist() == [[[0, 1]]]
    assert policy(sink_length=1, mass_share=0.9).select(v, 2).tolist() == [[[0, 2]]]
    blended = policy(sink_length=1, mass_share=0.5).priority(v, 2)[0, 0]
    assert blended[0] == float("inf") and torch.isclose(blended[1:].sum(), torch.tensor(1.0))
    assert POLICIES["expected"](mass_share=0.2).uses_mass and not POLICIES["expected"]().uses_mass


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(policy="tova", future=8), "future applies to the expected policy"),
        (dict(policy="knorm", value_norm=True), "value_norm applies to the h2o / tova / snapkv / hybrid / "
                                                "expected / reconstruct policies, not 'knorm'"),
        (dict(policy="expected", future=-1), "future must be a non-negative integer"),
        (dict(policy="expected", value_norm="yes"), "value_norm must be True or False"),
        (dict(policy="expected", pool=3), "pool applies to the snapkv policy"),
        (dict(policy="expected", mass_share=1.0), r"mass_share must be a number in \[0, 1\)"),
        (dict(policy="tova", mass_share=0.2), "mass_share applies to the expected policy"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        H2OCache(config=tiny_config(), **options)


def test_moving_queries_by_rope_needs_the_config():
    with pytest.raises(ValueError, match=r"needs the config: H2OCache\(config=model.config, ...\); or set future=0"):
        H2OCache(budget=0.5, policy="expected")
    H2OCache(budget=0.5, policy="expected", future=0)  # no RoPE, no config needed


# ---- through a tiny random Llama ------------------------------------------------------------------------------------
B, H, G = 2, 2, 2


@pytest.fixture(scope="module")
def tiny_model():
    return eviction_llama("hf_kvcache")


def test_left_padded_batch_evicts_padding_first_and_frees_storage(tiny_model):
    ids = torch.randint(0, 97, (B, 40), generator=torch.Generator().manual_seed(3))
    am = torch.ones(B, 40, dtype=torch.long)
    am[1, :9] = 0
    cache = H2OCache(config=tiny_model.config, budget=0.25, policy="expected")
    with torch.inference_mode():
        for s in range(0, 40, 8):
            tiny_model(ids[:, s : s + 8], attention_mask=am[:, : s + 8], past_key_values=cache)
    layer = cache.layers[0]
    assert cache.tokens_held() == 10 and layer.held_valid()[1].all()  # 31 real tokens in row 1: no padding left
    # the first real token of each row (a sink) survives, also the budget of 2 of the first forward
    assert (layer.held_positions()[:, :, 0] == torch.tensor([[0], [9]])).all()
    ring = sum(t.nbytes for t in layer.ring.tensors())
    assert layer.nbytes() == sum(t.nbytes for t in layer.slots.tensors()) + ring
    assert layer.slots.keys.shape == (B, H, 10, D)  # evicted slots are gone from storage, not masked
    assert cache.memory_stats()["bytes"] == sum(lay.nbytes() for lay in cache.layers)
    cache.reset()
    assert cache.memory_stats()["bytes"] == 0 and layer.ring is None


@torch.no_grad()
def test_beam_search_scores_equal_a_replay_of_each_beam(tiny_model):
    """Each beam that beam search returns, replayed through a fresh cache one token per forward, scores what beam
    search scored: reorder_cache moved each row's slots and query ring."""
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(4))
    config = {"budget": 10, "policy": "expected", "window": 8}
    new = 5
    out = tiny_model.generate(ids, cache_implementation="h2o", cache_config=config, num_beams=2,
                              num_return_sequences=2, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    seqs, paths = out.sequences, out.beam_indices[:, :new]
    assert out.past_key_values.tokens_held() == 10
    cache = H2OCache(config=tiny_model.config, **config)
    logits = [tiny_model(seqs[:, :24], past_key_values=cache).logits[:, -1]]
    for i in range(24, 24 + new - 1):
        logits.append(tiny_model(seqs[:, i : i + 1], past_key_values=cache).logits[:, -1])
    logits = torch.stack(logits, 1)
    searched = torch.stack([torch.stack([out.logits[s][paths[r, s]] for s in range(new)]) for r in range(2)])
    torch.testing.assert_close(logits, searched, atol=1e-4, rtol=0)
