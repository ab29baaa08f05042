"""The context-reconstruction scorer (`policy.reconstruct`, `caches.evict.reconstruct`) on a tiny random Llama."""

from __future__ import annotations

import copy

import pytest
import torch
from policy_contract import B, H, tiny_model

from transformers import DynamicCache

from hf_kvcache import H2OCache
from hf_kvcache.caches.evict.reconstruct import LEAD_TOKENS, held_for_scoring, score_context
from hf_kvcache.policy import ReconstructionPolicy
from hf_kvcache.policy.reconstruct import UNSCORED
from hf_kvcache.policy.wrappers import AdaKV, Pyramid

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _ids(seed: int, n: int = 40) -> torch.Tensor:
    return torch.randint(0, 97, (B, n), generator=torch.Generator().manual_seed(seed))


def _reference_scores(model, ids: torch.Tensor, chunk: int, mask: torch.Tensor | None = None,
                      sinks: int | None = None) -> list[torch.Tensor]:
    """Per layer `[B, H, n]`: the largest attention probability any query of `PROMPT + span` (over the context +
    itself, eager attention of a DynamicCache) gives each context token, for every span of `chunk` tokens.
    `sinks` (scope "span"): each span's repeat starts with the `LEAD_TOKENS` tokens before it, and the probabilities
    are renormalized over the first `sinks` context tokens, the span and the repeat tokens."""
    n = ids.shape[1]
    mask = torch.ones_like(ids) if mask is None else mask
    best = None
    for start in range(0, n, chunk):
        lead = 0 if sinks is None else min(start, LEAD_TOKENS)
        span = torch.cat([torch.tensor([PROMPT] * B), ids[:, start - lead : start + chunk]], 1)
        span_mask = torch.cat([torch.ones(B, len(PROMPT), dtype=torch.long), mask[:, start - lead : start + chunk]],
                              1)
        full = torch.cat([ids, span], 1)
        full_mask = torch.cat([mask, span_mask], 1)
        positions = (full_mask.cumsum(1) - 1).clamp_min(0)
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")
        out = eager(full, attention_mask=full_mask, position_ids=positions, output_attentions=True)
        w = span.shape[1]
        part = []
        for att in out.attentions:  # [B, heads, n + w, n + w]
            att = att[:, :, -w:]
            if sinks is not None:
                keep = torch.ones(B, n + w, dtype=torch.bool)
                pos = torch.arange(n)
                real = mask.bool() & (mask.cumsum(1) > 0)
                keep[:, :n] = real & ((mask.cumsum(1) <= sinks) | ((pos >= start) & (pos < start + chunk)))
                att = att * keep[:, None, None]
                att = att / att.sum(-1, keepdim=True)
            a = att[..., :n] * span_mask[:, None, :, None]  # padding queries give nothing
            part.append(a.reshape(B, H, -1, w, n).amax(dim=(2, 3)))
        best = part if best is None else [torch.maximum(x, y) for x, y in zip(best, part)]
    return best


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [16, 64])
def test_scores_equal_the_attention_of_the_repeat(model, chunk):
    """The scores after `score_context` are the largest attention the repeat queries give each context token
    (eager attention of the same sequence as reference), and the cache is left as it was: same tokens seen, same
    slots, the same next logits."""
    ids = _ids(1)
    cache = H2OCache(config=model.config, budget=1.0, policy=ReconstructionPolicy(chunk=chunk))
    model(ids, past_key_values=cache)
    untouched = copy.deepcopy(cache)
    assert (cache.layers[0].held_scores() == UNSCORED).all()
    score_context(model, cache, ids, PROMPT)
    assert cache.get_seq_length() == 40
    for layer, ref in zip(cache.layers, _reference_scores(model, ids, chunk)):
        torch.testing.assert_close(layer.held_scores(), ref, atol=1e-5, rtol=0)
    nxt = _ids(2, 1)
    torch.testing.assert_close(model(nxt, past_key_values=cache).logits,
                               model(nxt, past_key_values=untouched).logits, atol=1e-6, rtol=0)


@torch.inference_mode()
def test_left_padded_batch(model):
    """Row 1 left-padded by 9: its scores are those of the row alone without padding (padding never scored high,
    never kept), in a batch of two."""
    ids = _ids(3)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    cache = H2OCache(config=model.config, budget=12, policy=ReconstructionPolicy(chunk=16))
    with held_for_scoring(model, cache, ids, PROMPT, attention_mask=mask):
        model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        assert cache.tokens_held() == 40  # held while the context comes in
    alone = H2OCache(config=model.config, budget=1.0, policy=ReconstructionPolicy(chunk=16))
    model(ids[1:, 9:], past_key_values=alone)
    score_context(model, alone, ids[1:, 9:], PROMPT)
    ref = _reference_scores(model, ids, 16, mask)
    for layer, ref_layer, one in zip(cache.layers, ref, alone.layers):
        assert layer.tokens_held() == 12 and layer.held_valid().all()  # the padding went first
        kept = layer.held_positions()
        torch.testing.assert_close(layer.held_scores(), ref_layer.gather(2, kept), atol=1e-5, rtol=0)
        want = one.held_scores()[0].topk(12, -1).indices.sort(-1).values + 9
        assert torch.equal(kept[1], want)  # the same tokens as the unpadded row alone (chunks shifted by padding:
        # scores differ slightly, not the ranking here)


