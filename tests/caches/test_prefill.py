"""Bounded prefill: generate feeds a long prompt to our caches in chunks of `prefill_chunk_size` (transformers'
chunked prefill), so the prompt's full-precision keys/values never exist at once; the generation config's own value
wins; `None` on the cache turns it off."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kvcache  # noqa: F401
from hf_kvcache import TieredQuantCache, UniformQuantCache


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _forward_lengths(model, **generate_kwargs):
    lengths, original = [], model.forward

    def spy(*args, **kwargs):
        lengths.append(kwargs["input_ids"].shape[1])
        return original(*args, **kwargs)

    model.forward = spy
    try:
        with torch.no_grad():
            model.generate(torch.randint(0, 64, (1, 40)), max_new_tokens=2, do_sample=False, **generate_kwargs)
    finally:
        del model.forward
    return lengths


def test_prompt_prefilled_in_chunks(tiny):
    cache = UniformQuantCache(config=tiny.config, dtype="int8")
    cache.prefill_chunk_size = 16
    assert _forward_lengths(tiny, past_key_values=cache) == [16, 16, 8, 1]
    assert tiny.generation_config.prefill_chunk_size is None  # generate worked on its own copy
    assert cache.get_seq_length() == 41  # 40 prompt tokens + the first new one (the second is not fed back)


def test_generation_config_wins_and_none_turns_it_off(tiny):
    cache = TieredQuantCache(config=tiny.config, tail_length=8, warm_length=0, group_size=8)
    cache.prefill_chunk_size = 16
    assert _forward_lengths(tiny, past_key_values=cache, prefill_chunk_size=32) == [32, 8, 1]
    cache = UniformQuantCache(config=tiny.config, dtype="int8")
    cache.prefill_chunk_size = None
    assert _forward_lengths(tiny, past_key_values=cache) == [40, 1]
    assert UniformQuantCache.prefill_chunk_size == 512  # the default: prompts up to 512 tokens in one forward
