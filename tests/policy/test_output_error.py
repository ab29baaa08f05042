"""`output_error`: tova / snapkv / expected rank a token by how far the attention output moves without it
(`policy.base.removal_error`), checked against removing each slot for real, through the policies, and through a
tiny model with a left-padded batch."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kvcache  # noqa: F401  (registers the attention and the cache names)
from hf_kvcache import H2OCache
from hf_kvcache.policy import POLICIES, SlotView
from hf_kvcache.policy.attention import removal_error, window_attention
from hf_kvcache.policy.expected import expected_attention, query_statistics

D = 8


def test_removal_error_is_how_far_each_output_moves_when_the_slot_is_dropped():
    g = torch.Generator().manual_seed(0)
    b, h, grp, w, n = 2, 2, 3, 4, 7
    logits = torch.randn(b, h, grp, w, n, generator=g) * 2
    logits[0, :, :, 1, 5:] = -torch.inf  # a query that does not see the newest slots
    values = torch.randn(b, h, n, D, generator=g)
    probs = torch.softmax(logits, -1)
    got = removal_error(probs, values)
    expect = torch.zeros(b, h, w, n)
    for j in range(n):
        full = probs @ values[:, :, None]
        without = torch.softmax(logits.index_fill(-1, torch.tensor([j]), -torch.inf), -1) @ values[:, :, None]
        expect[..., j] = (full - without).norm(dim=-1).sum(2)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-4)
    assert (got[0, :, 1, 5:] == 0).all()  # unseen slots cost nothing to drop
    torch.testing.assert_close(window_attention(logits, values), got)
    torch.testing.assert_close(window_attention(logits), probs.sum(2))


def two_heavy_slots():
    """One KV head, two query heads, 3 slots: slots 0 and 1 get the same attention; slot 0's value is the output
    the heads would give anyway, slot 1's is far from it."""
    window = torch.tensor([0.4, 0.4, 0.2])
    logits = window.log()[None, None, None, None].expand(1, 1, 2, 1, 3).clone()
    out = torch.zeros(D)
    values = torch.stack([out, 5 * torch.eye(D)[0], -10 * torch.eye(D)[0]])  # o = 0.4 * 5 e0 + 0.2 * -10 e0 = 0
    return logits, values[None, None]


def test_tova_keeps_the_token_whose_value_moves_the_output():
    logits, values = two_heavy_slots()
    view = SlotView(None, torch.arange(3)[None, None], torch.ones(1, 1, 3, dtype=torch.bool), seen=3, values=values)
    view.window = window_attention(logits)
    assert POLICIES["tova"]().select(view, 1).tolist() == [[[0]]]  # attention: a tie, the first wins
    view.window = window_attention(logits, values)
    # removal errors: slot 0 0.4/0.6*0, slot 1 0.4/0.6*5, slot 2 0.2/0.8*10 (per head, 2 heads)
    torch.testing.assert_close(view.window[0, 0, 0], torch.tensor([0.0, 2 * 0.4 / 0.6 * 5, 2 * 0.2 / 0.8 * 10]))
    assert POLICIES["tova"](output_error=True).select(view, 2).tolist() == [[[1, 2]]]


def test_expected_output_error_is_the_removal_error_of_the_expected_attention():
    g = torch.Generator().manual_seed(1)
    heads, kv, w, n = 4, 2, 6, 9
    queries = torch.randn(1, heads, w, D, generator=g)
    keys, values = torch.randn(1, kv, n, D, generator=g), torch.randn(1, kv, n, D, generator=g)
    valid = torch.ones(1, kv, n, dtype=torch.bool)
    valid[0, 1, :2] = False
    mean, spread = query_statistics(queries, torch.arange(n - w, n), torch.ones(1, w, dtype=torch.bool), n, 0)
    got = expected_attention(mean, spread, keys, valid, D**-0.5, values=values)
    # the expected logits, recovered from the expected attention of each query head (a softmax of one row each)
    probs = torch.stack([expected_attention(mean[:, i:i + 1], spread[:, i:i + 1], keys[:, i // 2:i // 2 + 1],
                                            valid[:, i // 2:i // 2 + 1], D**-0.5) for i in range(heads)], 2)
    probs = probs[:, 0].view(1, kv, 2, n)  # [1, kv, group, n]
    torch.testing.assert_close(got, removal_error(probs[:, :, :, None], values)[:, :, 0])
    assert (got[0, 1, :2] == 0).all()
    policy = POLICIES["expected"](future=0, sink_length=0, output_error=True)
    assert policy.uses_values and not policy.value_weighted
    view = SlotView(None, torch.arange(n)[None, None].expand(1, kv, n), valid, seen=n, keys=keys, values=values,
                    queries=queries, query_positions=torch.arange(n - w, n), query_valid=torch.ones(1, w, dtype=bool),
                    scaling=D**-0.5)
    torch.testing.assert_close(policy.priority(view, 3), got)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(policy="h2o", output_error=True), "output_error applies to the tova / snapkv / expected policies"),
        (dict(policy="tova", output_error=True, value_norm=True), "leave value_norm unset"),
        (dict(policy="snapkv", output_error=True, head_budgets=True), "do not compare across heads"),
        (dict(policy="expected", output_error="yes"), "output_error must be True or False"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        H2OCache(budget=0.5, future=0, **options) if options["policy"] == "expected" else H2OCache(budget=0.5,
                                                                                                     **options)


@pytest.mark.parametrize("policy", ["tova", "snapkv", "expected"])
@pytest.mark.parametrize("merge", [None, "mass"])
def test_a_left_padded_batch_streams_and_changes_what_is_kept(policy, merge):
    """Batch 2, row 1 left-padded, 4 chunks: the budget holds, no padding is kept, the bytes are the tensors held,
    and the kept tokens differ from plain attention ranking (the option is live)."""
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         hidden_size=64, intermediate_size=128, vocab_size=97)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("hf_kvcache")
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(3))
    am = torch.ones(2, 48, dtype=torch.long)
    am[1, :7] = 0
    held = []
    for output_error in (False, True):
        cache = H2OCache(config=config, budget=12, policy=policy, merge=merge, output_error=output_error)
        with torch.inference_mode():
            for s in range(0, 48, 12):
                model(ids[:, s : s + 12], attention_mask=am[:, : s + 12], past_key_values=cache)
        layer = cache.layers[1]
        assert cache.tokens_held() == 12 and layer.held_valid().all()
        assert cache.memory_stats()["bytes"] == sum(lay.nbytes() for lay in cache.layers)
        held.append(layer.held_positions())
    assert not torch.equal(held[0], held[1])