@torch.inference_mode()
def test_compress_once_ask_many(model):
    """`evict_to` after scoring keeps the top-scored tokens; questions over copies of the compressed cache leave it
    unchanged; new tokens rank above the scored context (a ratio budget kept while decoding evicts context)."""
    ids = _ids(4)
    cache = H2OCache(config=model.config, budget=1.0, policy="reconstruct", chunk=32)
    model(ids, past_key_values=cache)
    score_context(model, cache, ids, PROMPT)
    scores = [layer.held_scores().clone() for layer in cache.layers]
    cache.evict_to(10)
    for layer, s in zip(cache.layers, scores):
        assert torch.equal(layer.held_positions(), s.topk(10, -1).indices.sort(-1).values)
    before = [layer.held_positions().clone() for layer in cache.layers]
    for q in range(2):
        asked = copy.deepcopy(cache)
        model(_ids(5 + q, 6), past_key_values=asked)
        assert asked.get_seq_length() == 46
    assert all(torch.equal(layer.held_positions(), p) for layer, p in zip(cache.layers, before))
    ratio = H2OCache(config=model.config, budget=0.5, policy="reconstruct", chunk=32)
    with held_for_scoring(model, ratio, ids, PROMPT):
        model(ids, past_key_values=ratio)
    assert ratio.tokens_held() == 20
    for t in range(6):  # decoding: the budget grows by one token every two; the new tokens are all kept
        model(_ids(10 + t, 1), past_key_values=ratio)
    pos = ratio.layers[0].held_positions()
    assert ratio.tokens_held() == 23 and (pos[..., -6:] == torch.arange(40, 46)).all()


@torch.inference_mode()
@pytest.mark.parametrize("sinks", [0, 3])
def test_span_scope_scores_each_token_by_the_repeat_of_its_span(model, sinks):
    """scope="span": a token's score is the largest attention the repeat of its own span gives it, the softmax taken
    over the sinks, that span and the repeat tokens (eager attention of the same sequence, renormalized, as
    reference); later spans' repeats start with the tokens before them."""
    ids = _ids(11)
    policy = ReconstructionPolicy(chunk=16, scope="span", sink_length=sinks)
    cache = H2OCache(config=model.config, budget=1.0, policy=policy)
    model(ids, past_key_values=cache)
    score_context(model, cache, ids, PROMPT)
    for layer, ref in zip(cache.layers, _reference_scores(model, ids, 16, sinks=sinks)):
        torch.testing.assert_close(layer.held_scores(), ref, atol=1e-5, rtol=0)


