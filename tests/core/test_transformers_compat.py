"""The keyword our own calls hand a cache under: the one the installed transformers expects, so nothing warns."""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import DynamicCache, LlamaForCausalLM

from hf_kvcache.caches import UniformQuantCache
from hf_kvcache.eval.perplexity import streaming_perplexity
from hf_kvcache.transformers_compat import CACHE_KWARG, cache_kwargs
from models import tiny_llama


def test_the_keyword_is_the_one_the_installed_forward_declares() -> None:
    expected = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
    cache = DynamicCache()
    assert CACHE_KWARG == expected
    assert cache_kwargs(cache) == {expected: cache}


def test_both_keywords_give_the_same_logits() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            old = model(ids, past_key_values=DynamicCache(config=model.config)).logits
    torch.testing.assert_close(ours, old, atol=0, rtol=0)


def test_our_loops_raise_no_deprecation_warning() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        result = streaming_perplexity(model, ids, UniformQuantCache(config=model.config, dtype="int8"), chunk_size=16)
        model.generate(ids[:, :8], max_new_tokens=3, do_sample=False, **cache_kwargs(DynamicCache(config=model.config)))
    assert result.tokens == 40 and len(result.chunk_nll) == 3  # the loop ran all three chunks
