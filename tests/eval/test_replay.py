"""One recorded prefill shared by the caches of a prompt (`eval/replay.py`): a replayed cache holds exactly what its
own prefill forward stores, bit for bit; a cache whose prefill asks the attention for something gives up; answers
through the shared prefill equal those without it."""

import copy

import pytest
import torch
from models import tiny_llama
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

import hf_kvcache  # noqa: F401
from hf_kvcache.eval.bench import CacheSpec, parse_specs
from hf_kvcache.eval.replay import PrefillReplay
from hf_kvcache.eval.suites.passkey import answer, gold_nll
from hf_kvcache.registry import attached

# the tiered default calibrates with the prefill's last queries: replayed from the recorded ones
REPLAYED = ["int8", "int4", "fp8", "kivi", "tiered", "tiered_long", 'tiered:{"rotation":"none"}',
            'tiered:{"calibration_queries":256}']
OWN_PREFILL = ['h2o:{"budget":0.5}', "cpac", 'tiered:{"calibration_queries":257}']  # mass / more queries than kept


def tiny_gemma() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=48,
                           max_position_embeddings=1024, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                           attn_implementation="sdpa")
    return Gemma3ForCausalLM(cfg).eval()


MODELS = {"llama": lambda: tiny_llama(layers=3, head_dim=64), "gemma": tiny_gemma}


def held(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.held_tensors()]


@pytest.fixture(scope="module", params=list(MODELS))
def recorded(request):
    model = MODELS[request.param]()
    ids = torch.randint(0, 256, (1, 600), generator=torch.Generator().manual_seed(3))
    prefill = PrefillReplay(ids[0].tolist())
    full = DynamicCache(config=model.config)
    with torch.inference_mode(), prefill.recording(full):
        model(ids, past_key_values=full)
    return model, ids, prefill


@pytest.mark.parametrize("text", REPLAYED + OWN_PREFILL)
def test_a_replayed_cache_holds_what_its_own_prefill_stores(recorded, text, single_thread):
    model, ids, prefill = recorded
    spec = parse_specs([text])[0]
    own = spec.build(model)
    with torch.inference_mode(), attached(model, own):
        model(ids, past_key_values=own)
    replayed = spec.build(model)
    took = prefill.replay(replayed)
    assert took == (text in REPLAYED)
    if not took:
        return
    assert replayed.get_seq_length() == own.get_seq_length() == ids.shape[1]
    more = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(4))
    for step in (None, more[:, :79], more[:, 79:]):  # after the prefill, then as the next tokens come
        if step is not None:
            with torch.inference_mode():
                for cache in (own, replayed):
                    with attached(model, cache):
                        model(step, past_key_values=cache)
        mine, theirs = held(replayed), held(own)
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs):
            assert a.dtype == b.dtype and torch.equal(a, b)
    if hasattr(own, "recipes"):  # what calibration chose
        assert replayed.recipes() == own.recipes()


@pytest.mark.parametrize("bits", [4, 2])
def test_transformers_quantized_cache_replays_too(recorded, bits, single_thread):
    """transformers' QuantizedCache (quanto), the peer of the suite: its layers return what they are given on the
    first update, so a replay stores what its own prefill stores (compared through the logits that follow)."""
    model, ids, prefill = recorded
    if "gemma" in type(model).__name__.lower():
        pytest.skip("quanto's QuantizedCache takes no sliding-window layers")
    spec = parse_specs([f'hf-quanto:{{"nbits":{bits}}}'])[0]
    own, replayed = spec.build(model), spec.build(model)
    with torch.inference_mode():
        model(ids, past_key_values=own)
        assert prefill.replay(replayed)
        more = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
        assert torch.equal(model(more, past_key_values=own).logits, model(more, past_key_values=replayed).logits)


def test_recording_takes_one_forward_of_the_whole_context_over_a_full_cache(recorded):
    model, ids, _ = recorded
    prefill = PrefillReplay(ids[0].tolist())
    assert not prefill.replay(DynamicCache(config=model.config))  # nothing recorded: nothing to replay
    with pytest.raises(ValueError, match="DynamicCache"):
        with prefill.recording(parse_specs(["int8"])[0].build(model)):
            pass
    with pytest.raises(ValueError, match="one forward"), torch.inference_mode():
        with prefill.recording(DynamicCache(config=model.config)):
            model(ids[:, :100], past_key_values=DynamicCache(config=model.config))  # another cache: no updates
    assert not prefill.updates


@pytest.mark.parametrize("text", ["tiered", "int4"])
def test_a_saved_recording_replays_what_the_recording_replays(recorded, text, tmp_path, single_thread):
    model, ids, prefill = recorded
    path = str(tmp_path / "prefill.pt")
    prefill.save(path)
    loaded = PrefillReplay.load(path, ids[0].tolist())
    spec = parse_specs([text])[0]
    direct, again = spec.build(model), spec.build(model)
    assert prefill.replay(direct) and loaded.replay(again)
    assert all(torch.equal(a, b) for a, b in zip(held(direct), held(again), strict=True))
    with pytest.raises(ValueError, match="holds the prefill of another prompt"):
        PrefillReplay.load(path, ids[0, :-1].tolist())
    with pytest.raises(ValueError, match="nothing recorded to save"):
        PrefillReplay([1, 2]).save(path)