@torch.inference_mode()
@pytest.mark.parametrize("ragged", [False, True])
def test_joint_layer_budgets(model, ragged):
    """layer_budgets="joint": `evict_to` keeps, over all layers together, the best-scored slots (each layer its
    share of them, rounded up to whole tokens per head; the sinks in every layer), so a layer may hold more than the
    first; the next forward then gives the logits of a DynamicCache holding the same tokens."""
    ids = _ids(12)[:1]
    core = ReconstructionPolicy(chunk=16, scope="span", layer_budgets="joint", sink_length=2)
    cache = H2OCache(config=model.config, budget=1.0, policy=AdaKV(core, floor=0.0) if ragged else core)
    model(ids, past_key_values=cache)
    score_context(model, cache, ids, PROMPT)
    last = cache.layers[-1]
    last.slots.scores = last.slots.scores * 3  # the last layer's tokens now outrank most of the first's
    ranked = torch.stack([layer.held_scores()[0] for layer in cache.layers])  # [layers, H, n]
    ranked[..., :2] = float("inf")
    best = torch.zeros(ranked.numel(), dtype=torch.bool)
    best[ranked.flatten().topk(10 * H * len(cache.layers)).indices] = True
    best = best.view_as(ranked)
    cache.evict_to(10)
    counts = []
    for i, layer in enumerate(cache.layers):
        kept = torch.zeros(H, 40, dtype=torch.bool)
        for h, pos in enumerate(layer.held_positions()[0]):
            kept[h, pos[pos >= 0].long()] = True
        assert kept[:, :2].all()  # the sinks
        share = int(best[i].sum())
        if ragged:  # the heads share the layer's budget: its share of the joint best, at most H - 1 slots over
            assert (kept >= best[i]).all() and 0 <= int(kept.sum()) - share < H
        else:  # each head keeps the layer's budget, its share rounded up to whole tokens per head
            assert (kept.sum(-1) == -(-share // H)).all()
        counts.append(int(kept.sum()))
    assert counts[-1] > counts[0] and abs(sum(counts) - 10 * H * len(counts)) < H * len(counts)
    if not ragged:  # the same tokens in a DynamicCache, decoded one token at a time
        ref = _kept_as_dynamic(cache, 0)
        nxt = _ids(13, 3)[:1]
        got = model(nxt, past_key_values=cache, position_ids=torch.arange(40, 43)[None]).logits
        torch.testing.assert_close(got, _one_at_a_time(model, nxt, ref, 40), atol=1e-5, rtol=0)


@torch.inference_mode()
def test_joint_layer_budgets_left_padded_batch(model):
    """Joint layer budgets on a left-padded batch: the padding goes first, and each row's next logits are those of
    a DynamicCache holding that row's kept tokens (the shared mask is built for the layer holding the most)."""
    ids = _ids(14)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    core = ReconstructionPolicy(chunk=16, scope="span", layer_budgets="joint", sink_length=2)
    cache = H2OCache(config=model.config, budget=1.0, policy=core)
    model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    score_context(model, cache, ids, PROMPT, attention_mask=mask)
    last = cache.layers[-1]
    last.slots.scores = last.slots.scores * 3
    cache.evict_to(12)
    held = [layer.tokens_held() for layer in cache.layers]
    assert held[-1] > held[0]
    assert all(layer.held_valid().all() for layer in cache.layers)  # the padding went first
    refs = [_kept_as_dynamic(cache, row) for row in range(B)]
    nxt = _ids(15, 3)
    got = model(nxt, attention_mask=torch.cat([mask, torch.ones(B, 3, dtype=torch.long)], 1),
                position_ids=positions[:, -1:] + 1 + torch.arange(3), past_key_values=cache).logits
    for row, ref in enumerate(refs):
        want = _one_at_a_time(model, nxt[row : row + 1], ref, int(positions[row, -1]) + 1)
        torch.testing.assert_close(got[row : row + 1], want, atol=1e-5, rtol=0)


def _kept_as_dynamic(cache: H2OCache, row: int) -> DynamicCache:
    """A DynamicCache holding the tokens each layer of `cache` keeps for batch row `row` (rectangular layers)."""
    ref = DynamicCache()
    for i, layer in enumerate(cache.layers):
        ref.update(layer.held_keys()[row : row + 1], layer._plain(layer.slots.values)[row : row + 1], i)
    return ref


def _one_at_a_time(model, ids: torch.Tensor, cache: DynamicCache, start: int) -> torch.Tensor:
    """The logits of `ids [1, n]` fed one token per forward at positions `start...` over `cache`."""
    return torch.cat([model(ids[:, t : t + 1], past_key_values=cache, position_ids=torch.tensor([[start + t]])).logits
                      for t in range(ids.shape[1])], 1)


def test_options_are_checked():
    with pytest.raises(ValueError, match="reduce='mean' is not valid"):
        ReconstructionPolicy(reduce="mean")
    with pytest.raises(ValueError, match="chunk"):
        ReconstructionPolicy(chunk=0)
    with pytest.raises(ValueError, match="scope='all' is not valid"):
        ReconstructionPolicy(scope="all")
    with pytest.raises(ValueError, match="layer_budgets='pyramid' is not valid"):
        ReconstructionPolicy(layer_budgets="pyramid")
    with pytest.raises(ValueError, match="set one of them"):
        Pyramid(ReconstructionPolicy(layer_budgets="joint"), 0.3)


@torch.inference_mode()
def test_score_context_needs_a_reconstruction_cache(model):
    cache = H2OCache(config=model.config, budget=1.0, policy="tova")
    model(_ids(6), past_key_values=cache)
    with pytest.raises(ValueError, match="policy='reconstruct'"):
        score_context(model, cache, _ids(6), PROMPT)


@torch.inference_mode()
def test_pooled_scores_keep_the_neighbours_of_the_best(model):
    """`Pooled(policy, 3)` around the reconstruction scores: `evict_to` keeps each top-scored token with the tokens
    beside it (the maximum over three slots), where the plain scores keep the top tokens alone."""
    from hf_kvcache.policy import Pooled

    ids = _ids(15)[:1]
    for policy, want in ((ReconstructionPolicy(chunk=16), [20, 30]),
                         (Pooled(ReconstructionPolicy(chunk=16), 3), [19, 20, 21, 29, 30, 31])):
        cache = H2OCache(config=model.config, budget=1.0, policy=policy)
        model(ids, past_key_values=cache)
        score_context(model, cache, ids, PROMPT)
        for layer in cache.layers:
            scores = torch.full_like(layer.slots.scores, 1e-3)
            scores[..., 20], scores[..., 30] = 1.0, 0.5
            layer.slots.scores = scores
        cache.evict_to(len(want))
        for layer in cache.layers:
            assert layer.held_positions()[0].sort(-1).values.tolist() == [want] * H
