"""The contract every registered cache keeps with `generate`, checked on SmolLM2 against what each result must equal.

One parametrized suite for every name in `hf_kvcache.cache_names()` (a new name fails
`test_every_registered_cache_is_in_the_contract` until it gets a configuration here). Results are compared with what
they must equal, token by token or logit by logit, never by shape:

- beam search: every returned beam, replayed through a fresh cache as beam search fed it, scores exactly what beam
  search scored, so `reorder_cache` moved each beam's own storage;
- reorder / repeat + select / reset / crop of a prefilled cache equal, at the next forward, the cache they define
  (rows swapped, the same rows, a fresh cache, a cache that never saw the cropped tokens);
- assisted decoding generates greedy decoding's tokens where that is guaranteed (see `EXACT`), and fails clearly
  where the cache cannot crop (H2O after eviction);
- each row of a left-padded batch generates what its prompt generates alone.

Only public API is used (`generate`, `memory_stats`, `get_seq_length`, transformers' `Cache` methods), never a
layer's storage. Everything runs on one thread (`one_thread`), about 40 s of CPU for the whole file.
"""

import copy

import pytest
import torch

import hf_kvcache

pytestmark = pytest.mark.slow

# Options under which every cache really compresses the 32-token prompts of this file: the tiered cache has all its
# tiers in use (2 sinks, archive, warm, tail), KIVI quantizes 24 tokens, H2O evicts, CPAC compresses 3 pages. Tier,
# group and page sizes are 8 tokens, so every boundary where a cache's storage changes is a multiple of 8.
CASES = {
    "int8": {},
    "int4": {},
    "fp8": {},
    "uniform": {"dtype": "int4", "group_size": 16, "symmetric": False},
    "tiered": {"tail_length": 8, "warm_length": 8, "group_size": 8, "archive_group_size": 8, "sink_length": 2,
               "rotation": "both"},
    "tiered_long": {"tail_length": 8, "group_size": 8, "archive_group_size": 8, "sink_length": 2},
    # the preset's memory target and warm floor with calibration off, as for "tiered" (a calibrated cache chooses from
    # the tokens it saw, so a crop or a padded row would not equal a fresh cache); the per-layer format choice, which
    # needs calibration, has its own tests (tests/calibrate/test_calibrate.py)
    "tiered_retrieval": {"tail_length": 8, "warm_length": 8, "group_size": 8, "archive_group_size": 8,
                         "sink_length": 2, "rotation": "both", "archive_candidates": None},
    "kivi": {"residual_length": 8, "group_size": 8},
    "h2o": {"budget": 12, "policy": "hybrid"},  # sinks + heavy hitters + recent window: every part of the ranking
    "cpac": {"page_size": 8, "recent_pages": 1},
    "paged_quant": {"page_size": 8, "group_size": 8},
}
NAMES = sorted(CASES)
P = 32  # prompt tokens: a multiple of 8