def test_an_eager_model_records_no_queries_so_a_calibrating_cache_runs_its_own_prefill():
    model = tiny_llama(layers=2)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(5))
    prefill = PrefillReplay(ids[0].tolist())
    full = DynamicCache(config=model.config)
    with torch.inference_mode(), prefill.recording(full):
        model(ids, past_key_values=full)
    assert len(prefill.updates) == 2 and not prefill.queries
    assert prefill.replay(parse_specs(["int4"])[0].build(model))
    assert not prefill.replay(parse_specs(["tiered"])[0].build(model))


@pytest.mark.parametrize("mode", ["agnostic", "question"])
def test_answers_through_the_shared_prefill_equal_their_own(smol, mode, single_thread):
    model, tokenizer = smol
    context = tokenizer("The secret number for the word 'harpoon' is 4471. " * 12, add_special_tokens=False).input_ids
    question = tokenizer(" What is the secret number for the word 'harpoon'? It is", add_special_tokens=False).input_ids
    specs = [CacheSpec("dynamic", {}, "dynamic"), *parse_specs(["int4", "kivi", "tiered"])]
    prefill = PrefillReplay(context + (question if mode == "question" else []))
    shared = [answer(model, tokenizer, s, context, question, 6, mode=mode, prefill=prefill) for s in specs]
    alone = [answer(model, tokenizer, s, context, question, 6, mode=mode) for s in specs]
    assert [a.replayed for a in shared] == [False, True, True, True] and prefill.replays == 3
    assert shared == [a if s.name == "dynamic" else type(a)(**{**a.__dict__, "replayed": True})
                      for s, a in zip(specs, alone)]
    assert "4471" in shared[0].text
    other = PrefillReplay(context)  # recorded for the agnostic prompt: the question mode does not take it
    answer(model, tokenizer, specs[0], context, question, 1, mode="agnostic", prefill=other)
    assert not answer(model, tokenizer, specs[1], context, question, 1, mode="question", prefill=other).replayed
    if mode == "question":  # recorded without the last logits (by hand): no first answer token to replay
        bare, full = PrefillReplay(context + question), DynamicCache(config=model.config)
        with torch.inference_mode(), bare.recording(full):
            model(torch.tensor([context + question]), past_key_values=full)
        assert not answer(model, tokenizer, specs[1], context, question, 1, mode=mode, prefill=bare).replayed


@pytest.mark.parametrize("spec", ["dynamic", "int4", "tiered"])
def test_gold_nll_scores_the_answer_as_it_is_decoded_and_leaves_the_cache_as_it_was(spec):
    """`gold_nll` scores the right answer on a copy of the cache, the question in one forward and then a token a
    forward, as the greedy answer is decoded: for the full cache it is the nll of one forward over context + question
    + answer; for a compressed cache, the nll of that decoding loop on its own copy; the cache it was given is left
    as it was."""
    model = tiny_llama(layers=2)
    g = torch.Generator().manual_seed(3)
    context, question, gold = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (96, 7, 5))
    s = CacheSpec("dynamic", {}, "dynamic") if spec == "dynamic" else parse_specs([spec])[0]

    def decoded_nll(cache) -> float:  # the decoding loop, written out
        steps, total = [question] + [[t] for t in gold[:-1]], 0.0
        for ids, want_next in zip(steps, gold):
            logits = model(torch.tensor([ids]), past_key_values=cache).logits[0, -1]
            total -= float(torch.log_softmax(logits.float(), -1)[want_next])
        return total / len(gold)

    with torch.inference_mode():
        logits = model(torch.tensor([context + question + gold])).logits[0]
        one_forward = float(torch.nn.functional.cross_entropy(logits[-len(gold) - 1 : -1], torch.tensor(gold)))
        cache = s.build(model)
        with attached(model, cache):
            model(torch.tensor([context]), past_key_values=cache)
            held, seen = cache.get_seq_length(), memory_stats_bytes(cache)
            got = gold_nll(model, cache, question, gold)
            assert cache.get_seq_length() == held and memory_stats_bytes(cache) == seen  # scored on a copy
            loop = decoded_nll(copy.deepcopy(cache))
            # the question mode's form: the first gold token from the logits after the question
            first = model(torch.tensor([question]), past_key_values=cache).logits[0, -1]
            got_q = gold_nll(model, cache, [], gold, first_logits=first)
    assert got == pytest.approx(loop, abs=1e-6) and got_q == pytest.approx(got, abs=1e-6)
    if spec == "dynamic":
        assert got == pytest.approx(one_forward, abs=1e-5)
    else:  # the answer is read from the compressed context
        assert got != pytest.approx(one_forward, abs=1e-6)
    with pytest.raises(ValueError, match="at least one gold token"):
        gold_nll(model, cache, [], gold)


def memory_stats_bytes(cache) -> int:
    from hf_kvcache.caches.base import memory_stats

    return int(memory_stats(cache)["bytes"])
