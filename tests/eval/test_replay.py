"""One recorded prefill shared by the caches of a prompt (`eval/replay.py`): a replayed cache holds exactly what its
own prefill forward stores, bit for bit; a cache whose prefill asks the attention for something gives up; answers
through the shared prefill equal those without it."""

import pytest
import torch
from models import tiny_llama
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

import hf_kvcache  # noqa: F401
from hf_kvcache.eval.bench import CacheSpec, parse_specs
from hf_kvcache.eval.replay import PrefillReplay
from hf_kvcache.eval.suites.passkey import answer
from hf_kvcache.registry import attached

REPLAYED = ["int8", "int4", "fp8", "kivi", "tiered_long", 'tiered:{"rotation":"none"}']
OWN_PREFILL = ["tiered", 'h2o:{"budget":0.5}', "cpac"]  # calibration queries / attention mass in the prefill


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
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(3))
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
    if took:
        assert replayed.get_seq_length() == own.get_seq_length() == ids.shape[1]
        mine, theirs = held(replayed), held(own)
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs):
            assert a.dtype == b.dtype and torch.equal(a, b)


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


@pytest.mark.parametrize("mode", ["agnostic", "question"])
def test_answers_through_the_shared_prefill_equal_their_own(smol, mode, single_thread):
    model, tokenizer = smol
    context = tokenizer("The secret number for the word 'harpoon' is 4471. " * 12, add_special_tokens=False).input_ids
    question = tokenizer(" What is the secret number for the word 'harpoon'? It is", add_special_tokens=False).input_ids
    specs = [CacheSpec("dynamic", {}, "dynamic"), *parse_specs(["int4", "kivi", "tiered"])]
    prefill = PrefillReplay(context + (question if mode == "question" else []))
    shared = [answer(model, tokenizer, s, context, question, 6, mode=mode, prefill=prefill) for s in specs]
    alone = [answer(model, tokenizer, s, context, question, 6, mode=mode) for s in specs]
    assert [a.replayed for a in shared] == [False, True, True, False] and prefill.replays == 2
    assert shared == [a if s.name in ("dynamic", "tiered") else type(a)(**{**a.__dict__, "replayed": True})
                      for s, a in zip(specs, alone)]
    assert "4471" in shared[0].text
    other = PrefillReplay(context)  # recorded for the agnostic prompt: the question mode does not take it
    answer(model, tokenizer, specs[0], context, question, 1, mode="agnostic", prefill=other)
    assert not answer(model, tokenizer, specs[1], context, question, 1, mode="question", prefill=other).replayed