# Assisted decoding verifies its candidates in one forward, and every cache hands the new tokens of a forward to
# attention as the model computed them (full precision), while greedy decoding reads the earlier ones back from
# compressed storage; the first verification forward even holds the whole prompt. So with a cache that compresses
# anything, the two runs attend different values and may legitimately differ (measured on this prompt: logits apart
# by 0.4 with int8, 1.3 with the tiered cache). They must agree, to float rounding, when the cache stores every
# token exactly during the test: a tail / residual window longer than the sequence and kept in the model's dtype
# (nothing graduates), a budget that evicts nothing, recent pages that cover the sequence in float32. The uniform
# caches have no such setting (every token is quantized); for them, and for every cache in its compressing `CASES`
# setting, the exact property assisted decoding relies on is tested on the cache instead
# (`test_crop_equals_a_cache_that_never_saw_the_cropped_tokens`).
EXACT = {
    "tiered": {"tail_length": 256, "tail_dtype": None, "rotation": "none"},
    "kivi": {"residual_length": 256, "tail_dtype": None},
    "h2o": {"budget": 1.0},
    "cpac": {"page_size": 16, "recent_pages": 16, "full_dtype": "float32"},
    "paged_quant": {"page_size": 256, "tail_dtype": None},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread: a multi-threaded GEMM splits the rows of a batch among threads, so a beam computed in row 1 and
    replayed in row 0 differs in the last float bits, enough to move a quantization code by one step now and then
    (measured with 2 threads: 2.6e-2 in a logit of the asymmetric int4 cache); on one thread the replay below is
    bitwise equal after the prompt forward."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ids_of(smol, moby_text, pydoc_text):
    """`ids_of(text, start, n)`: token ids `[1, n]` of "moby" or "pydoc" from token `start` (the beginnings of the
    texts tokenized once: `load_tokens` tokenizes a whole book at every call, 2.4 s)."""
    tok = smol[1]
    ids = {name: tok(text[:chars], add_special_tokens=False, return_tensors="pt").input_ids
           for name, text, chars in (("moby", moby_text, 45000), ("pydoc", pydoc_text, 6000))}
    return lambda text, start, n: ids[text][:, start : start + n]


def build(model, name, options=None):
    return hf_kvcache.build_cache(name, model.config, **dict(CASES[name] if options is None else options))


def step(model, cache, tokens):
    """Logits of the last position after one forward of `tokens` through `cache`, attached as generate attaches it."""
    with hf_kvcache.attached(model, cache):
        return model(tokens, past_key_values=cache).logits[:, -1]


def stats(cache):
    """`memory_stats()` without its NaN entries (CPAC's measured pressure without a budget), for comparisons."""
    return {k: v for k, v in cache.memory_stats().items() if v == v}


def test_every_registered_cache_is_in_the_contract():
    assert NAMES == hf_kvcache.cache_names()


# ---- beam search -----------------------------------------------------------------------------------------------------
MERGE_CASE = {"budget": 12, "policy": "snapkv", "merge": "mass"}  # folds evicted tokens: values and log weights move


@torch.no_grad()
@pytest.mark.parametrize("name,options", [(n, None) for n in NAMES] + [("h2o", MERGE_CASE)])
def test_beam_search_scores_equal_a_replay_of_each_beam(smol, ids_of, name, options):
    """Beam search reorders the cache rows at every step (`reorder_cache`). Each returned beam, replayed through a
    fresh cache as beam search fed it (the prompt in as many rows, then one token per forward), must score what beam
    search scored at every step: the full logits, the chosen tokens' log-probabilities and `sequences_scores`. A
    reorder that left a row with another beam's storage moves them by whole nats (measured 6 to 10 with
    `reorder_cache` a no-op); the replay differs by 2.3e-5, in the prompt forward's logits only (generate computes
    the last position alone)."""
    model, _ = smol
    ids = ids_of("moby", 8000, P)
    beams, new = 2, 4
    config = dict(CASES[name] if options is None else options)
    out = model.generate(ids, cache_implementation=name, cache_config=config, num_beams=beams,
                         num_return_sequences=beams, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True, output_scores=True, output_logits=True)
    seqs, paths = out.sequences, out.beam_indices[:, :new]
    assert seqs.shape == (beams, P + new)
    assert (paths[:, 1:] != paths[:, :-1]).any(), paths  # beams moved between rows: the reorders did something
    scores = model.compute_transition_scores(seqs, out.scores, out.beam_indices)
    cache = build(model, name, options)
    logits = [step(model, cache, seqs[:, :P])]
    for i in range(P, P + new - 1):
        logits.append(step(model, cache, seqs[:, i : i + 1]))
    logits = torch.stack(logits, 1).float()  # [beams, steps, vocab]
    logprobs = logits.log_softmax(-1).gather(-1, seqs[:, P:, None])[..., 0]
    searched = torch.stack([torch.stack([out.logits[s][paths[r, s]] for s in range(new)]) for r in range(beams)])
    torch.testing.assert_close(logits, searched, atol=1e-3, rtol=0)
    torch.testing.assert_close(logprobs, scores[:, :new], atol=1e-4, rtol=0)
    torch.testing.assert_close(logprobs.mean(-1), out.sequences_scores, atol=1e-4, rtol=0)  # length_penalty 1.0
    if options is None:
        assert cache.memory_stats()["ratio"] > 1  # the configuration really compresses
    else:  # 36 tokens are fewer than the ring of 32 queries merge keeps; what matters is that tokens were folded
        assert all(bool((layer.slots.log_weight > 0).any()) for layer in cache.layers)


# ---- cache operations, judged at the next forward --------------------------------------------------------------------
_PREFILLED = {}


def prefilled(model, ids_of, name):
    """(a copy of the cache after a batch of two different P-token prompts, those prompts with 8 more tokens each);
    the prompt forward runs once per cache."""
    if name not in _PREFILLED:
        ids = torch.cat([ids_of("moby", 5000, P + 8), ids_of("pydoc", 0, P + 8)])
        cache = build(model, name)
        step(model, cache, ids[:, :P])
        _PREFILLED[name] = (cache, ids)
    cache, ids = _PREFILLED[name]
    return copy.deepcopy(cache), ids


@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_reorder_select_repeat_reset_equal_their_definitions(smol, ids_of, name):
    model, _ = smol
    cache, ids = prefilled(model, ids_of, name)
    nxt = ids[:, P : P + 1]
    want = step(model, copy.deepcopy(cache), nxt)

    swapped = copy.deepcopy(cache)
    swapped.reorder_cache(torch.tensor([1, 0]))
    torch.testing.assert_close(step(model, swapped, nxt.flip(0)), want.flip(0), atol=1e-4, rtol=0)

    # generate's expansion for several sequences per prompt, then a selection that keeps one copy of each, swapped
    again = copy.deepcopy(cache)
    again.batch_repeat_interleave(2)
    again.batch_select_indices(torch.tensor([3, 0]))
    torch.testing.assert_close(step(model, again, nxt.flip(0)), want.flip(0), atol=1e-4, rtol=0)

    cache.reset()
    assert cache.get_seq_length() == 0 and cache.memory_stats()["tokens"] == 0
    # a reset cache is a fresh one (what a cache keeps whatever its tokens, such as the tiered cache's rotation
    # matrices, may stay allocated: bytes are compared after a forward)
    fresh = build(model, name)
    torch.testing.assert_close(step(model, cache, ids[:, :12]), step(model, fresh, ids[:, :12]), atol=1e-4, rtol=0)
    assert stats(cache) == stats(fresh)


class _StatesOf:
    """While active on `cache`, records the key and value states each layer's `update` receives, or, given states
    recorded earlier, stores the first tokens of those instead of what the forward computed (same count)."""

    def __init__(self, cache, recorded=None):
        self.cache, self.recorded, self.seen = cache, recorded, {}

    def __enter__(self):
        original = self.cache.update

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            if self.recorded is None:
                self.seen[layer_idx] = (key_states, value_states)
            else:
                n = key_states.shape[2]
                key_states, value_states = (s[:, :, :n] for s in self.recorded[layer_idx])
            return original(key_states, value_states, layer_idx, *args, **kwargs)

        self.cache.update = update
        return self

    def __exit__(self, *exc):
        del self.cache.update


@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_crop_equals_a_cache_that_never_saw_the_cropped_tokens(smol, ids_of, name):
    """What assisted decoding does after a rejected candidate: a forward of 5 tokens (the last accepted one and 4
    candidates), then crop(-3), must leave the cache a forward of the 2 kept tokens leaves: same length, and after
    the next forward the same logits and the same bytes. P and P + 5 lie between the same multiples of 8, so the 5
    tokens cross no boundary where storage changes and both runs compress the same tokens the same way. The 2-token
    forward stores the key and value states the 5-token forward computed for those tokens: the model computes them
    in GEMMs of other shapes, whose rounding differs in the last float bits by CPU (enough to move a quantization
    code or a 16-bit tail value by one step now and then: 5.3e-4 in a logit of KIVI on CI's CPU), which is the
    model's rounding, not the cache's. H2O has evicted during the prompt and cannot restore what it dropped: it must
    say so instead of cropping."""
    model, _ = smol
    cache, ids = prefilled(model, ids_of, name)
    never = copy.deepcopy(cache)
    with _StatesOf(cache) as five:
        step(model, cache, ids[:, P : P + 5])
    if name == "h2o":
        with pytest.raises(ValueError, match="H2OCache cannot crop 3 token"):
            cache.crop(-3)
        return
    cache.crop(-3)
    assert cache.get_seq_length() == P + 2
    with _StatesOf(never, five.seen):
        step(model, never, ids[:, P : P + 2])
    nxt = ids[:, P + 2 : P + 3]
    # equal storage and the same forward: bitwise-equal logits
    torch.testing.assert_close(step(model, cache, nxt), step(model, never, nxt), atol=0, rtol=0)
    # bytes after a forward: right after the crop, storage sliced in place still holds the cropped tokens until the
    # next append replaces it
    assert stats(cache) == stats(never) and cache.get_seq_length() == P + 3 and stats(cache)["ratio"] > 1


@torch.no_grad()
@pytest.mark.parametrize("name,options", [
    pytest.param("h2o", {"budget": 40}),
    pytest.param("cpac", {"page_size": 8, "recent_pages": 1}),
])
def test_after_a_crop_later_decisions_ignore_the_cropped_queries(smol, ids_of, name, options):
    """The cache that crops with nothing evicted yet must go on as the cache that never saw the cropped tokens, also
    once it evicts (H2O, budget 40) or compresses new pages (CPAC) by the attention tokens received. Measured: H2O's
    logits then differ by 2e-2, CPAC keeps 10 more raw pages; feeding the same two tokens in two forwards instead of
    a cropped one gives 2e-5 (H2O) and equal page counts (CPAC)."""
    model, _ = smol
    ids = ids_of("moby", 5000, P + 19)
    cache = build(model, name, options)
    step(model, cache, ids[:, :P])
    never = copy.deepcopy(cache)
    step(model, cache, ids[:, P : P + 5])
    cache.crop(-3)
    step(model, never, ids[:, P : P + 2])
    for chunk in (slice(P + 2, P + 18), slice(P + 18, P + 19)):  # 50 tokens: H2O evicts, CPAC compresses 2 pages
        got, want = step(model, cache, ids[:, chunk]), step(model, never, ids[:, chunk])
    assert stats(cache) == stats(never)
    torch.testing.assert_close(got, want, atol=5e-3, rtol=0)


# ---- assisted decoding -----------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("name", sorted(EXACT))
def test_assisted_decoding_equals_greedy_when_storage_is_exact(smol, ids_of, name):
    """Prompt-lookup decoding on a repeated passage: candidates are accepted and rejected (the cache is cropped by 0,
    3 and 4 tokens), and it generates greedy decoding's tokens and logits with the same cache setting. See `EXACT`
    for why this is guaranteed only when the cache stores every token exactly."""
    model, _ = smol
    base = ids_of("pydoc", 300, 16)
    ids = torch.cat([base, base, base[:, :1]], 1)  # prompt lookup proposes the repetition; the model departs from it
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)
    greedy = model.generate(ids, past_key_values=build(model, name, EXACT[name]), **kw)
    cache = build(model, name, EXACT[name])
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(-n), crop(n))[1]
    assisted = model.generate(ids, past_key_values=cache, prompt_lookup_num_tokens=4, **kw)
    assert max(crops) > 0 and len(crops) < 10, crops  # candidates were rejected, and accepted
    assert torch.equal(assisted.sequences, greedy.sequences)
    torch.testing.assert_close(torch.stack(assisted.logits), torch.stack(greedy.logits), atol=1e-3, rtol=0)
    assert cache.get_seq_length() == ids.shape[1] + 9  # the last token is never fed back


@torch.no_grad()
def test_assisted_decoding_after_eviction_is_a_clear_error(smol, ids_of):
    model, _ = smol
    base = ids_of("pydoc", 300, 16)
    ids = torch.cat([base, base, base[:, :1]], 1)
    with pytest.raises(ValueError, match="H2OCache cannot crop"):
        model.generate(ids, cache_implementation="h2o", cache_config=dict(CASES["h2o"]), prompt_lookup_num_tokens=4,
                       max_new_tokens=10, do_sample=False)


# ---- left padding ----------------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_left_padded_batch_rows_equal_each_prompt_alone(smol, ids_of, name):
    """A prompt of P tokens and one of P - 16 in a left-padded batch: each row generates the greedy tokens its prompt
    generates alone. 16 padding positions are a multiple of every group and page size here, so the real tokens of
    the padded row fall into the same quantization groups and pages, and graduate at the same time, as alone; with
    other amounts of padding the grouping differs and rows may legitimately differ (KIVI with 4 padding positions
    does). That padding never enters the statistics of real tokens is tested exactly, with two pad values, in
    test_reliability.py."""
    model, tok = smol
    prompts = [ids_of("moby", 5000, P), ids_of("pydoc", 0, P - 16)]
    ids = torch.full((2, P), tok.pad_token_id)
    mask = torch.zeros(2, P, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, P - p.shape[1] :], mask[row, P - p.shape[1] :] = p[0], 1
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id,
              cache_implementation=name, cache_config=dict(CASES[name]))
    together = model.generate(ids, attention_mask=mask, **kw)[:, P:]
    for row, p in enumerate(prompts):
        alone = model.generate(p, **kw)[0, p.shape[1] :]
        assert torch.equal(together[row], alone), (row, together[row], alone)
